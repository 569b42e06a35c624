"""Wall-clock timing of blocks of host code, kept as samples.

A :class:`Timer` is entered once per sample (``with timer: step()``) and keeps every
duration, so a benchmark reports the median and not one noisy reading. It measures host
time only: JAX dispatches asynchronously, so the block must wait for its results
(``jax.block_until_ready``) when device time is meant. For per-op device timelines use
the JAX profiler instead.
"""

from __future__ import annotations

import statistics
import time


class Timer:
    """Wall time of each ``with`` block entered on it, in seconds.

    Example:
        >>> timer = Timer()
        >>> for _ in range(3):
        ...     with timer:
        ...         pass
        >>> len(timer.samples)
        3
    """

    def __init__(self) -> None:
        self.samples: list[float] = []  # seconds, one per block, in order
        self._start: float | None = None

    def __enter__(self) -> Timer:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.samples.append(time.perf_counter() - self._start)
        self._start = None

    def elapsed(self) -> float:
        """Seconds since the current block started (``0.0`` outside a block)."""
        return 0.0 if self._start is None else time.perf_counter() - self._start

    @property
    def last(self) -> float:
        """The latest sample."""
        return self.samples[-1]

    @property
    def median(self) -> float:
        """The median sample (raises ``statistics.StatisticsError`` if none)."""
        return statistics.median(self.samples)

    @property
    def total(self) -> float:
        """The sum of the samples."""
        return sum(self.samples)
