"""Timed actions and the read-only view of a timeline that its renderers draw.

The simulator (:mod:`hetjax.schedules.simulator`) produces a ``Timeline``; the Gantt
chart (:mod:`~hetjax.schedules.gantt`) and the Chrome trace (:mod:`~hetjax.schedules.trace`)
read it through :class:`TimelineView`, so the renderers never import the simulator that
calls them (``Timeline.to_png``, ``Timeline.to_chrome_trace``).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from .actions import Action
from .schedule import Schedule


@dataclasses.dataclass(frozen=True)
class TimedAction:
    """An action with its simulated start and end time.

    Attributes:
        action: The action.
        start: Start time.
        end: End time.
        seq: Position in the simulator's start order (see `Timeline.in_start_order`).
    """

    action: Action
    start: float
    end: float
    seq: int = 0

    @property
    def duration(self) -> float:
        """``end - start``."""
        return self.end - self.start


class TimelineView(Protocol):
    """What a renderer reads of a simulated timeline."""

    @property
    def schedule(self) -> Schedule:
        """The schedule that was simulated."""
        ...

    @property
    def items(self) -> tuple[tuple[TimedAction, ...], ...]:
        """``items[s]``: stage s's actions with times, in list order."""
        ...

    @property
    def makespan(self) -> float:
        """Time from the first start (0) to the last end."""
        ...

    @property
    def phase_ends(self) -> tuple[float, ...]:
        """End time of each phase of the schedule."""
        ...
