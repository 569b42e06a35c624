"""Run all stage lists concurrently, abstractly: deadlock detection and a dispatch order.

Each stage walks its own list in order, as one process per stage would. Nothing is
timed; the only question is whether every list can reach its end. Blocking rules:

- ``sends="buffered"`` (default): a send never blocks - the data is queued for the peer
  (NCCL/ gloo ``isend`` with a pending request, or a single-controller JAX runtime where
  a "send" is an async device-to-device copy). A recv blocks until the peer has run the
  matching send.
- ``sends="rendezvous"``: a send and its recv complete together, so both sides must have
  reached them. Consecutive send/recv actions on one stage are posted together, as
  Megatron's ``batch_isend_irecv`` posts ``send_forward_recv_backward``; the stage moves
  on once all of them completed. This is the stricter model for blocking transports.
  A transfer whose send and recv lie in different phases is always buffered: the
  barrier between them means the data must be held (three-phase's encoder outputs).
- Phases are barriers: nothing of phase k + 1 runs before all of phase k has run.

The same walk yields `dispatch_order`: one interleaving of all lists that respects every
dependency. A single-controller runtime can issue actions in that order; multi-process
runtimes can use it as the common global order cross-process programs must follow.
"""

from __future__ import annotations

from collections import Counter
from typing import Literal

from .actions import Action
from .errors import ScheduleError
from .schedule import Schedule

SendMode = Literal["buffered", "rendezvous"]


def dispatch_order(schedule: Schedule, *, sends: SendMode = "buffered") -> tuple[Action, ...]:
    """Interleave all stage lists into one order that respects every dependency.

    Stages advance round-robin, one action per stage per round (a send and its recv
    count as one step in rendezvous mode), so the order roughly follows time.

    Args:
        schedule: A schedule whose sends and recvs pair one-to-one (run
            `check_schedule` first for a readable error if unsure).
        sends: Blocking model; see the module docstring.

    Returns:
        Every action exactly once. In rendezvous mode every send is immediately followed
        by its recv (except transfers across a phase barrier), so the order can serve as
        the global order in which all processes issue one collective per transfer.

    Raises:
        ScheduleError: ``reason="deadlock"`` if the lists cannot all finish; the
            message lists every stuck stage and what it waits for.
    """
    if sends not in ("buffered", "rendezvous"):
        raise ValueError(f"sends must be 'buffered' or 'rendezvous', not {sends!r}.")
    return _Walker(schedule, sends).run()


class _Walker:
    """State of the abstract concurrent run."""

    def __init__(self, schedule: Schedule, sends: SendMode) -> None:
        self.sched = schedule
        self.lists = schedule.actions
        self.sends = sends
        self.pos = [0] * len(self.lists)
        self.done = [[False] * len(acts) for acts in self.lists]
        self.sent: set[tuple] = set()
        self.left_in_phase = Counter(a.phase for acts in self.lists for a in acts)
        self.phase = min(self.left_in_phase, default=0)
        self.where: dict[tuple, tuple[int, int]] = {}
        for s, acts in enumerate(self.lists):
            for i, a in enumerate(acts):
                if not a.is_compute:
                    self.where[(a.kind, *a.transfer_key())] = (s, i)
        self.order: list[Action] = []

    def run(self) -> tuple[Action, ...]:
        total = sum(len(acts) for acts in self.lists)
        while len(self.order) < total:
            progressed = False
            for s in range(len(self.lists)):
                progressed |= self._step(s)
            while self.left_in_phase[self.phase] == 0 and self.phase < max(self.left_in_phase):
                self.phase += 1
            if not progressed:
                raise ScheduleError("deadlock", self._report(total))
        return tuple(self.order)

    def _head(self, s: int) -> int | None:
        """Index of the first not-yet-run action of stage s, or None when it is done."""
        acts, done = self.lists[s], self.done[s]
        while self.pos[s] < len(acts) and done[self.pos[s]]:
            self.pos[s] += 1
        return self.pos[s] if self.pos[s] < len(acts) else None

    def _finish(self, s: int, i: int) -> None:
        a = self.lists[s][i]
        self.done[s][i] = True
        self.order.append(a)
        self.left_in_phase[a.phase] -= 1
        if a.is_send:
            self.sent.add(a.transfer_key())

    def _step(self, s: int) -> bool:
        i = self._head(s)
        if i is None or self.lists[s][i].phase != self.phase:
            return False
        a = self.lists[s][i]
        if a.is_compute:
            self._finish(s, i)
            return True
        if self.sends == "buffered":
            return self._try_buffered(s, i)
        for j in self._posted(s):  # rendezvous: the whole run of sends/recvs is posted
            b = self.lists[s][j]
            if self.done[s][j]:
                continue
            partner = self._partner(b)
            if partner is None or self._buffered(b):
                if self._try_buffered(s, j):
                    return True
                continue
            t, k = partner
            if k in self._posted(t) and not self.done[t][k]:
                first, second = ((s, j), (t, k)) if b.is_send else ((t, k), (s, j))
                self._finish(*first)
                self._finish(*second)
                return True
        return False

    def _try_buffered(self, s: int, i: int) -> bool:
        """Run a queued send, or a recv whose send has run; report whether it ran."""
        a = self.lists[s][i]
        if a.is_send or a.transfer_key() in self.sent:
            self._finish(s, i)
            return True
        return False

    def _buffered(self, a: Action) -> bool:
        """Whether the transfer of ``a`` is queued rather than a rendezvous."""
        if self.sends == "buffered":
            return True
        partner = self._partner(a)
        return partner is None or self.lists[partner[0]][partner[1]].phase != a.phase

    def _partner(self, a: Action) -> tuple[int, int] | None:
        kind = a.kind.replace("SEND", "RECV") if a.is_send else a.kind.replace("RECV", "SEND")
        return self.where.get((kind, *a.transfer_key()))

    def _posted(self, s: int) -> range:
        """Rendezvous mode: indices of the send/recv run stage s has posted."""
        start = self._head(s)
        if start is None:
            return range(0)
        acts, end = self.lists[s], start
        while end < len(acts) and not acts[end].is_compute and acts[end].phase == self.phase:
            end += 1
        return range(start, end)

    def _report(self, total: int) -> str:
        lines = []
        for s, info in enumerate(self.sched.stages):
            i = self._head(s)
            if i is None:
                continue
            a = self.lists[s][i]
            if a.phase != self.phase:
                why = f"for phase {self.sched.phases[self.phase]!r} to finish"
            elif a.is_recv and self._buffered(a):
                why = f"for the matching SEND_{a.direction} on stage {a.peer}, which has not run"
            else:
                other = "RECV" if a.is_send else "SEND"
                why = f"for stage {a.peer} to post the matching {other}_{a.direction}"
            lines.append(f"stage {s} ({info}) waits at {a} {why}")
        return (
            f"deadlock after {len(self.order)} of {total} actions ({self.sends} sends): "
            + "; ".join(lines)
            + ". Reorder the lists so each recv's matching send can run first."
        )
