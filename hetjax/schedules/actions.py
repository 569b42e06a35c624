"""The atoms of a pipeline schedule: stage-to-stage edges and per-stage actions.

A schedule is data, not code: each pipeline stage owns an ordered list of `Action`s and
a runtime walks those lists. Communication is explicit - a forward activation crosses an
`Edge` as a ``SEND_F`` on the edge's source stage paired with a ``RECV_F`` on its
destination stage, and the gradient comes back as ``SEND_B`` (destination) paired with
``RECV_B`` (source). Making transfers first-class actions, instead of leaving them
implicit in the F/B order as many pipeline libraries do, lets the checker prove that the
send/recv order cannot deadlock and lets a runtime issue transfers exactly where the
schedule says.

Stage ids are global: the stages of every module in one flat numbering (see
`hetjax.schedules.graph.ModuleGraph.flatten`).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

ActionKind = Literal["F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B"]
"""F / B: forward / backward of one microbatch on one stage; SEND_F / RECV_F: hand an
activation forward along an edge; SEND_B / RECV_B: hand its gradient back."""

ACTION_KINDS: tuple[str, ...] = get_args(ActionKind)
COMPUTE_KINDS: frozenset[str] = frozenset({"F", "B"})
SEND_KINDS: frozenset[str] = frozenset({"SEND_F", "SEND_B"})
RECV_KINDS: frozenset[str] = frozenset({"RECV_F", "RECV_B"})
COMM_KINDS: frozenset[str] = SEND_KINDS | RECV_KINDS

# The kinds that run on an edge's source stage (activation leaves, gradient arrives);
# the other two run on its destination stage.
_ON_EDGE_SOURCE: frozenset[str] = frozenset({"SEND_F", "RECV_B"})


@dataclasses.dataclass(frozen=True, order=True)
class Edge:
    """A directed stage-to-stage data edge (activations flow src -> dst).

    Edges inside a module join consecutive pipeline stages; edges between modules join
    the source module's last stage to the destination module's first stage.

    Attributes:
        src_module: Module that produces the activation.
        src_stage: Global id of the producing stage.
        dst_module: Module that consumes the activation.
        dst_stage: Global id of the consuming stage.
    """

    src_module: str
    src_stage: int
    dst_module: str
    dst_stage: int

    def __post_init__(self) -> None:
        if self.src_stage == self.dst_stage:
            raise ValueError(
                f"edge {self} joins stage {self.src_stage} to itself; an edge must join "
                "two different stages."
            )
        if min(self.src_stage, self.dst_stage) < 0:
            raise ValueError(f"edge {self} has a negative stage id; stage ids start at 0.")

    @property
    def is_boundary(self) -> bool:
        """Whether the edge crosses between two modules (a boundary communicator)."""
        return self.src_module != self.dst_module

    def __str__(self) -> str:
        return f"{self.src_module}@{self.src_stage}->{self.dst_module}@{self.dst_stage}"


@dataclasses.dataclass(frozen=True)
class Action:
    """One step in a stage's ordered action list.

    Attributes:
        kind: What the stage does; see `ActionKind`.
        stage: Global id of the stage that runs the action.
        microbatch: Microbatch index in ``[0, num_microbatches)``.
        module: Name of the module whose stage runs the action (informational; the
            checker verifies it matches the stage when set).
        edge: The edge a send/recv travels on; ``None`` for F and B.
        phase: Index into `Schedule.phases`. All actions of phase k, on every stage,
            finish before any action of phase k + 1 starts (a global barrier).
    """

    kind: ActionKind
    stage: int
    microbatch: int
    module: str | None = None
    edge: Edge | None = None
    phase: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise ValueError(
                f"unknown action kind {self.kind!r}; use one of {', '.join(ACTION_KINDS)}."
            )
        if self.microbatch < 0 or self.stage < 0 or self.phase < 0:
            raise ValueError(f"{self!r}: stage, microbatch and phase must be >= 0.")
        if self.kind in COMPUTE_KINDS:
            if self.edge is not None:
                raise ValueError(f"{self.kind} action on stage {self.stage} must not have an edge.")
            return
        if self.edge is None:
            raise ValueError(
                f"{self.kind} action on stage {self.stage} needs the edge it travels on."
            )
        expected = self.edge.src_stage if self.kind in _ON_EDGE_SOURCE else self.edge.dst_stage
        if self.stage != expected:
            raise ValueError(
                f"{self.kind} on edge {self.edge} runs on stage {expected}, not {self.stage}; "
                "SEND_F/RECV_B run on the edge's source stage, RECV_F/SEND_B on its destination."
            )

    @property
    def is_compute(self) -> bool:
        """Whether the action is a forward or backward step."""
        return self.kind in COMPUTE_KINDS

    @property
    def is_send(self) -> bool:
        """Whether the action sends an activation or gradient."""
        return self.kind in SEND_KINDS

    @property
    def is_recv(self) -> bool:
        """Whether the action receives an activation or gradient."""
        return self.kind in RECV_KINDS

    @property
    def peer(self) -> int | None:
        """The stage at the other end of a send/recv, ``None`` for F and B."""
        if self.edge is None:
            return None
        return self.edge.dst_stage if self.stage == self.edge.src_stage else self.edge.src_stage

    @property
    def direction(self) -> Literal["F", "B"]:
        """``"F"`` for forward work (F, SEND_F, RECV_F), ``"B"`` for backward work."""
        return "F" if self.kind.endswith("F") else "B"

    def transfer_key(self) -> tuple[str, Edge, int]:
        """Key shared by a send and the recv it pairs with: (direction, edge, microbatch).

        Raises:
            ValueError: If the action is F or B.
        """
        if self.edge is None:
            raise ValueError(f"{self} is not a send or a recv; it has no transfer key.")
        return (self.direction, self.edge, self.microbatch)

    def __str__(self) -> str:
        if self.edge is None:
            return f"{self.kind}(mb={self.microbatch}, stage={self.stage})"
        return f"{self.kind}(mb={self.microbatch}, {self.edge})"


def forward(stage: int, microbatch: int, module: str | None = None, *, phase: int = 0) -> Action:
    """Build an ``F`` action."""
    return Action("F", stage, microbatch, module, phase=phase)


def backward(stage: int, microbatch: int, module: str | None = None, *, phase: int = 0) -> Action:
    """Build a ``B`` action."""
    return Action("B", stage, microbatch, module, phase=phase)


def transfer(kind: ActionKind, edge: Edge, microbatch: int, *, phase: int = 0) -> Action:
    """Build a send/recv action on ``edge``, placed on the stage the kind runs on.

    Args:
        kind: One of SEND_F, RECV_F, SEND_B, RECV_B.
        edge: The edge the data travels on.
        microbatch: The microbatch the data belongs to.
        phase: Phase index of the action.

    Returns:
        The action, with ``stage`` and ``module`` taken from the right end of ``edge``.

    Example:
        >>> e = Edge("llm", 0, "llm", 1)
        >>> transfer("SEND_F", e, 3).stage, transfer("RECV_F", e, 3).stage
        (0, 1)
    """
    if kind not in COMM_KINDS:
        raise ValueError(f"transfer() builds sends and recvs, not {kind!r}.")
    on_source = kind in _ON_EDGE_SOURCE
    stage = edge.src_stage if on_source else edge.dst_stage
    module = edge.src_module if on_source else edge.dst_module
    return Action(kind, stage, microbatch, module, edge, phase)
