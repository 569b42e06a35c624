"""The host training loop and its stock observers (metrics file, progress, summary).

The loop dispatches step N before it reads step N-1's metrics, so the host prepares and
enqueues the next step while the devices still work on the previous one. Hooks only see
plain Python floats; they run on process 0 only (the caller passes none elsewhere).
"""

from __future__ import annotations

import datetime
import json
import math
import queue
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

import jax

from hetjax.runtime.observers import Observer
from hetjax.runtime.reduce import StepMetrics

Hook = Observer  # what the loop calls: on_step / on_end (any object with those two)


def run_training(
    step_fn: Callable[[int], Mapping[str, Any]],
    steps: int,
    *,
    tokens_per_step: int,
    hooks: Sequence[Hook] = (),
    start: int = 0,
    flop_metrics: Callable[[float, float], Mapping[str, float]] | None = None,
    data_metrics: Callable[[int], Mapping[str, float]] | None = None,
    stop: Callable[[], bool] | None = None,
) -> list[dict[str, float]]:
    """Runs ``step_fn(start) ... step_fn(steps - 1)``; returns the per-step metrics.

    A step's time is the interval between its finish and the finish of the step before
    it (the first: since the loop started). A finish is when the step's metrics are
    computed, taken by a thread that waits on them as soon as the step is dispatched:
    neither a dispatch that itself waits on the devices (as on CPU) nor the order the
    loop reads metrics in moves it, so the last step's time is as real as the others'.

    Args:
        step_fn: dispatches one step and returns its metrics (a
            :class:`~hetjax.runtime.reduce.StepMetrics`, or a mapping of device scalars or
            floats).
        steps: index one past the last step.
        tokens_per_step: tokens in one global batch, for throughput.
        hooks: observers, called in order after each step and at the end.
        start: the first step's index.
        flop_metrics: ``(supervised tokens, step time) -> FLOP metrics`` added to each
            step's (``model_tflops_per_step``, ``tflops_per_s``, ``mfu``, ...; see
            :func:`hetjax.runtime.flops.throughput_metrics`).
        data_metrics: ``step -> metrics of its batch`` added to each step's (the data
            pipeline's ``padding_fraction``, ``token_imbalance``, ...).
        stop: asked after each dispatch; ``True`` ends the run after that step (its
            metrics are still reported and the hooks' ``on_end`` called): a preempted
            run that saved its state.
    """
    history: list[dict[str, float]] = []
    pending: tuple[int, Mapping[str, Any]] | None = None
    finishes = _Finishes()
    last_end = time.perf_counter()

    def report(done: int, step_metrics: Mapping[str, Any]) -> None:
        nonlocal last_end
        metrics = {k: float(v) for k, v in step_metrics.items()}  # waits for step `done`
        end = finishes.time(done)
        elapsed = max(end - last_end, 1e-9)
        last_end = end
        metrics.update(
            step=done,
            tokens=tokens_per_step,
            step_time_s=elapsed,
            tokens_per_s=tokens_per_step / elapsed,
        )
        if flop_metrics is not None:
            metrics.update(flop_metrics(metrics["supervised_tokens"], elapsed))
        if data_metrics is not None:
            metrics.update(data_metrics(done))
        history.append(metrics)
        for hook in hooks:
            hook.on_step(done, metrics)

    try:
        step = start
        while step <= steps:
            current = (step, step_fn(step)) if step < steps else None
            if current is not None:
                finishes.watch(*current)
                if stop is not None and stop():
                    steps = step + 1  # this step is the last
            if pending is not None:
                done, pending = pending, None
                report(*done)
            if current is not None:
                if getattr(current[1], "on_host", False):
                    # Host metrics (a multi-process step syncs the host itself): report now,
                    # or this step's time would be measured after the next one.
                    report(*current)
                else:
                    pending = current
            step += 1
    except BaseException as error:  # a failed step, a non-finite stop, Ctrl-C
        if pending is not None and not isinstance(error, KeyboardInterrupt):
            try:  # the step dispatched before the failing one may well have finished
                report(*pending)
            except Exception:  # noqa: BLE001 - the first error is the one to raise
                pass
        for hook in hooks:
            if hasattr(hook, "on_error"):
                hook.on_error(error)
        raise
    finally:
        finishes.close()
    for hook in hooks:
        hook.on_end(history)
    return history


class _Finishes:
    """When each dispatched step finished: a thread waits on the steps' metrics in
    order and notes the time each became ready (waiting on device arrays releases the
    GIL, so the host loop goes on dispatching)."""

    def __init__(self):
        self.times: dict[int, float] = {}
        self.ready = threading.Condition()
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="hetjax-step-finishes", daemon=True)
        self.thread.start()

    def watch(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.queue.put((step, metrics))

    def time(self, step: int) -> float:
        """When ``step`` (dispatched and watched) finished; waits for it. Each step is
        asked once (its report), so its entry goes: a long run keeps none of them."""
        with self.ready:
            self.ready.wait_for(lambda: step in self.times)
            return self.times.pop(step)

    def close(self) -> None:
        self.queue.put(None)

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            step, metrics = item
            try:
                _wait(metrics)
            except Exception:  # noqa: BLE001 - the loop's own read raises it
                pass
            with self.ready:
                self.times[step] = time.perf_counter()
                self.ready.notify_all()


def _wait(metrics: Mapping[str, Any]) -> None:
    """Blocks until every value is computed (host values always are)."""
    if isinstance(metrics, StepMetrics):
        if not metrics.on_host:
            jax.block_until_ready(metrics)
        return
    for value in metrics.values():
        if hasattr(value, "block_until_ready"):
            value.block_until_ready()


class NonFiniteError(ValueError):
    """A step's loss or gradient norm is NaN or infinite (the message names the modules)."""


def nonfinite(metrics: Mapping[str, float]) -> list[str]:
    """The metric names among loss and gradient norms whose value is NaN or infinite."""
    keys = [k for k in metrics if k in ("loss", "grad_norm") or k.startswith("grad_norm/")]
    return [k for k in keys if not math.isfinite(metrics[k])]


class NonFiniteGuard(Observer):
    """Stops a run at a step whose loss or gradient norm is not finite.

    With ``skip > 0`` the executor skipped those updates (``ParallelOptions.skip_nonfinite``)
    and the run goes on, until more than ``skip`` such steps come in a row.
    """

    def __init__(self, skip: int = 0, *, note: Callable[[], str] = lambda: ""):
        self.skip, self.note = skip, note
        self.in_a_row = 0
        self.skipped = 0

    def on_step(self, step: int, metrics: Mapping[str, float]) -> None:
        bad = nonfinite(metrics)
        if not bad:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.skipped += 1
        if self.in_a_row <= self.skip:
            return
        modules = [k.split("/", 1)[1] for k in bad if "/" in k]
        where = f"the gradient of {', '.join(modules)} went non-finite" if modules else ""
        values = ", ".join(f"{k}={metrics[k]}" for k in bad)
        run = f" ({self.in_a_row} in a row)" if self.skip else ""
        raise NonFiniteError(
            f"step {step + 1} (metrics step {step}): {values}{run}; "
            f"{where or 'the loss went non-finite'}{self.note()}; lower the learning rate or "
            "clip harder"
        )


class JsonlWriter(Observer):
    """Writes one JSON object per step to ``path`` (JSON Lines), ``step`` first.

    ``append``: continue an existing file (a resumed run continues its step numbering).
    """

    def __init__(self, path: str, *, append: bool = False):
        self._file: IO[str] = open(path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115

    def on_step(self, step: int, metrics: Mapping[str, float]) -> None:
        row = {"step": step, **{k: v for k, v in metrics.items() if k != "step"}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def on_end(self, history: Sequence[Mapping[str, float]]) -> None:
        self._file.close()

    def on_error(self, error: BaseException) -> None:
        self._file.close()  # every finished step is already written


class ProgressBar(Observer):
    """Progress with ``rich``: step, loss, tokens/s and ETA.

    On a terminal a live bar (redrawn in place); otherwise (CI, SLURM logs, a pipe) plain
    lines with the same fields every ``every`` steps and at the first and last, and no
    control characters. ``rich`` rather than ``tqdm``: its console tells a terminal from
    a file itself and never writes carriage returns or colour codes to a file, and it
    estimates the ETA even when nothing is drawn live, so both outputs share one clock.

    Args:
        total: index one past the last step (``run_training``'s ``steps``).
        stream: where to write (default: ``sys.stderr``).
        every: steps between plain lines.
        start: the first step (a resumed run).
    """

    def __init__(
        self, total: int, *, stream: IO[str] | None = None, every: int = 10, start: int = 0
    ):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.total, self.every = total, every
        self.stream = stream or sys.stderr
        self.console = Console(file=self.stream)
        self.live = self.console.is_terminal
        self.progress = Progress(
            TextColumn("step {task.completed:>5.0f}/{task.total:.0f}"),
            BarColumn(),
            TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:,.0f} tok/s  eta"),
            TimeRemainingColumn(),
            console=self.console,
            auto_refresh=False,
            disable=not self.live,
        )
        self.task = self.progress.add_task("train", total=total, completed=start, loss=0, tps=0)
        if self.live:
            self.progress.start()

    def on_step(self, step: int, metrics: Mapping[str, float]) -> None:
        n = step + 1
        loss, tps = metrics["loss"], metrics["tokens_per_s"]
        self.progress.update(self.task, completed=n, loss=loss, tps=tps, refresh=self.live)
        if self.live or not (n % self.every == 0 or n == 1 or n == self.total):
            return
        left = self.progress.tasks[0].time_remaining
        eta = "-" if left is None else str(datetime.timedelta(seconds=round(left)))
        self.stream.write(
            f"step {n:>5}/{self.total}  loss {loss:.4f}  {tps:,.0f} tok/s  eta {eta}\n"
        )
        self.stream.flush()

    def on_end(self, history: Sequence[Mapping[str, float]]) -> None:
        if self.live:
            self.progress.stop()

    def on_error(self, error: BaseException) -> None:
        if self.live:  # give the terminal back (cursor shown, the bar's last state kept)
            self.progress.stop()


class Summary(Observer):
    """Prints a one-screen summary at the end: the run's set-up, then loss and throughput."""

    def __init__(self, header: Mapping[str, Any], *, stream: IO[str] | None = None):
        self.header = header
        self.stream = stream or sys.stdout

    def on_step(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def on_end(self, history: Sequence[Mapping[str, float]]) -> None:
        if not history:
            return
        steady = history[1:] or history  # step 0 includes compilation
        step_time = sum(m["step_time_s"] for m in steady) / len(steady)
        rows = [
            *self.header.items(),
            ("steps", len(history)),
            ("loss (first -> last)", f"{history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}"),
            ("first step (compile)", f"{history[0]['step_time_s']:.2f} s"),
            ("steady step time", f"{step_time * 1e3:.1f} ms"),
            ("throughput", f"{history[-1]['tokens'] / step_time:,.0f} tokens/s"),
            *_flop_rows(steady),
            ("total wall time", f"{sum(m['step_time_s'] for m in history):.1f} s"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = ["", "== hetjax run summary " + "=" * 40]
        lines += [f"  {k:<{width}}  {v}" for k, v in rows]
        self.stream.write("\n".join(lines) + "\n")
        self.stream.flush()


def _flop_rows(steady: Sequence[Mapping[str, float]]) -> list[tuple[str, str]]:
    """The summary's FLOP lines (means over the steady steps), if the loop measured them."""
    if "tflops_per_s" not in steady[-1]:
        return []

    def mean(key: str) -> float:
        return sum(m[key] for m in steady) / len(steady)

    flops = (
        f"{mean('model_tflops_per_step'):.4g} TFLOP/step model, "
        f"{mean('hardware_tflops_per_step'):.4g} hardware (with recompute); "
        f"{mean('tflops_per_s'):.4g} TFLOP/s"
    )
    if "mfu" not in steady[-1]:
        return [("model FLOPs", flops), ("MFU", "device peak unknown (--peak-tflops gives it)")]
    modules = sorted(k.split("/", 1)[1] for k in steady[-1] if k.startswith("mfu/"))
    per = ", ".join(f"{m} {mean(f'mfu/{m}'):.2%}" for m in modules)
    return [("model FLOPs", flops), ("MFU", f"{mean('mfu'):.2%} ({per})")]
