"""`ScheduleError`: why a schedule is invalid, as one line plus a machine-readable reason.

Kept in its own file because both the static checks (`checker`) and the concurrent
execution (`execution`) raise it, and tests match on `ScheduleError.reason` rather than
on message wording.
"""

from __future__ import annotations

from typing import Literal

Reason = Literal[
    "structure",  # lists, ids, phases or edges inconsistent with the schedule's own tables
    "missing",  # a stage lacks the F or B of a microbatch
    "duplicate",  # an F, B, send or recv appears twice
    "order",  # B before F, or a send/recv on the wrong side of its F/B
    "dependency",  # an F/B lacks the recv that brings one of its inputs
    "unpaired",  # a send with no matching recv, or a recv with no matching send
    "deadlock",  # the stage lists cannot all run to the end
    "max_live",  # more live activations than the schedule's max_live promises
]


class ScheduleError(ValueError):
    """A schedule breaks one of the rules `check_schedule` enforces.

    Attributes:
        reason: Which rule, see `Reason`.
    """

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(f"[{reason}] {message}")
        self.reason: Reason = reason
