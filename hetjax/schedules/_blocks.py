"""Building blocks shared by the schedule generators (private).

Every generator emits the same per-microbatch blocks: a forward block is "receive from
every in-edge, F, send on every out-edge" and a backward block is "receive a gradient
from every out-edge, B, send a gradient on every in-edge". Schedules differ only in how
they order blocks, so the ordering lives in the generators and the blocks live here.
The order inside a block follows Megatron's ``MultiModulePipelineCommunicator``: a join
receives from its incoming edges in source-module order; a branch sends on each
outgoing edge.
"""

from __future__ import annotations

from collections.abc import Sequence

from .actions import Action, Edge, backward, forward, transfer
from .schedule import StageInfo


def require_positive(name: str, value: int) -> None:
    """Raise a one-line `ValueError` unless ``value`` is an int >= 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}.")


def recv_forward(ins: Sequence[Edge], m: int, phase: int) -> list[Action]:
    """RECV_F of microbatch ``m`` on every in-edge."""
    return [transfer("RECV_F", e, m, phase=phase) for e in ins]


def forward_block(
    info: StageInfo, ins: Sequence[Edge], outs: Sequence[Edge], m: int, phase: int
) -> list[Action]:
    """RECV_F from every in-edge, F, SEND_F on every out-edge."""
    return [
        *recv_forward(ins, m, phase),
        *forward_and_send(info, outs, m, phase),
    ]


def forward_and_send(info: StageInfo, outs: Sequence[Edge], m: int, phase: int) -> list[Action]:
    """F of microbatch ``m`` then SEND_F on every out-edge (inputs already received)."""
    return [
        forward(info.stage, m, info.module, phase=phase),
        *(transfer("SEND_F", e, m, phase=phase) for e in outs),
    ]


def backward_block(
    info: StageInfo, ins: Sequence[Edge], outs: Sequence[Edge], m: int, phase: int
) -> list[Action]:
    """RECV_B from every out-edge, B, SEND_B on every in-edge."""
    return [
        *(transfer("RECV_B", e, m, phase=phase) for e in outs),
        backward(info.stage, m, info.module, phase=phase),
        *(transfer("SEND_B", e, m, phase=phase) for e in ins),
    ]


def all_forward_all_backward(
    info: StageInfo, ins: Sequence[Edge], outs: Sequence[Edge], num_mb: int, phase: int = 0
) -> list[Action]:
    """GPipe order: forward blocks of microbatches 0..M-1, then backward blocks 0..M-1."""
    acts: list[Action] = []
    for m in range(num_mb):
        acts += forward_block(info, ins, outs, m, phase)
    for m in range(num_mb):
        acts += backward_block(info, ins, outs, m, phase)
    return acts


def one_f_one_b_list(
    info: StageInfo,
    ins: Sequence[Edge],
    outs: Sequence[Edge],
    num_mb: int,
    warmup: int,
    phase: int = 0,
) -> list[Action]:
    """One stage's 1F1B list, in the order Megatron issues the same operations.

    Megatron's ``forward_backward_pipelining_without_interleaving``: ``warmup`` forward
    blocks; then, if work remains, the first steady-state ``recv_forward``; each
    steady-state step is F, ``send_forward_recv_backward``, B, then
    ``send_backward_recv_forward`` (``send_backward`` on the last step); the cool-down
    runs the remaining backward blocks. Backwards go in microbatch order.

    Args:
        info: The stage.
        ins: Edges feeding the stage.
        outs: Edges the stage feeds.
        num_mb: Microbatches (M).
        warmup: Forwards before the first backward, already capped at M.
        phase: Phase index stamped on every action.

    Returns:
        The ordered action list.
    """
    acts: list[Action] = []
    for m in range(warmup):
        acts += forward_block(info, ins, outs, m, phase)
    remaining = num_mb - warmup
    if remaining > 0:
        acts += recv_forward(ins, warmup, phase)
    for i in range(remaining):
        fwd_mb, bwd_mb = warmup + i, i
        acts += forward_and_send(info, outs, fwd_mb, phase)
        acts += backward_block(info, ins, outs, bwd_mb, phase)
        if i != remaining - 1:
            acts += recv_forward(ins, fwd_mb + 1, phase)
    for m in range(remaining, num_mb):
        acts += backward_block(info, ins, outs, m, phase)
    return acts


def edges_by_stage(
    num_stages: int, edges: Sequence[Edge]
) -> tuple[list[list[Edge]], list[list[Edge]]]:
    """Split ``edges`` into per-stage incoming and outgoing lists, keeping their order."""
    ins: list[list[Edge]] = [[] for _ in range(num_stages)]
    outs: list[list[Edge]] = [[] for _ in range(num_stages)]
    for e in edges:
        ins[e.dst_stage].append(e)
        outs[e.src_stage].append(e)
    return ins, outs
