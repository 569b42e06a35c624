"""Observers: the public hooks through which anything watches a training run.

Benchmarks, tests, progress bars, metrics writers and timelines subclass
:class:`Observer` and override what they need; the executor and the host loop call
every observer's hooks, and nothing sets attributes on the executor to measure it.

- ``on_compile(stage, kind, compiled)``: a stage program was compiled for a new argument
  signature (``compiled`` is the ``jax.stages.Compiled``: HLO text, memory and cost
  analyses). Only observers that override it make the executor lower programs itself.
- ``on_dispatch(event)``: a program call was issued (:class:`Dispatch`: the op, the
  arguments and outputs, host times around the call).
- ``on_transfer(event)``: an activation or gradient crossed a stage edge or a module
  boundary (:class:`Transfer`, with the bytes its plan moves between devices).
- ``on_stash(event)``: a stage kept what its backward starts from (F) or handed it to
  the backward (B) (:class:`Stash`: the value and how many entries the stage holds).
- ``on_step(step, metrics)`` / ``on_end(history)``: the host loop
  (:func:`hetjax.run_training`) read a finished step's metrics as host floats.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from hetjax.runtime.lowering import Op, StageKey


@dataclasses.dataclass(frozen=True)
class Dispatch:
    """One program call issued by the executor (asynchronous unless profiling)."""

    stage: StageKey
    program: str  # "fwd", "bwd", "zeros", "reduce" or "update"
    op: Op | None  # the schedule op (None for the once-per-step programs)
    inputs: tuple  # the call's arguments
    outputs: Any  # what it returned (device arrays, maybe not computed yet)
    t0: float  # perf_counter before the call
    t1: float  # perf_counter after it returned (after the result, when profiling)


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One activation (``SEND_F``) or gradient (``SEND_B``) sent along a stage edge."""

    op: Op
    src: StageKey  # where the value lives
    dst: StageKey  # where it goes
    boundary: bool  # between two modules (else between two stages of one module)
    value: Any  # the array sent (a routed link: its tokens)
    nbytes: int  # bytes the transfer plan moves between devices, over all devices


@dataclasses.dataclass(frozen=True)
class Stash:
    """A stage's stash changed: F kept ``value`` for its backward, or B took it."""

    op: Op  # the F that kept it or the B that took it
    value: Any  # the stage input (recompute full), residuals, or a frozen output
    live: int  # entries the stage holds after the change

    @property
    def nbytes(self) -> int:
        """Bytes of ``value`` over all devices."""
        return sum(a.nbytes for a in jax.tree.leaves(self.value) if hasattr(a, "nbytes"))


class Observer:
    """Base class with no-op hooks; override the ones you need."""

    def on_compile(self, stage: StageKey, kind: str, compiled: Any) -> None:
        """A program of ``stage`` (``kind``: fwd, bwd, ...) was compiled."""

    def on_dispatch(self, event: Dispatch) -> None:
        """A program call was issued."""

    def on_transfer(self, event: Transfer) -> None:
        """A value crossed a stage edge or module boundary."""

    def on_stash(self, event: Stash) -> None:
        """A stage's stash gained (F) or lost (B) an entry."""

    def on_step(self, step: int, metrics: Mapping[str, float]) -> None:
        """The host loop read step ``step``'s metrics."""

    def on_end(self, history: Sequence[Mapping[str, float]]) -> None:
        """The host loop finished."""

    def on_error(self, error: BaseException) -> None:
        """The host loop stopped with ``error`` (re-raised once every observer saw it):
        release what ``on_end`` would (a live display, open files)."""


def overrides(observer: Any, hook: str) -> bool:
    """Whether ``observer`` implements ``hook`` itself (not the base class no-op)."""
    method = getattr(type(observer), hook, None)
    return method is not None and method is not getattr(Observer, hook)


class Observers:
    """The executor's fan-out to its observers; skips work nobody listens to."""

    def __init__(self, observers: Sequence[Any] = ()):
        self.all = tuple(observers)
        self.compile = tuple(o for o in self.all if overrides(o, "on_compile"))
        self.dispatch = tuple(o for o in self.all if overrides(o, "on_dispatch"))
        self.transfer = tuple(o for o in self.all if overrides(o, "on_transfer"))
        self.stash = tuple(o for o in self.all if overrides(o, "on_stash"))

    def on_compile(self, stage: StageKey, kind: str, compiled: Any) -> None:
        for o in self.compile:
            o.on_compile(stage, kind, compiled)

    def on_dispatch(self, event: Dispatch) -> None:
        for o in self.dispatch:
            o.on_dispatch(event)

    def on_transfer(self, event: Transfer) -> None:
        for o in self.transfer:
            o.on_transfer(event)

    def on_stash(self, event: Stash) -> None:
        for o in self.stash:
            o.on_stash(event)
