"""The run's outputs from ``config.logging``: checked before training, built as hooks.

:func:`check_outputs` runs first (before anything compiles): the folders of process 0's
files exist, the directories are writable. :func:`logging_hooks` turns the settings
into the stock observers and hooks: metrics file (JSON Lines), TensorBoard scalars,
progress, end-of-run plot and summary (process 0), a ``jax.profiler`` trace of a step
range (every process), and the timed last step's Gantt chart.
"""

from __future__ import annotations

import os
from typing import Any

from hetjax.config import LoggingConfig
from hetjax.files import ensure_writable_dir
from hetjax.runtime.loop import JsonlWriter, ProgressBar, Summary
from hetjax.train.hooks import ProfileHook, TimelineHook


def check_outputs(logging: LoggingConfig, *, lead: bool) -> None:
    """The folders of process 0's files exist (``lead``), and the directories (TensorBoard's
    on process 0, each process's trace) are writable.

    Raises:
        ValueError: one line naming the setting (``logging.metrics``, ...) and the fix.
    """
    files = {"metrics": logging.metrics, "timeline": logging.timeline, "plot": logging.plot}
    for name, path in files.items() if lead else ():
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            raise ValueError(
                f"logging.{name} {path}: directory {folder} does not exist; create it or "
                "write the file elsewhere"
            )
    dirs = {"tensorboard": logging.tensorboard} if lead else {}
    for name, path in {**dirs, "profile_dir": logging.profile_dir}.items():
        if not path:
            continue
        try:
            ensure_writable_dir(path)
        except OSError as e:
            raise ValueError(
                f"logging.{name} {path}: directory is not writable "
                f"({e.strerror or type(e).__name__}); give a directory you can write"
            ) from None


def logging_hooks(trainer: Any) -> list[Any]:
    """The hooks of ``trainer.config.logging``, in the order they run.

    Process 0's observers (``on_step``/``on_end``; other processes drop them): metrics
    file, TensorBoard, progress, plot, summary. Every process's hooks: the profile range
    and the timed last step."""
    from hetjax.runtime.plots import MetricsPlot
    from hetjax.runtime.tensorboard import TensorBoardWriter

    config, start = trainer.config, trainer.start
    logging = config.logging
    hooks: list[Any] = []
    if logging.profile_range:
        hooks.append(ProfileHook(*logging.profile_range, logging.profile_dir))
    if logging.timeline:
        hooks.append(TimelineHook(logging.timeline))
    if not trainer.lead:
        return hooks
    if logging.metrics:
        hooks.append(JsonlWriter(logging.metrics, append=start > 0))
    if logging.tensorboard:
        hooks.append(TensorBoardWriter(logging.tensorboard, start=start))
    hooks.append(ProgressBar(trainer.end, start=start))
    if logging.plot:
        hooks.append(MetricsPlot(logging.plot))
    hooks.append(Summary(_summary(trainer)))
    hooks.append(_Outputs(logging))
    return hooks


def _summary(trainer: Any) -> dict[str, Any]:
    """The summary's set-up lines: model, devices, layout, batch, data."""
    import jax

    config, model, devices = trainer.config, trainer.model, trainer.devices
    processes = jax.process_count()
    over = f" over {processes} processes" if processes > 1 else ""
    describe = getattr(model, "describe", None)
    seq_from = "" if config.model.seq_len else " (the model's; model.seq_len sets it)"
    summary = {
        "model": describe() if describe else type(model).__name__,
        "devices": f"{len(devices)} x {devices[0].platform}{over}",
        "layout": trainer.layout_text,
        "batch": f"{config.data.global_batch} samples x {getattr(model, 'seq_len', '?')} "
        f"tokens{seq_from}, {trainer.microbatches} microbatch(es), {config.model.dtype}",
    }
    data_summary = getattr(trainer.data, "summary", None)
    if data_summary:
        summary["data"] = _AtEnd(data_summary)  # skip and truncation counts, read at the end
    extra = getattr(model, "summary", None)
    return {**summary, **(extra() if extra else {})}


class _AtEnd:
    """A summary value computed when the summary prints."""

    def __init__(self, fn):
        self.fn = fn

    def __format__(self, spec: str) -> str:
        return format(self.fn(), spec)


class _Outputs:
    """Process 0 says where the run's traces, plots and event files are, at the end."""

    def __init__(self, logging: LoggingConfig):
        self.logging = logging

    def on_step(self, step: int, metrics: Any) -> None:
        pass

    def on_end(self, history: Any) -> None:
        lg = self.logging
        if lg.profile_dir:
            print(f"profile: {lg.profile_dir} (tensorboard --logdir {lg.profile_dir})")
        if lg.tensorboard:
            print(f"tensorboard: {lg.tensorboard} (tensorboard --logdir {lg.tensorboard})")
        if lg.plot:
            print(f"plot: {lg.plot}")
