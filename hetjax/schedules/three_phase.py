"""Three-phase schedule for colocated execution (encoders share the LLM's devices).

When encoders and the LLM read the same GPUs as different logical grids, interleaving
encoder work with the LLM's staggered pipeline would interleave their collectives. The
paper's colocated schedule therefore runs three global phases:

1. ``encoder_forward`` - each encoder runs F for every microbatch, then the forward
   colocated transform of every microbatch (``SEND_F`` on the encoder -> LLM edge);
2. ``llm_pipeline`` - the LLM's own 1F1B over all microbatches; its first stage
   ``RECV_F``s the already-transformed (detached) encoder outputs, and ``SEND_B``s their
   gradients back after each B;
3. ``encoder_backward`` - the backward transform of every microbatch's gradient
   (``RECV_B``) then the encoder backward of every microbatch; after it, LLM and encoder
   gradients are finalised together (``Schedule.finalize == "together"``).

Modelling choices:

- Each encoder is one logical stage of its own (pp=1: a colocated encoder is data
  parallel over all LLM devices rather than pipelined). Its `StageInfo.devices` lists
  every LLM device group, so the simulator never overlaps it with LLM work, and the
  phase barriers keep the checker and runtime from interleaving it.
- The transform is the send/recv pair on the boundary edge: in colocated mode a "send"
  is a local re-layout (all-gather or slice among the same ranks), not a transfer.
- Encoder backward is one ``B`` per microbatch so every stage obeys "one F and one B per
  microbatch"; the phase contains nothing else, so a runtime may fuse the M encoder
  backwards into the reference's single encoder backward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ._blocks import edges_by_stage, one_f_one_b_list, require_positive
from .actions import Action, Edge, backward, forward, transfer
from .graph import ModuleGraph
from .schedule import Schedule, StageInfo, build_schedule

THREE_PHASES: tuple[str, str, str] = ("encoder_forward", "llm_pipeline", "encoder_backward")
"""Phase names of `three_phase`, in execution order."""

ENCODER_FORWARD, LLM_PIPELINE, ENCODER_BACKWARD = range(3)


def three_phase(
    encoders: Sequence[str] | Mapping[str, int],
    llm_pp: int,
    num_microbatches: int,
    *,
    llm: str = "llm",
) -> Schedule:
    """The colocated three-phase schedule.

    Args:
        encoders: Encoder module names, each feeding the LLM's first stage. A mapping
            name -> pp is accepted for symmetry with `ModuleGraph` but every pp must be
            1 (a colocated encoder is not pipelined).
        llm_pp: The LLM's pipeline degree (P).
        num_microbatches: Microbatches per step (M).
        llm: The LLM module's name.

    Returns:
        A schedule named ``"three_phase"``: encoder stages first (global ids 0..E-1, in
        the given order), then the LLM's P stages; ``phases == THREE_PHASES``;
        ``max_live`` is M on encoders and ``min(P - s, M)`` on LLM stage s.

    Raises:
        ValueError: On no encoders, a duplicate or clashing name, an encoder pp other
            than 1, or P or M below 1.

    Example:
        >>> print(three_phase(["vision"], 2, 2).to_text(compute_only=True))
        0 vision[0/1]: F0 F1 | B0 B1
        1 llm[0/2]: F0 F1 B0 B1
        2 llm[1/2]: F0 B0 F1 B1
    """
    names = _encoder_names(encoders, llm)
    require_positive("llm_pp", llm_pp)
    require_positive("num_microbatches", num_microbatches)
    num_enc, num_mb = len(names), num_microbatches
    all_llm_devices = tuple(range(llm_pp))
    stages = [StageInfo(i, name, 0, 1, all_llm_devices) for i, name in enumerate(names)]
    stages += [StageInfo(num_enc + s, llm, s, llm_pp, (s,)) for s in range(llm_pp)]
    edges = [Edge(name, i, llm, num_enc) for i, name in enumerate(names)]
    edges += [Edge(llm, num_enc + s, llm, num_enc + s + 1) for s in range(llm_pp - 1)]
    ins, outs = edges_by_stage(len(stages), edges)

    actions: list[list[Action]] = []
    for info in stages[:num_enc]:
        (edge,) = outs[info.stage]
        acts = [forward(info.stage, m, info.module, phase=ENCODER_FORWARD) for m in range(num_mb)]
        acts += [transfer("SEND_F", edge, m, phase=ENCODER_FORWARD) for m in range(num_mb)]
        acts += [transfer("RECV_B", edge, m, phase=ENCODER_BACKWARD) for m in range(num_mb)]
        acts += [
            backward(info.stage, m, info.module, phase=ENCODER_BACKWARD) for m in range(num_mb)
        ]
        actions.append(acts)
    for info in stages[num_enc:]:
        warmup = min(llm_pp - info.index - 1, num_mb)
        actions.append(
            one_f_one_b_list(
                info, ins[info.stage], outs[info.stage], num_mb, warmup, phase=LLM_PIPELINE
            )
        )
    max_live = [num_mb] * num_enc + [min(llm_pp - s, num_mb) for s in range(llm_pp)]
    return build_schedule(
        "three_phase",
        num_mb,
        stages,
        edges,
        actions,
        max_live,
        phases=THREE_PHASES,
        finalize="together",
    )


def three_phase_for_graph(graph: ModuleGraph, num_microbatches: int) -> Schedule:
    """`three_phase` for a star-shaped `ModuleGraph`: encoders (pp=1) feeding one LLM.

    Args:
        graph: The module graph; its only sink is the LLM and every other module must be
            a pp=1 source with a single edge into the LLM.
        num_microbatches: Microbatches per step (M).

    Returns:
        ``three_phase(encoders, pp_llm, M, llm=sink)`` with encoders in declaration order.

    Raises:
        ValueError: If the graph is not such a star.
    """
    if len(graph.sinks) != 1:
        raise ValueError(
            f"three_phase needs one LLM (one sink); the graph has sinks {graph.sinks}. "
            "Use graph_one_f_one_b for other graphs."
        )
    (llm,) = graph.sinks
    encoders = {name: pp for name, pp in graph.modules.items() if name != llm}
    for name in encoders:
        if graph.successors(name) != (llm,) or graph.predecessors(name):
            raise ValueError(
                f"three_phase needs every encoder to feed {llm!r} directly; module {name!r} "
                "does not. Use graph_one_f_one_b for deeper graphs."
            )
    return three_phase(encoders, graph.modules[llm], num_microbatches, llm=llm)


def _encoder_names(encoders: Sequence[str] | Mapping[str, int], llm: str) -> list[str]:
    if isinstance(encoders, str):
        raise ValueError(f"encoders must be a list of names, not the string {encoders!r}.")
    if isinstance(encoders, Mapping):
        for name, pp in encoders.items():
            if pp != 1:
                raise ValueError(
                    f"colocated encoder {name!r} has pp={pp}; a colocated encoder runs "
                    "data-parallel on all LLM devices, so use pp=1, or use "
                    "graph_one_f_one_b (non-colocated) to pipeline it."
                )
    names = list(encoders)
    if not names:
        raise ValueError("three_phase needs at least one encoder; for an LLM alone use 1f1b.")
    if len(set(names)) != len(names) or llm in names:
        raise ValueError(
            f"encoder names {names} and llm name {llm!r} must all be distinct; rename one."
        )
    return names
