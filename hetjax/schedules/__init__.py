"""Pipeline schedules as data, a validity checker and a timeline simulator (pure Python).

A `Schedule` gives each pipeline stage an ordered list of `Action`s (F/B of a microbatch,
send/recv of an activation or gradient on an `Edge`). Generators build the schedules
hetjax runs: `gpipe`, `one_f_one_b` (Megatron 1F1B), `graph_one_f_one_b` (the paper's
graph-aware 1F1B over a `ModuleGraph`, non-colocated), `three_phase` (colocated) and
`fused_encoders` (the homogeneous baseline).
`without_modules` takes modules with nothing to do in a step (no image in its batch) out
of a schedule. `check_schedule` proves a schedule complete, causal, within its memory
bound and free of deadlock; `simulate` times it and draws a Gantt chart.

Example:
    >>> from hetjax import schedules as hs
    >>> sched = hs.one_f_one_b(num_stages=4, num_microbatches=8)
    >>> hs.check_schedule(sched)
    >>> round(hs.simulate(sched, {"F": 1.0, "B": 2.0}).makespan, 1)
    33.0
"""

from .absent import without_modules as without_modules
from .actions import Action as Action
from .actions import ActionKind as ActionKind
from .actions import Edge as Edge
from .checker import check_schedule as check_schedule
from .errors import ScheduleError as ScheduleError
from .execution import SendMode as SendMode
from .execution import dispatch_order as dispatch_order
from .fused import fused_encoders as fused_encoders
from .gpipe import gpipe as gpipe
from .gpipe import graph_gpipe as graph_gpipe
from .graph import ModuleGraph as ModuleGraph
from .one_f_one_b import graph_one_f_one_b as graph_one_f_one_b
from .one_f_one_b import one_f_one_b as one_f_one_b
from .one_f_one_b import warmup_counts as warmup_counts
from .registry import SCHEDULE_NAMES as SCHEDULE_NAMES
from .registry import ScheduleName as ScheduleName
from .registry import schedule_for as schedule_for
from .schedule import Schedule as Schedule
from .schedule import StageInfo as StageInfo
from .schedule import build_schedule as build_schedule
from .simulator import Durations as Durations
from .simulator import Timeline as Timeline
from .simulator import simulate as simulate
from .three_phase import THREE_PHASES as THREE_PHASES
from .three_phase import three_phase as three_phase
from .three_phase import three_phase_for_graph as three_phase_for_graph
from .timed import TimedAction as TimedAction

__all__ = [
    "SCHEDULE_NAMES",
    "THREE_PHASES",
    "Action",
    "ActionKind",
    "Durations",
    "Edge",
    "ModuleGraph",
    "Schedule",
    "ScheduleError",
    "ScheduleName",
    "SendMode",
    "StageInfo",
    "TimedAction",
    "Timeline",
    "build_schedule",
    "check_schedule",
    "dispatch_order",
    "fused_encoders",
    "gpipe",
    "graph_gpipe",
    "graph_one_f_one_b",
    "one_f_one_b",
    "schedule_for",
    "simulate",
    "three_phase",
    "three_phase_for_graph",
    "warmup_counts",
    "without_modules",
]
