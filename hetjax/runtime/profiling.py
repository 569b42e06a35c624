"""Trace a range of training steps with JAX's own profiler (``jax.profiler``).

:class:`StepProfiler` wraps a step function (what :func:`hetjax.run_training` calls): it
starts a trace before step ``first`` is dispatched and stops it once step ``last``'s
metrics are computed, so the trace holds exactly those steps, each marked as a training
step (``jax.profiler.StepTraceAnnotation``). The trace is what TensorBoard's profile
plugin and Perfetto open: ``DIR/plugins/profile/<run>/<host>.xplane.pb`` and
``<host>.trace.json.gz``. Stage programs are named after their module, stage and kind
(:func:`hetjax.runtime.jitted.program_name`), so the trace shows which ran where.

Unlike the executor's ``profile=True`` (which waits for every program to time it and
feeds the simulated Gantt chart), tracing leaves dispatch asynchronous: what it records
is the run as it is. Unlike an observer, it runs on every process: in a multi-process
run each process writes its own trace (into ``DIR/process_<i>``, as processes on one
machine would otherwise write the same ``<host>`` file).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any


class StepProfiler:
    """``step_fn`` with steps ``first`` .. ``last`` (inclusive) traced into ``directory``.

    Args:
        step_fn: dispatches step ``i`` and returns its metrics.
        first: the first traced step.
        last: the last traced step (``>= first``).
        directory: where the trace goes (created if missing).

    Example:
        >>> step = StepProfiler(step_fn, 2, 3, "/tmp/prof")  # doctest: +SKIP
        >>> try:
        ...     run_training(step, 5, tokens_per_step=512)
        ... finally:
        ...     step.close()
    """

    def __init__(
        self,
        step_fn: Callable[[int], Mapping[str, Any]],
        first: int,
        last: int,
        directory: str,
    ):
        if not 0 <= first <= last:
            raise ValueError(f"profile steps {first}:{last}: need 0 <= first <= last")
        import jax

        self.step_fn, self.first, self.last = step_fn, first, last
        if jax.process_count() > 1:
            directory = os.path.join(directory, f"process_{jax.process_index()}")
        self.directory = directory
        self.tracing = self.done = False
        self.traced: list[int] = []

    def __call__(self, step: int) -> Mapping[str, Any]:
        import jax

        if self.first <= step <= self.last and not (self.tracing or self.done):
            jax.profiler.start_trace(self.directory)  # (a resumed run: from its first step)
            self.tracing = True
        if not self.tracing:
            return self.step_fn(step)
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
            metrics = self.step_fn(step)
        self.traced.append(step)
        if step == self.last:
            jax.block_until_ready(metrics)  # the trace holds the whole of the last step
            self.close()
        return metrics

    def close(self) -> None:
        """Stops a trace still running (a run that ended early); writes it out."""
        if self.tracing:
            import jax

            self.tracing, self.done = False, True
            jax.profiler.stop_trace()
