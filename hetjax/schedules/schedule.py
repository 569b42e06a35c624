"""`Schedule`: one ordered action list per pipeline stage, plus what the lists promise.

A schedule is plain immutable data so it can be generated, checked
(`hetjax.schedules.check_schedule`), simulated (`hetjax.schedules.simulate`), printed and
executed by a runtime without any of those knowing how it was built. The stage topology
travels with it (`Schedule.edges`), so the checker needs no module graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

from .actions import Action, Edge

FinalizeMode = Literal["per_stage", "together"]
"""When gradients are reduced and applied: ``per_stage`` - a stage may finalise as soon
as its own list is done (Megatron 1F1B); ``together`` - every stage waits for the end of
the last phase, so all modules' gradients are finalised at one point (three-phase)."""


@dataclasses.dataclass(frozen=True)
class StageInfo:
    """What a global pipeline stage is.

    Attributes:
        stage: Global stage id (equal to its position in `Schedule.stages`).
        module: Name of the module this stage belongs to.
        index: Pipeline stage index within the module, in ``[0, pp)``.
        pp: The module's pipeline-parallel degree.
        devices: Abstract device-group ids the stage runs on. Stages whose groups
            intersect share hardware and never run at the same time (colocated
            modules). ``None`` means a private device group shared with no stage.
    """

    stage: int
    module: str
    index: int
    pp: int
    devices: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.pp:
            raise ValueError(
                f"stage {self.stage} of module {self.module!r} has index {self.index}, "
                f"outside [0, pp={self.pp}); index counts the module's own stages from 0."
            )

    def __str__(self) -> str:
        return f"{self.module}[{self.index}/{self.pp}]"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: ordered actions per stage.

    Attributes:
        name: Human-readable name, e.g. ``"1f1b"``.
        num_microbatches: Microbatches per step (M).
        stages: One `StageInfo` per global stage, ``stages[s].stage == s``.
        edges: Every stage-to-stage data edge (intra-module and boundary).
        actions: ``actions[s]`` is stage s's ordered action list.
        max_live: Per stage, the most microbatches whose F has run and B has not,
            which the schedule promises never to exceed (activation memory bound).
        phases: Phase names; `Action.phase` indexes this tuple. Phases are global
            barriers (see `Action`).
        finalize: When gradients are finalised; see `FinalizeMode`.
    """

    name: str
    num_microbatches: int
    stages: tuple[StageInfo, ...]
    edges: tuple[Edge, ...]
    actions: tuple[tuple[Action, ...], ...]
    max_live: tuple[int, ...]
    phases: tuple[str, ...] = ("pipeline",)
    finalize: FinalizeMode = "per_stage"

    @property
    def num_stages(self) -> int:
        """Number of global stages."""
        return len(self.stages)

    @property
    def modules(self) -> tuple[str, ...]:
        """Module names in stage order, each once."""
        return tuple(dict.fromkeys(info.module for info in self.stages))

    def stages_of(self, module: str) -> tuple[int, ...]:
        """Global stage ids of ``module``, in pipeline order."""
        return tuple(info.stage for info in self.stages if info.module == module)

    def in_edges(self, stage: int) -> tuple[Edge, ...]:
        """Edges that feed ``stage`` its forward inputs, in schedule order."""
        return tuple(e for e in self.edges if e.dst_stage == stage)

    def out_edges(self, stage: int) -> tuple[Edge, ...]:
        """Edges that carry ``stage``'s forward outputs, in schedule order."""
        return tuple(e for e in self.edges if e.src_stage == stage)

    def compute_order(self, stage: int) -> tuple[tuple[str, int], ...]:
        """The F/B steps of ``stage`` as ``(kind, microbatch)`` pairs, sends/recvs dropped.

        Example:
            >>> from hetjax.schedules import one_f_one_b
            >>> one_f_one_b(2, 2).compute_order(1)
            (('F', 0), ('B', 0), ('F', 1), ('B', 1))
        """
        return tuple((a.kind, a.microbatch) for a in self.actions[stage] if a.is_compute)

    def leading_forwards(self, stage: int) -> int:
        """Forwards ``stage`` runs before its first backward.

        For 1F1B this is the warm-up count plus one (the first steady-state forward),
        capped at M: a stage whose warm-up is M or M - 1 has the same F/B order.
        """
        order = self.compute_order(stage)
        return next((i for i, (kind, _) in enumerate(order) if kind == "B"), len(order))

    def peak_live(self, stage: int) -> int:
        """Most activations held at once on ``stage`` (F done, B not yet done)."""
        live = peak = 0
        for kind, _ in self.compute_order(stage):
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        return peak

    def to_text(self, *, compute_only: bool = False) -> str:
        """Render the action lists, one line per stage.

        Args:
            compute_only: Drop sends and recvs (``F0 F1 B0 ...``).

        Returns:
            Multi-line text, e.g. ``"0 llm[0/2]: F0 >F0 F1 >F1 <B0 B0 ..."`` where
            ``>`` marks a send, ``<`` a recv, and ``|`` a phase change.
        """
        marks = {"F": "F", "B": "B", "SEND_F": ">F", "RECV_F": "<F", "SEND_B": ">B", "RECV_B": "<B"}
        lines = []
        for info, acts in zip(self.stages, self.actions, strict=True):
            words, phase = [], acts[0].phase if acts else 0
            for a in acts:
                if compute_only and not a.is_compute:
                    continue
                if a.phase != phase:
                    words.append("|")
                    phase = a.phase
                words.append(f"{marks[a.kind]}{a.microbatch}")
            lines.append(f"{info.stage} {info}: {' '.join(words)}")
        return "\n".join(lines)


def build_schedule(
    name: str,
    num_microbatches: int,
    stages: Sequence[StageInfo],
    edges: Sequence[Edge],
    actions: Sequence[Sequence[Action]],
    max_live: Sequence[int],
    *,
    phases: Sequence[str] = ("pipeline",),
    finalize: FinalizeMode = "per_stage",
) -> Schedule:
    """Build a `Schedule` from lists, freezing every sequence into a tuple.

    Args:
        name: Schedule name.
        num_microbatches: Microbatches per step.
        stages: Stage descriptions in global stage order.
        edges: Stage-to-stage data edges.
        actions: Per-stage action lists.
        max_live: Per-stage live-activation bound.
        phases: Phase names.
        finalize: Gradient finalisation mode.

    Returns:
        The frozen schedule (not checked; call `check_schedule` for that).
    """
    return Schedule(
        name=name,
        num_microbatches=num_microbatches,
        stages=tuple(stages),
        edges=tuple(edges),
        actions=tuple(tuple(a) for a in actions),
        max_live=tuple(max_live),
        phases=tuple(phases),
        finalize=finalize,
    )
