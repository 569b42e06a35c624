"""Lowering: a checked schedule (per-stage action lists) -> the executor's op list.

A :class:`hetjax.schedules.Schedule` names global stage ids and edges; the executor
dispatches by ``(module, stage index)`` keys and knows only sends (a receive is the
moment the receiving program reads its inbox). :func:`lower` walks the schedule in one
valid global order (:func:`hetjax.schedules.dispatch_order`) and turns each F, B and send
into an :class:`Op`. Every execution mode lowers the same way: colocated runs the
three-phase schedule, non-colocated graph-aware 1F1B (or GPipe), the homogeneous baseline
the ``fused_*`` schedules whose encoder stages run on the LLM's first stage.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from hetjax import schedules as hs
from hetjax.meshes.placement import Placement
from hetjax.runtime.graph import TrainGraph

Mode = Placement  # one definition: hetjax.meshes.placement
MODES: tuple[str, ...] = typing.get_args(Placement)
ScheduleOrder = Literal["1f1b", "gpipe"]
StageKey = tuple[str, int]  # (module name, pipeline stage index)


@dataclasses.dataclass(frozen=True)
class Op:
    """One dispatchable step: compute on a stage, or a transfer along a stage edge."""

    kind: Literal["F", "B", "SEND_F", "SEND_B"]
    stage: StageKey  # where it runs (for sends: the producing side)
    microbatch: int
    peer: StageKey | None = None  # for sends: the receiving stage
    phase: int = 0  # three-phase: 0 encoder forward, 1 LLM pipeline, 2 encoder backward
    last_send: bool = True  # sends: no later send of this step reads the same output


def schedule_name(mode: Mode, order: ScheduleOrder) -> str:
    """The :func:`hetjax.schedules.schedule_for` name a mode runs with ``order``."""
    if mode == "colocated":
        return "three_phase"
    if mode == "homogeneous":
        return f"fused_{order}"
    return "graph_1f1b" if order == "1f1b" else "gpipe"


def module_graph(graph: TrainGraph) -> hs.ModuleGraph:
    """The schedule-level view of a training graph: stage counts and edges."""
    return hs.ModuleGraph(
        {m.name: m.layout.pp for m in graph.modules}, [(l.src, l.dst) for l in graph.links]
    )


def build_schedule(
    graph: TrainGraph, mode: Mode, order: ScheduleOrder, microbatches: int
) -> hs.Schedule:
    """The mode's schedule for ``graph``, proven valid by the checker."""
    sched = hs.schedule_for(schedule_name(mode, order), microbatches, graph=module_graph(graph))
    hs.check_schedule(sched)
    return sched


def lower(schedule: hs.Schedule, *, fused: bool = False) -> tuple[Op, ...]:
    """The schedule's actions in dispatch order as ops (receives dropped).

    ``fused`` (the ``fused_*`` schedules of the homogeneous baseline): the encoder
    stages share the sink's first stage's devices, so their ops are issued where that
    stage would run them - an encoder's F of microbatch m (and its send) right before
    the stage's F of m, its gradient's send and B right after the stage's B of m. Each
    stage's own order is the schedule's; only the interleaving across stages changes.
    """
    where = {info.stage: (info.module, info.index) for info in schedule.stages}
    ops = []
    for a in hs.dispatch_order(schedule):
        if a.kind in ("F", "B"):
            ops.append(Op(a.kind, where[a.stage], a.microbatch, phase=a.phase))
        elif a.kind == "SEND_F":
            src, dst = where[a.edge.src_stage], where[a.edge.dst_stage]
            ops.append(Op("SEND_F", src, a.microbatch, dst, phase=a.phase))
        elif a.kind == "SEND_B":
            src, dst = where[a.edge.dst_stage], where[a.edge.src_stage]
            ops.append(Op("SEND_B", src, a.microbatch, dst, phase=a.phase))
    return mark_last_sends(_fuse_encoders(ops, schedule) if fused else ops)


def _fuse_encoders(ops: list[Op], schedule: hs.Schedule) -> list[Op]:
    (host,) = {(schedule.stages[e.dst_stage].module, 0) for e in schedule.edges if e.is_boundary}
    encoders = {(i.module, i.index) for i in schedule.stages if i.module != host[0]}

    def moved(op: Op) -> bool:
        return op.stage in encoders or (op.kind == "SEND_B" and op.peer in encoders)

    before: dict[int, list[Op]] = {}
    after: dict[int, list[Op]] = {}
    for op in ops:
        if moved(op):
            side = before if op.kind in ("F", "SEND_F") else after
            side.setdefault(op.microbatch, []).append(op)
    out = []
    for op in ops:
        if moved(op):
            continue
        if op.kind == "F" and op.stage == host:
            out += before.pop(op.microbatch)
        out.append(op)
        if op.kind == "B" and op.stage == host:
            out += sorted(after.pop(op.microbatch), key=lambda o: o.kind != "SEND_B")
    return out


def mark_last_sends(ops: list[Op]) -> tuple[Op, ...]:
    """Marks each send that is the last one of its step reading its stage's output."""
    seen: set[tuple[str, StageKey, int]] = set()
    out = []
    for op in reversed(ops):
        if op.kind in ("SEND_F", "SEND_B"):
            key = (op.kind, op.stage, op.microbatch)
            op = dataclasses.replace(op, last_send=key not in seen)
            seen.add(key)
        out.append(op)
    return tuple(out[::-1])


def drop_frozen(ops: tuple[Op, ...], graph: TrainGraph) -> tuple[Op, ...]:
    """``ops`` without the work frozen parts make unnecessary: the B of a stage that runs
    forward only (:meth:`TrainGraph.has_backward`) and every gradient send into one.
    Dropping them keeps every remaining op's dependencies, so the order stays valid."""
    kept = [
        op
        for op in ops
        if not (op.kind == "B" and not graph.has_backward(op.stage))
        and not (op.kind == "SEND_B" and not graph.has_backward(op.peer))
    ]
    return mark_last_sends(kept)
