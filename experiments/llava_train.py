"""Train an LLaVA-style MLLM on synthetic data: ``python -m experiments.llava_train``.

With no flags: the ``tiny`` preset on 8 simulated CPU devices (or the visible GPUs) with
a heterogeneous colocated layout - the encoder data parallel over every device, the LLM
with ``pp=2, tp=2`` - for a run that finishes in well under two minutes on a laptop CPU.

The same command runs as one process of a multi-process job (JAX's multi-controller
runtime, one process per node or per GPU): under ``python -m hetjax.launch`` on one
machine, under SLURM (``srun ... python -m experiments.llava_train``), or started by hand
with ``--coordinator HOST:PORT --num-processes N --process-id I``. Every process builds
the same global batch (with ``--data``, decoding only the images of the rows its devices
hold) and walks the same schedule; the processes refuse to start if their settings
differ, stop together when one fails, and only process 0 prints and writes files.

Settings come from :mod:`experiments.flags` (flags, ``--config FILE``) as one checked
:class:`hetjax.config.TrainConfig`; :func:`main` then runs every check that needs the
model or the devices (:func:`hetjax.runtime.plan_run`) before building any parameter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Sequence
from typing import Any

from experiments import flags
from experiments.cli import ConfigError, accelerator_installed, run_cli, setup_devices
from experiments.flags import default_layouts, errors_as_flags
from hetjax.config import TrainConfig

PROG = "llava_train"
# Settings that are this process's own, so they may differ between processes: the
# coordinator's address as each process reaches it, its index, and the files that only
# process 0 writes.
_PER_PROCESS = (
    "distributed.coordinator",
    "distributed.process_id",
    "logging.metrics",
    "logging.timeline",
    "logging.tensorboard",
    "logging.profile_dir",
    "logging.plot",
)


def parse_args(argv: Sequence[str]) -> TrainConfig:
    """The resolved config of a command line (``--print-config`` prints it and exits)."""
    return flags.parse_args(argv, prog=PROG, description=__doc__.splitlines()[0])


def main(config: TrainConfig) -> int:
    """Trains ``config`` (resolved and checked by the CLI or a caller); returns 0.

    Raises:
        ConfigError: one line naming the flag to fix (:func:`~experiments.flags.as_flags`).
    """
    info, devices = _join_job(config)
    # JAX-using imports come after the device count is fixed.
    import jax

    import hetjax
    from hetjax import distributed

    multi = info.is_multiprocess
    if multi:
        try:  # on every process alike, so every process reports it and exits normally
            distributed.check_consistent("training config", _shared_settings(config, devices))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    lead = jax.process_index() == 0  # prints and writes files
    with _stop_peers_on_error(multi):  # process 0 checks where it writes, each its trace's
        _check_output_dirs(config, lead=lead)
    # The settings agree, so a bad one fails alike on every process (a normal exit).
    with errors_as_flags():
        run = _plan(config, devices)  # every check; no parameter exists yet
        ckpt = _checkpointer(config)  # before training: the directory is usable
        resume = ckpt is not None and ckpt.latest_step() is not None
        trainer = _trainer(config, run, devices, init=not resume, lead=lead)
        start, meta = _resume(ckpt, trainer, lead) if resume else (0, {})
        stream = _stream(config, run, meta.get("data"), len(devices), trainer, multi)
    end = config.stop_after or config.steps
    processes = info.num_processes if multi else 1
    hooks = _hooks(config, run, devices, processes, start, stream) if lead else []
    guard = hetjax.runtime.NonFiniteGuard(config.skip_nonfinite_steps, note=_kept(ckpt))
    logging = config.logging

    def step(i: int):
        # Every process builds the same global batch (seed, step), with pixels only in
        # the image rows its devices hold; the trainer keeps only this process's shards.
        try:
            batch = stream.batch(i)
        except ValueError as e:  # a bad record found while loading (models.llava.BadSample)
            raise ConfigError(str(e)) from None
        profile = logging.timeline is not None and i == end - 1
        metrics = trainer.step(batch, profile=True) if profile else trainer.step(batch)
        done = i + 1
        every = config.checkpoint.save_every
        if ckpt is not None and (done == end or (every and done % every == 0)):
            # Never save a state that a non-finite step updated (skipped ones are kept).
            if config.skip_nonfinite_steps or not hetjax.runtime.loop.nonfinite(metrics):
                ckpt.save(done, trainer, metadata=_metadata(config, run, stream.checkpoint()))
        return metrics

    tokens = config.data.global_batch * run.seq_len
    traced = logging.profile_range  # every process traces its own programs
    profiler = traced and hetjax.StepProfiler(step, *traced, logging.profile_dir)
    try:
        hetjax.run_training(
            profiler or step,
            end,
            tokens_per_step=tokens,
            hooks=[*hooks, guard],
            start=start,
            flop_metrics=_flop_metrics(config, run, devices),
            data_metrics=stream.step_metrics,
        )
    except hetjax.runtime.NonFiniteError as e:
        raise ConfigError(str(e)) from None
    finally:
        stream.close()
        if profiler:
            profiler.close()  # a run that stopped inside the range still writes its trace
        if ckpt is not None:
            ckpt.close()  # waits for the last writes
    if lead:
        _report_outputs(config, trainer, multi)
    return 0


def _report_outputs(config: TrainConfig, trainer, multi: bool) -> None:
    """Process 0 says where the run's traces, plots and event files are."""
    logging = config.logging
    if logging.timeline:
        timeline = trainer.timeline()
        timeline.to_png(logging.timeline)
        trace = timeline.to_chrome_trace(_beside(logging.timeline, ".trace.json"))
        bubbles = ", ".join(f"{b:.2f}" for b in timeline.bubble)
        note = " (stages on other processes were not timed here: read as 0)" if multi else ""
        print(f"timeline: {logging.timeline} (simulated bubble per stage: {bubbles}){note}")
        print(f"timeline trace: {trace} (open in ui.perfetto.dev)")
    if logging.profile_dir:
        print(f"profile: {logging.profile_dir} (tensorboard --logdir {logging.profile_dir})")
    if logging.tensorboard:
        print(f"tensorboard: {logging.tensorboard} (tensorboard --logdir {logging.tensorboard})")
    if logging.plot:
        print(f"plot: {logging.plot}")


def _beside(path: str, suffix: str) -> str:
    """``path`` with its extension replaced by ``suffix`` (``t.png`` -> ``t.trace.json``)."""
    return os.path.splitext(path)[0] + suffix


@dataclasses.dataclass(frozen=True)
class _Run:
    """What :func:`_plan` decided: everything but the parameters and the trainer."""

    model: Any  # models.mllm.MLLM
    dataset: Any  # models.data.SyntheticLlava or models.llava.LlavaData
    seq_len: int
    optimizer: Any  # hetjax.OptimizerConfig
    plan: Any  # hetjax.runtime.RunPlan; None for the reference trainer
    layout_text: str
    graph: Any  # hetjax.TrainGraph: which parts train (the reference trainer's too)


def _join_job(config: TrainConfig) -> tuple[Any, list]:
    """Joins the multi-process job (if any) and picks the devices."""
    # Before anything touches JAX: XLA reads it when it loads, and a multi-process run
    # must join its job before any backend exists.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from hetjax import distributed

    d = config.distributed
    with errors_as_flags():
        info = distributed.initialize(
            coordinator=d.coordinator,
            num_processes=d.num_processes,
            process_id=d.process_id,
            local_device_count=config.parallel.devices,
            cpu=not accelerator_installed(),
        )
    if info.is_multiprocess:
        # First: from here on, a process that stops takes the others with it.
        distributed.watch_peers()
    with _stop_peers_on_error(info.is_multiprocess):  # GPU counts may differ between machines
        devices = setup_devices(config.parallel.devices, multiprocess=info.is_multiprocess)
    return info, devices


def _check_output_dirs(config: TrainConfig, *, lead: bool) -> None:
    """Before training: the folders of process 0's files exist and can be written, and
    the directories (TensorBoard's on process 0, each process's trace) are writable."""
    from hetjax.files import ensure_writable_dir

    lg = config.logging
    files = (("--metrics", lg.metrics), ("--timeline", lg.timeline), ("--plot", lg.plot))
    for flag, path in files if lead else ():
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            raise ConfigError(
                f"{flag} {path}: directory {folder} does not exist; create it or write the "
                "file elsewhere"
            )
    dirs = [("--tensorboard", lg.tensorboard)] if lead else []
    for flag, path in [*dirs, ("--profile-dir", lg.profile_dir)]:
        if not path:
            continue
        try:
            ensure_writable_dir(path)
        except OSError as e:
            raise ConfigError(
                f"{flag} {path}: directory is not writable ({e.strerror or type(e).__name__}); "
                "give a directory you can write"
            ) from None


def _plan(config: TrainConfig, devices: Sequence[Any]) -> _Run:
    """Every check that needs the model or the device count, before any parameter exists:
    preset, sequence length, layouts against the model, placement, islands, schedule and
    batch split (:func:`hetjax.runtime.plan_run`). Nothing here compiles."""
    import jax.numpy as jnp

    import hetjax
    import hetjax.config as hc
    from models.data import DataConfig, SyntheticLlava
    from models.mllm import MLLM

    preset = _model_config(config.model)
    seq_len = config.model.seq_len or preset.seq_len
    images_per_row = 1
    if config.data.sources:  # the validation pass over every record file, here
        from models.llava import run as llava_run

        dataset, preset = llava_run.build(
            config.data,
            preset,
            seq_len=seq_len,
            seed=config.seed,
            microbatches=config.parallel.microbatches,
        )
        images_per_row = dataset.config.images_per_row
    else:
        dataset = SyntheticLlava(DataConfig.for_model(preset, seq_len=seq_len, seed=config.seed))
    o = config.optimizer
    optimizer = hetjax.OptimizerConfig(
        lr=o.lr,
        total_steps=config.steps,
        warmup_steps=max(1, config.steps // 10) if o.warmup_steps is None else o.warmup_steps,
        weight_decay=o.weight_decay,
        clip_norm=o.clip_norm,
    )
    dtype = jnp.bfloat16 if config.model.dtype == "bfloat16" else jnp.float32
    # Packed rows (several samples each) attend within their samples only.
    model = MLLM(preset, dtype=dtype, images_per_row=images_per_row, packed=config.data.pack)
    p, n = config.parallel, len(devices)
    if p.reference:
        hetjax.runtime.check_batch_split(config.data.global_batch, p.microbatches, n)
        text = f"reference data parallel: dp={n}"
        # The graph only says which parts train (for the FLOP rule); nothing runs it.
        one = {name: hetjax.Layout() for name in model.module_names}
        graph = model.train_graph(one, freeze=config.model.frozen)
        return _Run(model, dataset, seq_len, optimizer, None, text, graph)
    names = model.module_names

    def planned(mode: str, texts: dict, islands, microbatches: int):
        given = hc.module_layouts(texts, names)
        if "llm" not in given:
            raise ValueError("give the LLM's layout too, e.g. layouts={'llm': 'dp=2,tp=2,pp=2'}")
        layouts = {name: given.get(name, given["llm"]) for name in names}
        model.validate_layouts(layouts, seq_len=seq_len)
        graph = model.train_graph(layouts, freeze=config.model.frozen)
        return hetjax.runtime.plan_run(
            graph.with_recompute(p.recompute),
            num_devices=n,
            mode=mode,
            islands=islands,
            microbatches=microbatches,
            schedule=p.schedule,
            offload_encoders=p.offload_encoder,
            global_batch=config.data.global_batch,
        )

    if p.layouts == {"auto": "auto"}:
        plan = _auto_plan(config, preset, seq_len, devices, planned)
    else:
        texts = p.layouts or default_layouts(names, n, p.mode)
        plan = planned(p.mode, texts, dict(p.islands) or None, p.microbatches)
    if plan.mode == "homogeneous":  # the encoders' inherited layouts must fit them too
        model.validate_layouts({m.name: m.layout for m in plan.graph.modules if m.name != "llm"})
    shown = "; ".join(f"{m.name} {m.layout}" for m in plan.graph.modules)
    text = f"{plan.mode}: {shown}; schedule {plan.schedule.name}"
    return _Run(model, dataset, seq_len, optimizer, plan, text, plan.graph)


def _auto_plan(config: TrainConfig, preset: Any, seq_len: int, devices, planned) -> Any:
    """``--layout auto``: the planner's best plan that ``planned(mode, layouts, islands,
    microbatches)`` (the checks of given layouts) accepts; printed."""
    from experiments.plan import auto_plans, first_accepted, hetjax_workload

    kind = devices[0].device_kind.lower()
    gpu = "cpu" if devices[0].platform == "cpu" else ("h200" if "h200" in kind else "h100")
    act_bytes = 2 if config.model.dtype == "bfloat16" else 4
    work = hetjax_workload(config.data.global_batch, seq_len, act_bytes=act_bytes)
    p = config.parallel
    ests = auto_plans(
        preset, len(devices), work, gpu=gpu, zero1=p.zero1, sequence_parallel=p.sequence_parallel
    )
    est, plan = first_accepted(ests, planned)
    print(
        f"--layout auto ({gpu} profile): {est.plan}; predicted {est.tokens_per_s:.0f} tokens/s, "
        f"{est.peak_memory_bytes / 2**20:.0f} MiB per device"
    )
    return plan


def _model_config(m: Any) -> Any:
    """The model: a preset, a Hugging Face LLaVA's config.json, or a preset with parts
    from Hugging Face checkpoints (reads configs only, no weights)."""
    from models.config import get_preset

    if m.init_from:
        from models import hf

        return hf.llava_config_of(m.init_from)
    preset = get_preset(m.preset)
    if m.init:
        from models import hf

        return hf.parts_config(m.init, preset)
    return preset


def _initial_params(config: TrainConfig, run: _Run, lead: bool) -> Any:
    """Fresh parameters, or lazily read Hugging Face weights (each process then reads only
    what its devices hold when the trainer places them)."""
    import jax

    key = jax.random.key(config.seed)
    m = config.model
    if not (m.init_from or m.init):
        return run.model.init(key)
    from models import hf

    if m.init_from:
        params, report = hf.read_llava(run.model, m.init_from, lazy=True)
    else:
        params, report = hf.read_parts(run.model, m.init, key=key, lazy=True)
    if lead:
        for line in report.lines():
            print(line, flush=True)
    return params


def _trainer(
    config: TrainConfig,
    run: _Run,
    devices: Sequence[Any],
    *,
    init: bool = True,
    lead: bool = True,
):
    """The parameters (the run's first compiles) and the trainer that owns them.

    ``init=False``: a checkpoint will be restored, so the executor builds no parameters
    (the reference trainer does, and they are overwritten)."""

    import hetjax

    if run.plan is None or init:
        params = _initial_params(config, run, lead and init)
    else:
        params = None
    if run.plan is None:
        frozen = {p for m in run.graph.modules for p in m.frozen}
        axes = {n: m.logical_axes() for n, m in run.model.modules.items() if n not in frozen}
        return hetjax.ReferenceTrainer(
            run.model.loss_sum,
            params,
            hetjax.make_optimizer(run.optimizer, logical_axes=axes),
            devices=devices,
            microbatches=config.parallel.microbatches,
            frozen=frozen,
        )
    p = config.parallel
    return hetjax.Executor(
        run.plan,
        params,
        devices=devices,
        optimizer=run.optimizer,
        options=hetjax.ParallelOptions(
            zero1=p.zero1,
            sequence_parallel=p.sequence_parallel,
            skip_nonfinite=config.skip_nonfinite_steps > 0,
        ),
    )


def _flop_metrics(config: TrainConfig, run: _Run, devices: Sequence[Any]):
    """``(supervised tokens, step time) -> FLOP metrics`` of the run
    (:func:`hetjax.runtime.flops.throughput_metrics`): model FLOPs from the model's forward
    FLOPs per part by the 3x / 2x / 1x rule; hardware FLOPs count what the kernels compute
    (full causal attention, the head over every token) and the executor's backward
    recompute (the reference trainer recomputes nothing); MFU with the peak of
    ``--peak-tflops`` or the device table."""
    from hetjax.runtime import flops

    peak = config.parallel.peak_tflops or flops.peak_tflops(devices[0].device_kind)
    n = len(devices)
    module_devices = (
        {m.name: n for m in run.graph.modules}
        if run.plan is None
        else {name: len(pos) for name, pos in run.plan.positions.items()}
    )

    def metrics(supervised: float, step_time_s: float) -> dict[str, float]:
        sizes = (config.data.global_batch, run.seq_len, int(supervised))
        per = {"images_per_sample": run.model.images_per_row}  # image slots run
        model = flops.model_flops(run.graph, run.model.config.forward_flops(*sizes, **per))
        executed = run.model.config.forward_flops(*sizes, executed=True, **per)
        if run.plan is None:  # the reference trainer recomputes nothing
            hardware = flops.model_flops(run.graph, executed)
        else:
            attention = run.model.config.attention_flops(*sizes[:2], executed=True)
            hardware = flops.hardware_flops(run.graph, executed, attention)
        return flops.throughput_metrics(
            model,
            hardware,
            step_time_s,
            num_devices=n,
            module_devices=module_devices,
            peak=peak,
        )

    return metrics


def _checkpointer(config: TrainConfig):
    """The run's checkpoint directory, checked before training (None: no checkpoints)."""
    if not config.checkpoint.dir:
        return None
    # Only now: importing orbax reconfigures Python logging (JAX's log lines gain a
    # "WARNING:<logger>:" prefix), which runs without checkpoints should not see.
    from hetjax.checkpoint import Checkpointer

    return Checkpointer(config.checkpoint.dir, keep=config.checkpoint.keep)


def _resume(ckpt, trainer, lead: bool) -> tuple[int, dict[str, Any]]:
    """Restores the latest checkpoint into ``trainer`` (any layout); returns its step and
    metadata."""
    meta = ckpt.restore(trainer)
    step = int(meta["step"])
    if lead:
        print(f"resumed from step {step} ({ckpt.path(step)})", flush=True)
    return step, meta


def _kept(ckpt):
    """For the non-finite error: where the last complete checkpoint is."""

    def note() -> str:
        if ckpt is None:
            return ""
        ckpt.wait()
        last = ckpt.latest_step()
        return (
            ""
            if last is None
            else f"; the checkpoint after step {last} ({ckpt.path(last)}) is intact"
        )

    return note


def _stream(
    config: TrainConfig,
    run: _Run,
    resumed: dict[str, Any] | None,
    num_devices: int,
    trainer: Any,
    multi: bool,
):
    """The run's batches: LLaVA files from a resumed loader position, or synthetic. In a
    multi-process run each process decodes only the images its devices are fed."""
    from hetjax.runtime.feed import local_rows
    from models.llava import run as llava_run

    if not config.data.sources:
        return llava_run.SyntheticStream(run.dataset, config.data.global_batch, config.seed)
    state = resumed["state"] if resumed and resumed.get("kind") == "llava" else None
    if run.plan is None:  # the reference trainer: data parallel over every device
        dp = {"llm": num_devices}
    else:
        dp = {m.name: m.layout.dp * m.layout.ep for m in run.graph.modules}
    microbatches = run.plan.microbatches if run.plan else config.parallel.microbatches
    bins = (microbatches, dp.get("vision", dp["llm"]), dp["llm"])
    image_rows = None  # one process, or the reference trainer: every image
    shape = run.dataset.images_shape
    if multi and run.plan is not None and shape is not None:
        programs = trainer.programs.values()
        image_rows = local_rows(programs, microbatches, {"images": shape})["images"]
    return llava_run.DataStream(run.dataset, bins, state, image_rows=image_rows)


def _metadata(config: TrainConfig, run: _Run, data: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint records besides the arrays: enough to say what it is and to
    continue the data stream (synthetic data is a function of seed and step; LLaVA
    data's position is the loader's state)."""
    import hetjax.config as hc
    from models.config import config_to_dict

    return {
        "config": hc.to_dict(config),
        "model": {
            "preset": run.model.config.name,
            "params": run.model.num_params(),
            "config": config_to_dict(run.model.config),  # what experiments.export rebuilds
        },
        "data": data,
        "rng": {"init_seed": config.seed},
        "layout": run.layout_text,
    }


def _hooks(
    config: TrainConfig,
    run: _Run,
    devices: Sequence[Any],
    processes: int,
    start: int,
    stream: Any,
) -> list:
    """Process 0's observers: metrics file, TensorBoard, progress bar, plot, run summary."""
    import hetjax

    hooks: list = []
    logging = config.logging
    if logging.metrics:
        hooks.append(hetjax.JsonlWriter(logging.metrics, append=start > 0))
    if logging.tensorboard:
        hooks.append(hetjax.TensorBoardWriter(logging.tensorboard, start=start))
    hooks.append(hetjax.ProgressBar(config.stop_after or config.steps, start=start))
    if logging.plot:
        hooks.append(hetjax.MetricsPlot(logging.plot))
    counts = run.model.num_params()
    over = f" over {processes} processes" if processes > 1 else ""
    params = ", ".join(f"{k} {v:,}" for k, v in counts.items())
    # Without --seq-len the length comes from the model (a preset, or an HF config's
    # max_position_embeddings capped at 2048): say so, as it sets the memory of a step.
    seq_from = "" if config.model.seq_len else " (the model's; --seq-len sets it)"
    summary = {
        "model": f"{run.model.config.name}: {sum(counts.values()):,} params ({params})",
        "devices": f"{len(devices)} x {devices[0].platform}{over}",
        "layout": run.layout_text,
        "batch": f"{config.data.global_batch} samples x {run.seq_len} tokens{seq_from}, "
        f"{run.plan.microbatches if run.plan else config.parallel.microbatches} microbatch(es), "
        f"{config.model.dtype}",
        "data": _AtEnd(stream.summary),  # skip and truncation counts, read at the end
    }
    if config.data.sources:  # the image budget and where it came from (flag or data)
        summary["image slots"] = run.dataset.image_budget
    hooks.append(hetjax.Summary(summary))
    return hooks


class _AtEnd:
    """A summary value computed when the summary prints."""

    def __init__(self, fn):
        self.fn = fn

    def __format__(self, spec: str) -> str:
        return format(self.fn(), spec)


def _shared_settings(config: TrainConfig, devices: Sequence[Any]) -> dict[str, Any]:
    """What every process of a job must agree on: the config (dotted keys) minus
    :data:`_PER_PROCESS`, plus the devices and JAX version each process found."""
    import jax

    import hetjax.config as hc

    flat = hc.flatten(hc.to_dict(config))
    shared = {k: v for k, v in flat.items() if k not in _PER_PROCESS}
    shared["global devices"] = f"{len(devices)} x {devices[0].platform}"
    shared["jax"] = jax.__version__
    return shared


@contextlib.contextmanager
def _stop_peers_on_error(multiprocess: bool) -> Iterator[None]:
    """A :class:`ConfigError` raised inside may hit only some processes (another machine's
    GPUs or files differ): in a multi-process run it stops the others too, at once,
    instead of leaving them to wait in a collective for this one."""
    try:
        yield
    except ConfigError as e:
        if multiprocess:
            from hetjax import distributed

            distributed.fail(f"{PROG}: error: {e}", exit_code=2)
        raise


if __name__ == "__main__":
    run_cli(lambda argv: main(parse_args(argv)), PROG)
