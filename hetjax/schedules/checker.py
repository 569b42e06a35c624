"""`check_schedule`: prove a schedule is runnable before any device touches it.

A bad schedule on real hardware shows up as a hang (a recv that never completes) or as
silently wrong gradients (a backward that ran without its upstream gradient). Both are
cheap to rule out on the host, so every generator's output - and any hand-written
schedule - can be checked in microseconds. Rules, in the order they are checked (the
first broken one is raised as a `ScheduleError` whose ``reason`` names it):

1. ``structure`` - tables agree: stage ids, list count, ``max_live``, modules, known
   edges, microbatch and phase ranges, phases non-decreasing along each list;
2. ``missing`` / ``duplicate`` - each stage runs exactly one F and one B per microbatch;
3. ``order`` - on each stage, B(m) comes after F(m);
4. ``dependency`` / ``unpaired`` / ``duplicate`` - each edge carries, per microbatch,
   exactly one SEND_F, RECV_F, SEND_B and RECV_B: a forward receives from every
   predecessor stage and a backward from every successor stage, and sends and recvs
   pair one-to-one;
5. ``order`` - RECV_F(m) before F(m), SEND_F(m) after F(m), RECV_B(m) before B(m),
   SEND_B(m) after B(m), on the stage that runs them;
6. ``max_live`` - live activations (F done, B not) never exceed ``max_live[s]``;
7. ``deadlock`` - all lists run to the end concurrently (`execution.dispatch_order`).

Together 4, 5 and 7 imply data causality: F(m, s) runs after F(m, p) for every
predecessor p, and B(m, s) after B(m, c) for every successor c.
"""

from __future__ import annotations

from collections import Counter

from .actions import Action
from .errors import ScheduleError
from .execution import SendMode, dispatch_order
from .schedule import Schedule

_NEEDED_BY = {"RECV_F": "F", "RECV_B": "B"}  # a recv must precede this compute
_AFTER = {"SEND_F": "F", "SEND_B": "B"}  # a send must follow this compute


def check_schedule(schedule: Schedule, *, sends: SendMode = "buffered") -> None:
    """Raise `ScheduleError` unless ``schedule`` is valid and deadlock-free.

    Args:
        schedule: The schedule to check.
        sends: ``"buffered"`` (sends never block) or ``"rendezvous"`` (a send waits for
            its recv); see `hetjax.schedules.execution`.

    Raises:
        ScheduleError: On the first broken rule (see the module docstring); the message
            names the stage, microbatch and action, and how to fix it.

    Example:
        >>> from hetjax.schedules import one_f_one_b
        >>> check_schedule(one_f_one_b(4, 8))  # returns None when valid
    """
    _check_structure(schedule)
    _check_compute(schedule)
    _check_transfers(schedule)
    _check_local_order(schedule)
    _check_max_live(schedule)
    dispatch_order(schedule, sends=sends)


def _check_structure(sched: Schedule) -> None:
    num = sched.num_stages
    if sched.num_microbatches < 1:
        raise ScheduleError("structure", f"num_microbatches is {sched.num_microbatches}; use >= 1.")
    if len(sched.actions) != num or len(sched.max_live) != num:
        raise ScheduleError(
            "structure",
            f"{num} stages but {len(sched.actions)} action lists and {len(sched.max_live)} "
            "max_live entries; give one of each per stage.",
        )
    if not sched.phases:
        raise ScheduleError("structure", "phases is empty; name at least one phase.")
    for s, info in enumerate(sched.stages):
        if info.stage != s:
            raise ScheduleError("structure", f"stages[{s}] has stage id {info.stage}; use {s}.")
    known = set(sched.edges)
    for edge in sched.edges:
        for stage, module in ((edge.src_stage, edge.src_module), (edge.dst_stage, edge.dst_module)):
            if stage >= num or sched.stages[stage].module != module:
                raise ScheduleError(
                    "structure", f"edge {edge} does not match the stage table; fix its ids."
                )
    for s, acts in enumerate(sched.actions):
        phase = 0
        for a in acts:
            where = f"stage {s} ({sched.stages[s]}) action {a}"
            if a.stage != s:
                raise ScheduleError("structure", f"{where} names stage {a.stage}; move it.")
            if a.module is not None and a.module != sched.stages[s].module:
                raise ScheduleError("structure", f"{where} names module {a.module!r}.")
            if a.microbatch >= sched.num_microbatches:
                raise ScheduleError(
                    "structure",
                    f"{where}: microbatch out of range [0, {sched.num_microbatches}).",
                )
            if a.edge is not None and a.edge not in known:
                raise ScheduleError("structure", f"{where} uses an edge not in schedule.edges.")
            if not phase <= a.phase < len(sched.phases):
                raise ScheduleError(
                    "structure",
                    f"{where} has phase {a.phase} after phase {phase}; phases must not "
                    f"decrease along a list and stay below {len(sched.phases)}.",
                )
            phase = a.phase


def _check_compute(sched: Schedule) -> None:
    for s, acts in enumerate(sched.actions):
        counts = Counter((a.kind, a.microbatch) for a in acts if a.is_compute)
        for m in range(sched.num_microbatches):
            for kind in ("F", "B"):
                n = counts[(kind, m)]
                if n == 0:
                    raise ScheduleError(
                        "missing",
                        f"stage {s} ({sched.stages[s]}) has no {kind} for microbatch {m}; "
                        "every stage runs one F and one B per microbatch.",
                    )
                if n > 1:
                    raise ScheduleError(
                        "duplicate", f"stage {s} runs {kind} of microbatch {m} {n} times."
                    )
        seen_f: set[int] = set()
        for a in acts:
            if a.kind == "F":
                seen_f.add(a.microbatch)
            elif a.kind == "B" and a.microbatch not in seen_f:
                raise ScheduleError(
                    "order",
                    f"stage {s} runs B of microbatch {a.microbatch} before its F; "
                    "move the B after the F.",
                )


def _check_transfers(sched: Schedule) -> None:
    counts = Counter((a.kind, *a.transfer_key()) for acts in sched.actions for a in acts if a.edge)
    for edge in sched.edges:
        for m in range(sched.num_microbatches):
            for d, producer, consumer in (
                ("F", edge.src_stage, edge.dst_stage),
                ("B", edge.dst_stage, edge.src_stage),
            ):
                n_send, n_recv = (
                    counts[(f"SEND_{d}", d, edge, m)],
                    counts[(f"RECV_{d}", d, edge, m)],
                )
                if n_send > 1 or n_recv > 1:
                    raise ScheduleError(
                        "duplicate",
                        f"edge {edge} carries microbatch {m}'s {d} {max(n_send, n_recv)} times; "
                        "each send and recv must appear once.",
                    )
                if n_recv == 0 and n_send == 0:
                    raise ScheduleError(
                        "dependency",
                        f"stage {consumer} runs {d} of microbatch {m} without its input from "
                        f"stage {producer} on edge {edge}; add SEND_{d} on stage {producer} "
                        f"and RECV_{d} on stage {consumer}.",
                    )
                if n_recv == 0:
                    raise ScheduleError(
                        "unpaired",
                        f"SEND_{d} of microbatch {m} on edge {edge} (stage {producer}) has no "
                        f"RECV_{d} on stage {consumer}; add the recv before its {d}.",
                    )
                if n_send == 0:
                    raise ScheduleError(
                        "unpaired",
                        f"RECV_{d} of microbatch {m} on edge {edge} (stage {consumer}) has no "
                        f"matching SEND_{d} on stage {producer}; add the send after its {d}.",
                    )


def _check_local_order(sched: Schedule) -> None:
    for s, acts in enumerate(sched.actions):
        index = {(a.kind, a.microbatch): i for i, a in enumerate(acts) if a.is_compute}
        for i, a in enumerate(acts):
            if a.is_recv and i > index[(_NEEDED_BY[a.kind], a.microbatch)]:
                raise ScheduleError("order", _misplaced(s, a, "before", _NEEDED_BY[a.kind]))
            if a.is_send and i < index[(_AFTER[a.kind], a.microbatch)]:
                raise ScheduleError("order", _misplaced(s, a, "after", _AFTER[a.kind]))


def _misplaced(stage: int, a: Action, side: str, compute: str) -> str:
    return (
        f"stage {stage} runs {a} on the wrong side of its {compute}; it must come {side} "
        f"{compute} of microbatch {a.microbatch}."
    )


def _check_max_live(sched: Schedule) -> None:
    for s, acts in enumerate(sched.actions):
        live = 0
        for a in acts:
            if a.kind in ("F", "B"):
                live += 1 if a.kind == "F" else -1
            if live > sched.max_live[s]:
                raise ScheduleError(
                    "max_live",
                    f"stage {s} ({sched.stages[s]}) holds {live} live activations after "
                    f"{a}, above its max_live of {sched.max_live[s]}; run a backward "
                    "earlier or raise the bound.",
                )
