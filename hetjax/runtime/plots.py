"""An observer that plots a run's health at its end: loss, throughput, gradient norms.

One PNG with three panels against step: the loss, tokens per second (step 0 includes
compilation, so the panel starts at step 1 when there is one) and the gradient norm of
each module (log scale; a module whose norm runs away or collapses stands out). It is
drawn once, from the history the loop hands to ``on_end``; matplotlib is imported
then (its Agg canvas, not pyplot: no display, no global figure state), so a run
without ``--plot`` never loads it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hetjax.runtime.observers import Observer


class MetricsPlot(Observer):
    """Draws the run's curves to ``path`` (a ``.png``) when it ends."""

    def __init__(self, path: str):
        self.path = path

    def on_end(self, history: Sequence[Mapping[str, float]]) -> None:
        if not history:
            return
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(12, 3.6), layout="constrained")
        FigureCanvasAgg(fig)
        loss, speed, norms = fig.subplots(1, 3)
        steps = [m["step"] for m in history]
        loss.plot(steps, [m["loss"] for m in history], marker=".")
        loss.set(title="loss", xlabel="step")
        steady = history[1:] or history
        speed.plot([m["step"] for m in steady], [m["tokens_per_s"] for m in steady], marker=".")
        speed.set(title="tokens / s", xlabel="step")
        modules = [k for k in history[0] if k.startswith("grad_norm/")]
        for key in modules or ["grad_norm"]:
            if key in history[0]:
                norms.plot(steps, [m[key] for m in history], marker=".", label=key.split("/")[-1])
        norms.set(title="gradient norm per module", xlabel="step", yscale="log")
        if modules:
            norms.legend()
        fig.savefig(self.path, format="png", dpi=100)
