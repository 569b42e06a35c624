"""The run plan: everything about a run that needs no parameters, checked once.

:func:`plan_run` takes a training graph and the execution settings (mode, islands,
microbatches, schedule order, offload) and returns a :class:`RunPlan`: the effective
graph (the homogeneous baseline's inherited layouts applied here, once), each module's
device positions, the checked schedule and its lowered ops. Every check of those
settings lives here, so a front end can call it before building any parameter or
compiling anything; the :class:`~hetjax.runtime.executor.Executor` consumes the plan and
re-checks nothing. Errors name parameters (``islands``, ``schedule``,
``offload_encoders``); a CLI translates them into its flag names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax

from hetjax import schedules as hs
from hetjax.meshes import (
    LayoutError,
    ModuleMesh,
    island_positions,
    module_meshes,
    module_positions,
    validate_batch,
)
from hetjax.runtime.feed import skippable_modules
from hetjax.runtime.graph import TrainGraph
from hetjax.runtime.lowering import (
    MODES,
    Mode,
    Op,
    ScheduleOrder,
    StageKey,
    build_schedule,
    drop_frozen,
    lower,
)
from hetjax.runtime.rebalance import check_rebalance


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """A validated, parameter-free description of how a graph trains.

    Attributes:
        graph: the effective graph (the homogeneous baseline: encoders carry the sink's
            layout without pp).
        mode: ``"colocated"``, ``"non-colocated"`` or ``"homogeneous"``.
        num_devices: devices of the run.
        positions: module -> positions of its devices in the run's device list.
        microbatches: pipeline microbatches per global batch.
        schedule: the checked schedule.
        ops: the schedule lowered to dispatchable ops.
        offload_encoders: colocated only: encoder state in host memory in the LLM phase.
        routed: links ``(src, dst)`` into a cp > 1 module that merges them into
            placeholders -> ``(sequence batch key, placeholder id)``: each cp rank then
            receives only its own positions' tokens.
        rebalance: encoders whose image slots are dealt evenly over their batch ranks
            every step (:mod:`hetjax.runtime.rebalance`).
    """

    graph: TrainGraph
    mode: Mode
    num_devices: int
    positions: Mapping[str, tuple[int, ...]]
    microbatches: int
    schedule: hs.Schedule
    ops: tuple[Op, ...]
    offload_encoders: bool = False
    routed: Mapping[tuple[str, str], tuple[str, int]] = dataclasses.field(default_factory=dict)
    rebalance: tuple[str, ...] = ()

    @property
    def stage_keys(self) -> tuple[StageKey, ...]:
        """Every ``(module, stage)`` of the run, in graph order."""
        return tuple((m.name, s) for m in self.graph.modules for s in range(m.layout.pp))

    @property
    def stage_ids(self) -> dict[StageKey, int]:
        """``(module, stage)`` -> global stage id of the schedule."""
        return {(i.module, i.index): i.stage for i in self.schedule.stages}

    def meshes(self, devices: Sequence[jax.Device]) -> dict[str, ModuleMesh]:
        """Each module's mesh over ``devices`` (the run's devices, canonical order)."""
        if len(devices) != self.num_devices:
            raise LayoutError(
                f"the plan is for num_devices={self.num_devices} but {len(devices)} devices "
                "were given; plan with the devices you run on"
            )
        layouts = {spec.name: spec.layout for spec in self.graph.modules}
        return module_meshes(layouts, devices, self.positions)

    def check_batch(self, global_batch: int) -> None:
        """Every module's ``dp x microbatches`` divides ``global_batch`` (one-line errors)."""
        check_batch(self.graph, global_batch, self.microbatches)


def check_batch(graph: TrainGraph, global_batch: int, microbatches: int) -> None:
    """Every module's ``dp x microbatches`` divides the global batch (one-line errors)."""
    for spec in graph.modules:
        validate_batch(spec.name, spec.layout, global_batch, microbatches)


def homogeneous_graph(graph: TrainGraph) -> TrainGraph:
    """Every encoder inherits the sink's layout (without PP), as in stock Megatron."""
    sink = graph.module(graph.sink).layout
    inherited = dataclasses.replace(sink, pp=1)
    return graph.with_layouts({m.name: inherited for m in graph.modules if m.name != graph.sink})


def plan_run(
    graph: TrainGraph,
    *,
    num_devices: int,
    mode: Mode = "colocated",
    islands: Mapping[str, int] | None = None,
    microbatches: int = 1,
    schedule: ScheduleOrder = "1f1b",
    offload_encoders: bool = False,
    global_batch: int | None = None,
    rebalance: Sequence[str] = (),
) -> RunPlan:
    """Checks a run's settings and plans it (no devices, parameters or compiles needed).

    Args:
        graph: modules with their layouts, and the links between them.
        num_devices: devices of the run.
        mode: ``"colocated"`` (all modules on all devices; three-phase schedule),
            ``"non-colocated"`` (disjoint islands; graph-aware 1F1B or GPipe) or
            ``"homogeneous"`` (the baseline: encoders take the sink's layout, on its
            first stage's devices).
        islands: non-colocated only: module -> device count of its island, assigned in
            order.
        microbatches: pipeline microbatches per global batch.
        schedule: ``"1f1b"`` or ``"gpipe"`` order of the pipelined part.
        offload_encoders: colocated only: encoder state in host memory in the LLM phase.
        global_batch: if given, also checks that every module's batch splits.
        rebalance: encoders whose image slots are dealt evenly over their batch ranks
            per step (:mod:`hetjax.runtime.rebalance`).

    Returns:
        The plan.

    Raises:
        LayoutError: any setting that cannot run, naming the parameter and the fix.
    """
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise LayoutError(f"microbatches={microbatches!r} must be an int >= 1")
    if schedule not in ("1f1b", "gpipe"):
        raise LayoutError(f"unknown schedule={schedule!r}; use schedule='1f1b' or 'gpipe'")
    if mode not in MODES:
        raise LayoutError(f"unknown mode={mode!r}; use one of {', '.join(map(repr, MODES))}")
    if offload_encoders and mode != "colocated":
        raise LayoutError(
            "encoder offload needs the colocated three-phase schedule (the encoder is idle "
            "during the LLM phase); drop offload_encoders=True or use mode='colocated'"
        )
    if mode == "colocated" and schedule != "1f1b":
        raise LayoutError(
            f"colocated placement runs the three-phase schedule (its LLM phase is 1F1B); "
            f"schedule={schedule!r} is only for non-colocated or homogeneous runs"
        )
    if islands is not None and mode != "non-colocated":
        raise LayoutError(
            "islands are only for non-colocated placement; drop islands or use mode='non-colocated'"
        )
    if mode == "homogeneous":
        graph = homogeneous_graph(graph)
    names = [m.name for m in graph.modules]
    check_rebalance(tuple(rebalance), names, skippable_modules(graph))
    layouts = {m.name: m.layout for m in graph.modules}
    if mode == "non-colocated":  # island sizes, in placement order
        islands = island_positions(islands, layouts, num_devices)
    positions = module_positions(
        layouts, num_devices, placement=mode, islands=islands, sink=graph.sink
    )
    if global_batch is not None:
        check_batch(graph, global_batch, microbatches)
    sched = build_schedule(graph, mode, schedule, microbatches)
    routed = {}
    if mode != "homogeneous":  # the baseline's encoders already sit on the LLM's devices
        for l in graph.links:
            dst = graph.module(l.dst)
            slots = {name: (key, pid) for name, key, pid in dst.token_slots}
            if dst.layout.cp > 1 and l.name in slots:
                routed[(l.src, l.dst)] = slots[l.name]
    return RunPlan(
        graph=graph,
        mode=mode,
        num_devices=num_devices,
        positions=positions,
        microbatches=microbatches,
        schedule=sched,
        ops=drop_frozen(lower(sched, fused=mode == "homogeneous"), graph),
        offload_encoders=offload_encoders,
        routed=routed,
        rebalance=tuple(rebalance),
    )
