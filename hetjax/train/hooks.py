"""Trainer hooks: code that runs at step boundaries, every N steps.

A :class:`Hook` sees the trainer between two steps (:meth:`Hook.before_step`,
:meth:`Hook.after_step`: the state is the one after the step, its metrics may still be
computing) and the finished step's metrics as floats (:meth:`Hook.on_step`, one step
later: the loop reads step N-1's metrics after dispatching step N). ``every=N`` runs it
at steps N, 2N, ... (1-based) and at the run's last step. Hooks run on every process;
observers (the metrics file, progress, TensorBoard, plots: anything with ``on_step``
but no ``after_step``) run on process 0 only.

The ``trainer`` argument is the :class:`hetjax.train.Trainer` that runs the hook (typed
``Any`` here so that this module and the trainer's do not import each other).

Stock hooks: :class:`Every` (any observer every N steps), :class:`CheckpointHook`
(saves), :class:`ProfileHook` (``jax.profiler`` trace of a step range),
:class:`TimelineHook` (the executor's timed last step as a Gantt chart and a Perfetto
trace). Users subclass :class:`Hook` for their own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any


class Hook:
    """Base class of trainer hooks; override what you need.

    Args:
        every: run at every ``every``-th step (1-based) and at the last step.
    """

    every: int = 1
    lead_only: bool = False  # True: runs on process 0 only (what writes files or prints)

    def __init__(self, every: int = 1):
        if every < 1:
            raise ValueError(f"every={every} must be a positive integer")
        self.every = every

    def due(self, step: int, end: int) -> bool:
        """Whether the hook runs at step ``step`` (0-based) of a run ending before ``end``."""
        return (step + 1) % self.every == 0 or step + 1 == end

    def before_step(self, trainer: Any, step: int) -> None:
        """Before step ``step`` is dispatched (called every step, ``every`` aside)."""

    def wants_profile(self, step: int) -> bool:
        """Whether step ``step`` should run timed (the executor waits on every program)."""
        return False

    def after_step(self, trainer: Any, step: int, metrics: Mapping[str, Any]) -> None:
        """Right after step ``step`` was dispatched: ``trainer`` holds the state after it."""

    def on_step(self, step: int, metrics: Mapping[str, float]) -> None:
        """Step ``step``'s metrics, read as floats (one step after its dispatch)."""

    def on_end(self, history: Sequence[Mapping[str, float]]) -> None:
        """The run finished (also a preempted run that saved and stops)."""

    def on_error(self, error: BaseException) -> None:
        """The run failed; release what the hook holds."""


class Every(Hook):
    """A process-0 observer (metrics file, TensorBoard, plot, your own) called only at
    every ``every``-th step and the last: ``Every(JsonlWriter(path), 10)``.

    Args:
        observer: any object with ``on_step`` (and optionally ``on_end``, ``on_error``).
        every: steps between calls.
    """

    lead_only = True

    def __init__(self, observer: Any, every: int):
        super().__init__(every)
        self.observer = observer

    def on_step(self, step: int, metrics: Mapping[str, float]) -> None:
        self.observer.on_step(step, metrics)

    def on_end(self, history: Sequence[Mapping[str, float]]) -> None:
        if hasattr(self.observer, "on_end"):
            self.observer.on_end(history)

    def on_error(self, error: BaseException) -> None:
        if hasattr(self.observer, "on_error"):
            self.observer.on_error(error)


class CheckpointHook(Hook):
    """Saves the trainer's state every ``every`` steps and after the last step.

    Args:
        every: steps between saves (``None``: only after the last step).
    """

    def __init__(self, every: int | None = None):
        super().__init__(every or 1)
        self.only_last = every is None

    def due(self, step: int, end: int) -> bool:
        return step + 1 == end if self.only_last else super().due(step, end)

    def after_step(self, trainer: Any, step: int, metrics: Mapping[str, Any]) -> None:
        trainer.save(step + 1, metrics)


class ProfileHook(Hook):
    """Traces steps ``first`` .. ``last`` (0-based, inclusive) with ``jax.profiler``.

    Every process traces its own programs (into ``directory/process_<i>`` when there are
    several); each step is marked with ``jax.profiler.StepTraceAnnotation``. Unlike
    :class:`TimelineHook`, dispatch stays asynchronous: the trace shows the run as it is.
    The trace is what TensorBoard's profile plugin and Perfetto open.
    """

    def __init__(self, first: int, last: int, directory: str):
        super().__init__()
        if not 0 <= first <= last:
            raise ValueError(f"profile steps {first}:{last}: need 0 <= first <= last")
        import jax

        if jax.process_count() > 1:
            directory = os.path.join(directory, f"process_{jax.process_index()}")
        self.first, self.last, self.directory = first, last, directory
        self.tracing = self.done = False
        self.traced: list[int] = []
        self._annotation: Any = None

    def before_step(self, trainer: Any, step: int) -> None:
        import jax

        if self.first <= step <= self.last and not (self.tracing or self.done):
            jax.profiler.start_trace(self.directory)  # (a resumed run: from its first step)
            self.tracing = True
        if self.tracing:
            self._annotation = jax.profiler.StepTraceAnnotation("train", step_num=step)
            self._annotation.__enter__()

    def after_step(self, trainer: Any, step: int, metrics: Mapping[str, Any]) -> None:
        if self._annotation is None:
            return
        import jax

        self._annotation.__exit__(None, None, None)
        self._annotation = None
        self.traced.append(step)
        if step == self.last:
            jax.block_until_ready(dict(metrics))  # the trace holds the whole last step
            self.close()

    def on_end(self, history: Sequence[Mapping[str, float]]) -> None:
        self.close()

    def on_error(self, error: BaseException) -> None:
        self.close()  # a run that stopped inside the range still writes its trace

    def close(self) -> None:
        """Stops a trace still running (a run that ended early); writes it out."""
        if self.tracing:
            import jax

            if self._annotation is not None:
                self._annotation.__exit__(None, None, None)
                self._annotation = None
            jax.profiler.stop_trace()
            self.tracing, self.done = False, True


class TimelineHook(Hook):
    """Times the run's last step program by program (the executor's ``profile=True``)
    and, on process 0, draws it: a Gantt chart PNG at ``path`` and a Chrome/Perfetto
    trace beside it (``t.png`` -> ``t.trace.json``)."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self.end: int | None = None
        self.trainer: Any | None = None
        self.lines: list[str] = []

    def before_step(self, trainer: Any, step: int) -> None:
        self.trainer, self.end = trainer, trainer.end

    def wants_profile(self, step: int) -> bool:
        return self.end is not None and step == self.end - 1

    def on_end(self, history: Sequence[Mapping[str, float]]) -> None:
        import jax

        if self.trainer is None or jax.process_index() != 0:
            return
        timeline = self.trainer.engine.timeline()
        timeline.to_png(self.path)
        trace = timeline.to_chrome_trace(os.path.splitext(self.path)[0] + ".trace.json")
        bubbles = ", ".join(f"{b:.2f}" for b in timeline.bubble)
        multi = jax.process_count() > 1
        note = " (stages on other processes were not timed here: read as 0)" if multi else ""
        print(f"timeline: {self.path} (simulated bubble per stage: {bubbles}){note}")
        print(f"timeline trace: {trace} (open in ui.perfetto.dev)")
