"""Preemption: a SIGTERM (SLURM, Kubernetes, spot instances) ends a run at a step
boundary every process agrees on, after a checkpoint.

One process: a handler installed for the run sets a flag, read after each step. Several
processes: JAX's preemption sync point (its coordination service catches SIGTERM on
every process and picks one step for all), so every process saves the same step; a
flag of one process alone could not be agreed on without a collective every step.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import jax


class Preemption:
    """Whether to stop after a step; a context manager around the run (the SIGTERM
    handler of a single-process run is installed inside and given back after)."""

    def __init__(self):
        self.signalled = threading.Event()
        self._previous: Any = None

    def __enter__(self) -> Preemption:
        main = threading.current_thread() is threading.main_thread()
        if jax.process_count() == 1 and main:
            self._previous = signal.signal(signal.SIGTERM, lambda *_: self.signalled.set())
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def reached(self, step: int) -> bool:
        """Whether every process stops after ``step`` (0-based; called after each one)."""
        if jax.process_count() == 1:
            return self.signalled.is_set()
        from jax.experimental import multihost_utils

        try:
            return multihost_utils.reached_preemption_sync_point(step + 1)
        except RuntimeError:  # the job was started without JAX's preemption service
            return False
