"""The library trainer: one place that turns a config and a model into a training run.

``Trainer(config, model, data, devices=..., hooks=...)`` does, in this order and only
here: layouts parsed into :class:`~hetjax.Layout` once and defaults filled
(:func:`~hetjax.train.layouts.resolve_layouts`), checked against the model, the graph
built with its frozen parts and recompute policies, the run planned
(:func:`~hetjax.runtime.plan_run`: placement, islands, schedule, batch split), the
engine built (the :class:`~hetjax.Executor`, or the data-parallel
:class:`~hetjax.ReferenceTrainer`), and the latest checkpoint of ``checkpoint.dir``
restored into it (any layout). :meth:`Trainer.fit` runs the step loop with the hooks.

What an entry point keeps is only what is its own: flags, joining a multi-process job,
picking devices, and which hooks to add. levanter's ``Trainer`` and MaxText's
``train.py`` are the models: the model is a small protocol
(:class:`~hetjax.train.protocols.TrainableModel`), everything else is the library's.

Errors name parameters (``parallel.layouts``, ``islands=...``); a CLI turns them into
flag names.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from hetjax.config import TrainConfig
from hetjax.meshes import Layout
from hetjax.runtime import loop as loop_lib
from hetjax.runtime.executor import Executor
from hetjax.runtime.graph import TrainGraph
from hetjax.runtime.optim import AdamWConfig, make_optimizer
from hetjax.runtime.plan import RunPlan, plan_run
from hetjax.runtime.programs import ParallelOptions
from hetjax.runtime.reference import ReferenceTrainer, check_batch_split
from hetjax.train.hooks import CheckpointHook, Hook
from hetjax.train.layouts import LayoutChoice, resolve_layouts
from hetjax.train.outputs import logging_hooks
from hetjax.train.preemption import Preemption
from hetjax.train.protocols import BatchSource, TrainableModel

log = logging.getLogger(__name__)


class Trainer:
    """A planned, built and (if a checkpoint exists) resumed training run.

    Args:
        config: the resolved run settings (parallel, optimizer, checkpoint, steps, seed).
        model: the model (:class:`~hetjax.train.protocols.TrainableModel`).
        data: the batches (:class:`~hetjax.train.protocols.BatchSource`).
        devices: every device of the run, canonical order (default: ``jax.devices()``).
        hooks: :class:`~hetjax.train.hooks.Hook` s (every process) and observers (objects
            with ``on_step``/``on_end``: process 0 only), called in order after those of
            ``config.logging`` (:func:`~hetjax.train.outputs.logging_hooks`). A
            :class:`~hetjax.train.hooks.CheckpointHook` is added when ``checkpoint.dir``
            is set and none is given.
        layouts: instead of ``config.parallel``'s layouts: one
            :class:`~hetjax.train.layouts.LayoutChoice`, or several (a planner's, best
            first), of which the first that the model and the devices take is used.
        optimizer: any optax transformation instead of the AdamW of ``config.optimizer``.
        observers: executor observers (compiles, dispatches, transfers).

    Example:
        >>> metrics = Every(JsonlWriter("metrics.jsonl"), 10)  # doctest: +SKIP
        >>> trainer = Trainer(config, model, data, hooks=[metrics])  # doctest: +SKIP
        >>> history = trainer.fit()  # doctest: +SKIP
    """

    def __init__(
        self,
        config: TrainConfig,
        model: TrainableModel,
        data: BatchSource,
        *,
        devices: Sequence[jax.Device] | None = None,
        hooks: Sequence[Any] = (),
        layouts: LayoutChoice | Sequence[LayoutChoice] | None = None,
        optimizer: Any = None,
        observers: Sequence[Any] = (),
    ):
        self.config, self.model, self.data = config, model, data
        self.devices = list(jax.devices() if devices is None else devices)
        self.lead = jax.process_index() == 0
        self.end = config.stop_after or config.steps
        self.optimizer = optimizer or _optimizer_config(config)
        self.plan, self.graph = self._plan(layouts)  # every check; no parameter exists yet
        self.checkpointer = _checkpointer(config)  # before training: the directory is usable
        resume = self.checkpointer is not None and self.checkpointer.latest_step() is not None
        self.engine = self._engine(init=not resume, observers=observers)
        self.start, self.resumed = 0, {}
        if resume:
            self.resumed = self.checkpointer.restore(self.engine)
            self.start = int(self.resumed["step"])
            if self.lead:
                print(f"resumed from step {self.start} ({self.checkpointer.path(self.start)})")
        if hasattr(data, "start"):
            data.start(self, self.resumed.get("data"))
        self.hooks: list[Any] = [*logging_hooks(self), *hooks]
        if self.checkpointer and not any(isinstance(h, CheckpointHook) for h in self.hooks):
            self.hooks.insert(0, CheckpointHook(config.checkpoint.save_every))
        self.preempted_at: int | None = None
        self.preemption = Preemption()

    # -- planning -------------------------------------------------------------------------

    @property
    def layout_text(self) -> str:
        """The run's layout in one line (summaries, checkpoint metadata)."""
        if self.plan is None:
            return f"reference data parallel: dp={len(self.devices)}"
        shown = "; ".join(f"{m.name} {m.layout}" for m in self.plan.graph.modules)
        return f"{self.plan.mode}: {shown}; schedule {self.plan.schedule.name}"

    @property
    def microbatches(self) -> int:
        return self.plan.microbatches if self.plan else self.config.parallel.microbatches

    def _plan(self, layouts: Any) -> tuple[RunPlan | None, TrainGraph]:
        p, n, names = self.config.parallel, len(self.devices), list(self.model.module_names)
        self.choice: LayoutChoice | None = None  # the layouts planned (None: reference)
        if p.reference:
            check_batch_split(self.config.data.global_batch, p.microbatches, n)
            # The graph only says which parts train (for FLOPs and the frozen set).
            graph = self.model.train_graph({m: Layout() for m in names}, freeze=self._freeze)
            return None, graph
        if layouts is None:
            given = resolve_layouts(p.layouts, names, num_devices=n, mode=p.mode)
            choices = [LayoutChoice(given, p.mode, dict(p.islands) or None, p.microbatches)]
        elif isinstance(layouts, LayoutChoice):
            choices = [layouts]
        else:
            choices = list(layouts)
        for choice in choices:
            try:
                plan = self._plan_choice(choice)
            except ValueError:
                if len(choices) == 1:
                    raise
                continue
            self.choice = choice
            return plan, plan.graph
        raise ValueError(
            f"none of the {len(choices)} candidate layouts runs on these {n} devices; give "
            "parallel.layouts"
        )

    def _plan_choice(self, choice: LayoutChoice) -> RunPlan:
        p, sink = self.config.parallel, list(self.model.module_names)[-1]
        self.model.validate_layouts(choice.layouts)
        graph = self.model.train_graph(choice.layouts, freeze=self._freeze)
        plan = plan_run(
            graph.with_recompute(p.recompute),
            num_devices=len(self.devices),
            mode=choice.mode,
            islands=choice.islands,
            microbatches=choice.microbatches,
            schedule=p.schedule,
            offload_encoders=p.offload_encoder,
            global_batch=self.config.data.global_batch,
            rebalance=p.rebalanced,
        )
        if plan.mode == "homogeneous":  # the encoders' inherited layouts must fit them too
            inherited = {m.name: m.layout for m in plan.graph.modules if m.name != sink}
            self.model.validate_layouts(inherited)
        return plan

    @property
    def _freeze(self) -> tuple[str, ...]:
        return self.config.model.frozen

    # -- the engine -----------------------------------------------------------------------

    def _engine(self, *, init: bool, observers: Sequence[Any]) -> Executor | ReferenceTrainer:
        """The parameters (the run's first compiles) and the engine that owns them.

        ``init=False``: a checkpoint will be restored, so the executor builds no
        parameters (the reference trainer does, and they are overwritten)."""
        key = jax.random.key(self.config.seed)
        params = None
        if self.plan is None or init:
            initial = getattr(self.model, "initial_params", None)
            lead = self.lead and init
            params = initial(key, lead=lead) if initial else self.model.init(key)
        p = self.config.parallel
        if self.plan is None:
            frozen = {part for m in self.graph.modules for part in m.frozen}
            axes = self.model.logical_axes(frozen)
            optimizer = self.optimizer
            if isinstance(optimizer, AdamWConfig):
                optimizer = make_optimizer(optimizer, logical_axes=axes)
            return ReferenceTrainer(
                self.model.loss_sum,
                params,
                optimizer,
                devices=self.devices,
                microbatches=p.microbatches,
                frozen=frozen,
            )
        return Executor(
            self.plan,
            params,
            devices=self.devices,
            optimizer=self.optimizer,
            options=ParallelOptions(
                zero1=p.zero1,
                sequence_parallel=p.sequence_parallel,
                skip_nonfinite=self.config.skip_nonfinite_steps > 0,
                frozen_dtype=self.config.model.dtype,
            ),
            observers=observers,
        )

    # -- checkpoints ----------------------------------------------------------------------

    def metadata(self) -> dict[str, Any]:
        """What a checkpoint records besides the arrays: enough to say what it is and to
        continue the data stream."""
        import hetjax.config as hc

        checkpoint = getattr(self.data, "checkpoint", None)
        data = checkpoint() if checkpoint else {"kind": "step", "next_step": self._next}
        model = getattr(self.model, "metadata", None)
        return {
            "config": hc.to_dict(self.config),
            **({"model": model()} if model else {}),
            "data": data,
            "rng": {"init_seed": self.config.seed},
            "layout": self.layout_text,
        }

    def save(self, step: int, metrics: Mapping[str, Any] | None = None) -> bool:
        """Starts saving the state after ``step`` steps (returns before the writes).

        A state that a non-finite step updated is never saved (the executor's skipped
        steps did not update it). Returns whether a save started."""
        if self.checkpointer is None:
            return False
        skipping = self.config.skip_nonfinite_steps > 0
        if metrics is not None and not skipping and loop_lib.nonfinite(metrics):
            return False
        self.checkpointer.save(step, self.engine, metadata=self.metadata())
        return True

    def kept_note(self) -> str:
        """For a non-finite stop: where the last complete checkpoint is."""
        if self.checkpointer is None:
            return ""
        self.checkpointer.wait()
        last = self.checkpointer.latest_step()
        if last is None:
            return ""
        return f"; the checkpoint after step {last} ({self.checkpointer.path(last)}) is intact"

    # -- the loop -------------------------------------------------------------------------

    def step(self, i: int) -> Mapping[str, Any]:
        """Dispatches step ``i`` (its batch from the data source, the hooks around it)."""
        hooks = self._hooks()
        for hook in hooks:
            hook.before_step(self, i)
        batch = self.data.batch(i)
        self._next = i + 1
        if any(h.wants_profile(i) for h in hooks):
            metrics = self.engine.step(batch, profile=True)
        else:
            metrics = self.engine.step(batch)
        for hook in hooks:
            if hook.due(i, self.end):
                hook.after_step(self, i, metrics)
        if self.preemption.reached(i):
            self.preempted_at = i + 1
            if not any(isinstance(h, CheckpointHook) and h.due(i, self.end) for h in hooks):
                self.save(i + 1, metrics)  # (a save due at this step already ran)
        return metrics

    def _hooks(self) -> list[Hook]:
        """The trainer hooks this process runs (every process's, and process 0's own)."""
        return [h for h in self.hooks if isinstance(h, Hook) and (self.lead or not h.lead_only)]

    def fit(self) -> list[dict[str, float]]:
        """Trains from the resumed step to ``stop_after`` (or ``steps``); returns the
        per-step metrics (process 0's hooks saw them).

        On SIGTERM (SLURM, Kubernetes, spot instances) the run saves a checkpoint at the
        next step boundary and returns normally (:attr:`preempted_at` says after which
        step); rerunning the same command resumes bit-exactly.

        Raises:
            hetjax.runtime.NonFiniteError: a non-finite loss or gradient (more than
                ``skip_nonfinite_steps`` in a row).
        """
        import hetjax

        observers = [h for h in self.hooks if not isinstance(h, Hook)] if self.lead else []
        hooks = self._hooks()
        guard = loop_lib.NonFiniteGuard(self.config.skip_nonfinite_steps, note=self.kept_note)
        model_flops = getattr(self.model, "flop_metrics", None)
        flops = model_flops(self) if model_flops else None
        step_metrics = getattr(self.data, "step_metrics", None)
        self._next = self.start
        try:
            with self.preemption:
                history = hetjax.run_training(
                    self.step,
                    self.end,
                    tokens_per_step=self.config.data.global_batch * _seq_len(self),
                    hooks=[*(_DueHook(h, self.end) for h in hooks), *observers, guard],
                    start=self.start,
                    flop_metrics=flops,
                    data_metrics=step_metrics,
                    stop=lambda: self.preempted_at is not None,
                )
        finally:
            close = getattr(self.data, "close", None)
            if close:
                close()
            if self.checkpointer is not None:
                self.checkpointer.close()  # waits for the last writes
        if self.preempted_at is not None and self.lead:
            print(
                f"preempted: saved the state after step {self.preempted_at}; run the same "
                "command again to resume"
            )
        return history


def _seq_len(trainer: Trainer) -> int:
    return int(getattr(trainer.model, "seq_len", 0) or 0)


class _DueHook:
    """A trainer hook as a loop observer, called at the steps it is due."""

    def __init__(self, hook: Hook, end: int):
        self.hook, self.end = hook, end

    def on_step(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.hook.due(step, self.end):
            self.hook.on_step(step, metrics)

    def on_end(self, history: Sequence[Mapping[str, float]]) -> None:
        self.hook.on_end(history)

    def on_error(self, error: BaseException) -> None:
        self.hook.on_error(error)


def _optimizer_config(config: TrainConfig) -> AdamWConfig:
    """AdamW with warm-up and cosine decay from ``config.optimizer`` over ``steps``."""
    o = config.optimizer
    warmup = max(1, config.steps // 10) if o.warmup_steps is None else o.warmup_steps
    return AdamWConfig(
        lr=o.lr,
        total_steps=config.steps,
        warmup_steps=warmup,
        weight_decay=o.weight_decay,
        clip_norm=o.clip_norm,
    )


def _checkpointer(config: TrainConfig):
    """The run's checkpoint directory, checked before training (None: no checkpoints)."""
    if not config.checkpoint.dir:
        return None
    # Only now: importing orbax reconfigures Python logging (JAX's log lines gain a
    # "WARNING:<logger>:" prefix), which runs without checkpoints should not see.
    from hetjax.checkpoint import Checkpointer

    return Checkpointer(config.checkpoint.dir, keep=config.checkpoint.keep)
