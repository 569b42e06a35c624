"""An observer that writes every step's metrics as TensorBoard scalars (``tensorboardX``).

The tags are the metric names of the JSON Lines file (:class:`~hetjax.JsonlWriter`), at
the same step numbers: ``loss``, ``grad_norm``, ``grad_norm/<module>``,
``param_norm/<module>``, ``tokens_per_s``, ... TensorBoard groups a tag by its first
``/`` part, so each per-module metric is one section with a chart per module; the
Custom Scalars tab also gets one chart per such metric with every module's curve on it.

``tensorboardX`` writes TensorBoard's event files without TensorFlow; it is imported
when the writer is built, so a run without ``--tensorboard`` never loads it. Only
process 0 writes (other processes' writers do nothing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hetjax.runtime.observers import Observer


class TensorBoardWriter(Observer):
    """Writes each step's metrics (all but ``step``) under ``directory``.

    Args:
        directory: TensorBoard's log directory (``tensorboard --logdir DIR``).
        start: the run's first step; a resumed run drops whatever an earlier run wrote
            at this step or later (its steps are written again).
        flush_secs: how often events reach the disk while the run goes on.
    """

    def __init__(self, directory: str, *, start: int = 0, flush_secs: int = 10):
        import jax

        self.directory = directory
        self._writer = None
        self._layout_done = False
        if jax.process_index() != 0:
            return
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(
            directory, purge_step=start if start > 0 else None, flush_secs=flush_secs
        )

    def on_step(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._writer is None:
            return
        if not self._layout_done:
            self._layout(metrics)
        for key, value in metrics.items():
            if key != "step":
                self._writer.add_scalar(key, value, global_step=step)

    def on_end(self, history: Sequence[Mapping[str, float]]) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def on_error(self, error: BaseException) -> None:
        self.on_end([])  # flush the steps written so far

    def _layout(self, metrics: Mapping[str, float]) -> None:
        """Custom Scalars: one chart per per-module metric, every module's curve on it."""
        families = sorted({k.split("/", 1)[0] for k in metrics if "/" in k})
        if families:
            charts = {f: ["Multiline", [f"^{f}/"]] for f in families}
            self._writer.add_custom_scalars({"per module": charts})
        self._layout_done = True
