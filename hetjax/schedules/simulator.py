"""Timeline simulator: when each action of a schedule runs, given how long each takes.

The checker says whether a schedule runs; the simulator says how fast. It plays the
stage lists forward with list scheduling: an action starts as soon as (a) the previous
action of its stage has ended, (b) for a recv, the matching send has ended (sends are
buffered: they occupy the sender for their own cost and never wait for the receiver;
transfer latency, if any, is the recv's cost), (c) its phase's barrier has passed, and
(d) every device group of its stage is free - colocated stages (`StageInfo.devices`)
never overlap. Among ready actions the earliest start wins, ties to the lower stage id.
Without colocation this is exactly the as-soon-as-possible timing of the dependency
graph, so closed forms such as the 1F1B bubble ``(P - 1) / (M + P - 1)`` hold exactly.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Mapping

from .actions import Action
from .checker import check_schedule
from .errors import ScheduleError
from .schedule import Schedule
from .timed import TimedAction as TimedAction

Durations = Callable[[Action], float] | Mapping[Hashable, float]
"""Either ``f(action) -> seconds``, or a mapping looked up with the keys
``(kind, stage)``, then ``(kind, module)``, then ``kind``. F and B need a duration;
sends and recvs default to 0."""


@dataclasses.dataclass(frozen=True)
class Timeline:
    """The simulated run of a schedule.

    Attributes:
        schedule: The schedule that was simulated.
        items: ``items[s]`` holds stage s's actions with times, in list order.
    """

    schedule: Schedule
    items: tuple[tuple[TimedAction, ...], ...]

    @property
    def makespan(self) -> float:
        """Time from the first start (0) to the last end."""
        return max((t.end for row in self.items for t in row), default=0.0)

    def busy(self, stage: int) -> float:
        """Time ``stage`` spends running actions (compute, plus any send/recv cost)."""
        return sum(t.duration for t in self.items[stage])

    @property
    def bubble(self) -> tuple[float, ...]:
        """Idle fraction per stage, ``1 - busy / makespan`` (0 for an empty timeline).

        For colocated stages the time their devices spend on another colocated stage
        counts as idle here, since this is per stage, not per device.
        """
        span = self.makespan
        return tuple(
            0.0 if span == 0 else 1.0 - self.busy(s) / span for s in range(len(self.items))
        )

    @property
    def phase_ends(self) -> tuple[float, ...]:
        """End time of each phase of the schedule (its barrier time)."""
        ends = [0.0] * len(self.schedule.phases)
        for row in self.items:
            for t in row:
                ends[t.action.phase] = max(ends[t.action.phase], t.end)
        return tuple(ends)

    def in_start_order(self) -> tuple[TimedAction, ...]:
        """All timed actions in the order the simulator started them.

        Start times never decrease along it and every send precedes its recv, so it is
        a time-ordered dispatch order for a single-controller runtime.
        """
        return tuple(sorted((t for row in self.items for t in row), key=lambda t: t.seq))

    def to_png(
        self, path: str | pathlib.Path, *, width: int = 1200, row_height: int = 24
    ) -> pathlib.Path:
        """Write a Gantt chart of the timeline as a PNG (no plotting library needed).

        One row per stage; F in blues, B in oranges, sends/recvs with a cost in grey,
        the shade cycling with the microbatch; idle time white; red lines at phase
        barriers.

        Args:
            path: File to write.
            width: Image width in pixels.
            row_height: Height of one stage row in pixels.

        Returns:
            The path written.
        """
        from .gantt import render_gantt  # deferred: drawing is optional for most callers
        from .png import write_png

        return write_png(path, render_gantt(self, width=width, row_height=row_height))

    def to_chrome_trace(self, path: str | pathlib.Path) -> pathlib.Path:
        """Write the timeline (times in seconds) as a Chrome trace JSON that Perfetto
        (ui.perfetto.dev) and ``chrome://tracing`` open: a track per stage, a labelled
        slice per action (see `hetjax.schedules.trace`). Returns the path written."""
        from .trace import write_chrome_trace

        return write_chrome_trace(self, path)


def simulate(schedule: Schedule, durations: Durations, *, check: bool = True) -> Timeline:
    """Time every action of ``schedule``.

    Args:
        schedule: The schedule.
        durations: How long each action takes; see `Durations`. Example: ``{"F": 1.0,
            "B": 2.0}``, or ``{("F", "vision"): 0.3, "F": 1.0, "B": 2.0}`` for a cheaper
            vision encoder.
        check: Run `check_schedule` first (clear errors instead of a stalled simulation).

    Returns:
        The `Timeline`.

    Raises:
        ScheduleError: If the schedule is invalid (with ``check``) or stalls.
        ValueError: If an F or B has no duration, or a duration is negative or not finite.

    Example:
        >>> from hetjax.schedules import gpipe
        >>> simulate(gpipe(2, 3), {"F": 1, "B": 1}).makespan
        8.0
    """
    if check:
        check_schedule(schedule)
    duration_of = _duration_fn(durations)
    lists, num = schedule.actions, schedule.num_stages
    groups = [
        info.devices if info.devices is not None else (-1 - s,)
        for s, info in enumerate(schedule.stages)
    ]
    pos = [0] * num
    free_at: dict[int, float] = defaultdict(float)
    stage_free = [0.0] * num
    send_end: dict[tuple, float] = {}
    left_in_phase = Counter(a.phase for acts in lists for a in acts)
    phase = min(left_in_phase, default=0)
    barrier = phase_end = 0.0
    items: list[list[TimedAction]] = [[] for _ in range(num)]
    for seq in range(sum(left_in_phase.values())):
        best: tuple[float, int] | None = None
        for s in range(num):
            if pos[s] == len(lists[s]) or lists[s][pos[s]].phase != phase:
                continue
            a = lists[s][pos[s]]
            ready = max(stage_free[s], barrier, *(free_at[g] for g in groups[s]))
            if a.is_recv:
                if a.transfer_key() not in send_end:
                    continue
                ready = max(ready, send_end[a.transfer_key()])
            if best is None or ready < best[0]:
                best = (ready, s)
        if best is None:
            raise ScheduleError("deadlock", "simulation stalled; run check_schedule for details.")
        start, s = best
        a = lists[s][pos[s]]
        end = start + _checked(duration_of(a), a)
        items[s].append(TimedAction(a, start, end, seq))
        pos[s] += 1
        stage_free[s] = end
        for g in groups[s]:
            free_at[g] = end
        if a.is_send:
            send_end[a.transfer_key()] = end
        phase_end = max(phase_end, end)
        left_in_phase[a.phase] -= 1
        while left_in_phase[phase] == 0 and phase < max(left_in_phase):
            phase += 1
            barrier = phase_end
    return Timeline(schedule, tuple(tuple(row) for row in items))


def _duration_fn(durations: Durations) -> Callable[[Action], float]:
    if callable(durations):
        return durations
    table = dict(durations)

    def lookup(a: Action) -> float:
        for key in ((a.kind, a.stage), (a.kind, a.module), a.kind):
            if key in table:
                return table[key]
        if a.is_compute:
            raise ValueError(
                f"no duration for {a.kind} on stage {a.stage} (module {a.module!r}); add the "
                f"key {a.kind!r}, ({a.kind!r}, {a.module!r}) or ({a.kind!r}, {a.stage})."
            )
        return 0.0

    return lookup


def _checked(value: float, a: Action) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"duration of {a} is {value}; durations must be finite and >= 0.")
    return value
