"""Train an LLaVA-style MLLM on synthetic data: ``python -m experiments.llava_train``.

With no flags: the ``tiny`` preset on 8 simulated CPU devices (or the visible GPUs) with
a heterogeneous colocated layout - the encoder data parallel over every device, the LLM
with ``pp=2, tp=2`` - for a run that finishes in well under two minutes on a laptop CPU.

The same command runs as one process of a multi-process job (JAX's multi-controller
runtime, one process per node or per GPU): under ``python -m hetjax.launch`` on one
machine, under SLURM (``srun ... python -m experiments.llava_train``), or started by hand
with ``--coordinator HOST:PORT --num-processes N --process-id I``. Every process builds
the same global batch and walks the same schedule; the processes refuse to start if
their settings differ, stop together when one fails, and only process 0 prints and
writes files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Sequence
from typing import Any, Literal

from experiments.cli import (
    ConfigError,
    OneLineParser,
    accelerator_installed,
    non_negative_int,
    positive_float,
    positive_int,
    run_cli,
    setup_devices,
)

PROG = "llava_train"
# Settings that are this process's own, so they may differ between processes: the
# coordinator's address as each process reaches it, its index, and the files that only
# process 0 writes.
_PER_PROCESS = ("coordinator", "process_id", "metrics", "timeline")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a run depends on; flags map one-to-one onto these fields."""

    model: str = "tiny"  # model preset: tiny, tiny-av, small
    steps: int = 200  # optimiser steps
    global_batch: int = 32  # samples per step, over all devices and microbatches
    microbatches: int = 4  # pipeline microbatches per global batch
    seq_len: int | None = None  # text+media tokens per sample (None: the preset's)
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype; params stay float32
    seed: int = 0  # initialisation and data seed
    lr: float = 3e-3  # peak learning rate
    warmup_steps: int | None = None  # warm-up steps (None: 10% of the run)
    weight_decay: float = 0.01
    clip_norm: float = 1.0  # global gradient-norm clip
    devices: int | None = None  # simulated CPU devices if no GPU (None: 8; on GPU: all);
    # in a multi-process run, devices PER PROCESS (None: the launcher's count, or all GPUs)
    metrics: str | None = None  # JSON Lines path for per-step metrics
    layout: tuple[str, ...] = ()  # MODULE:LAYOUT items, e.g. ("llm:dp=2,tp=2,pp=2",)
    placement: Literal["colocated", "non-colocated"] = "colocated"
    island: tuple[str, ...] = ()  # MODULE:N device counts for non-colocated placement
    homogeneous: bool = False  # baseline: encoders inherit the LLM's layout and first stage
    schedule: Literal["1f1b", "gpipe"] = "1f1b"  # pipeline order of the pipelined part
    offload_encoder: bool = False  # colocated: encoder state in host memory in phase 2
    timeline: str | None = None  # PNG path: Gantt chart of the last (profiled) step
    reference: bool = False  # plain data-parallel reference trainer instead
    zero1: bool = False  # shard optimizer state over each module's dp (ZeRO-1)
    sequence_parallel: bool = False  # TP activations sharded on sequence between blocks
    coordinator: str | None = None  # HOST:PORT of process 0, for a hand-started job
    num_processes: int | None = None  # processes of a hand-started job
    process_id: int | None = None  # this process's index in a hand-started job


def parse_args(argv: Sequence[str]) -> TrainConfig:
    p = OneLineParser(prog=PROG, description=__doc__.splitlines()[0])
    d = TrainConfig()
    p.add_argument("--model", default=d.model, help="model preset: tiny, tiny-av, small")
    p.add_argument("--steps", type=positive_int, default=d.steps)
    p.add_argument("--global-batch", type=positive_int, default=d.global_batch)
    p.add_argument(
        "--microbatches",
        type=positive_int,
        default=d.microbatches,
        help="pipeline microbatches per global batch",
    )
    p.add_argument("--seq-len", type=positive_int, default=d.seq_len)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=d.dtype)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--lr", type=positive_float, default=d.lr)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--clip-norm", type=float, default=d.clip_norm)
    p.add_argument(
        "--devices",
        type=positive_int,
        default=d.devices,
        help="simulated CPU devices when there is no GPU (default 8); in a multi-process "
        "run, devices PER PROCESS (default: the launcher's --devices-per-process, or every "
        "GPU the process sees)",
    )
    p.add_argument("--metrics", default=d.metrics, help="write per-step metrics (JSON Lines)")
    p.add_argument(
        "--layout",
        action="append",
        default=[],
        metavar="MODULE:LAYOUT",
        help="e.g. vision:dp=8 or llm:dp=2,tp=2,pp=2 (repeatable)",
    )
    p.add_argument("--placement", choices=["colocated", "non-colocated"], default=d.placement)
    p.add_argument(
        "--island",
        action="append",
        default=[],
        metavar="MODULE:N",
        help="device count of a module's island, assigned in order (repeatable)",
    )
    p.add_argument(
        "--homogeneous",
        action="store_true",
        help="baseline: encoders inherit the LLM's layout on its first stage",
    )
    p.add_argument("--schedule", choices=["1f1b", "gpipe"], default=d.schedule)
    p.add_argument(
        "--offload-encoder",
        action="store_true",
        help="colocated: encoder params/optimizer state in host memory in phase 2",
    )
    p.add_argument(
        "--timeline",
        default=d.timeline,
        metavar="PATH.png",
        help="profile the last step and draw its simulated Gantt chart",
    )
    p.add_argument(
        "--reference",
        action="store_true",
        help="train with the plain data-parallel reference trainer instead",
    )
    p.add_argument(
        "--zero1",
        action="store_true",
        help="shard Adam moments over each module's data-parallel ranks",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with tp > 1: activations between TP regions sharded on sequence",
    )
    p.add_argument(
        "--coordinator",
        default=d.coordinator,
        metavar="HOST:PORT",
        help="multi-process job started by hand: process 0's address (with --num-processes, "
        "--process-id; not needed under python -m hetjax.launch or SLURM)",
    )
    p.add_argument(
        "--num-processes",
        type=positive_int,
        default=d.num_processes,
        metavar="N",
        help="multi-process job started by hand: number of processes",
    )
    p.add_argument(
        "--process-id",
        type=non_negative_int,
        default=d.process_id,
        metavar="I",
        help="multi-process job started by hand: this process's index, 0 .. N-1",
    )
    args = p.parse_args(list(argv))
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    values["layout"], values["island"] = tuple(args.layout), tuple(args.island)
    return TrainConfig(**values)


def default_layouts(modules: Sequence[str], num_devices: int) -> dict[str, str]:
    """No ``--layout`` at all: encoders data parallel over every device; the LLM with
    ``pp=2, tp=2`` when the device count allows it, else data parallel."""
    llm = f"dp={num_devices // 4},tp=2,pp=2" if num_devices % 4 == 0 else f"dp={num_devices}"
    return {m: (llm if m == "llm" else f"dp={num_devices}") for m in modules}


def parse_islands(items: Sequence[str]) -> dict[str, int]:
    out = {}
    for item in items:
        name, sep, count = item.partition(":")
        if not sep or not count.isdigit() or int(count) < 1:
            raise ConfigError(f"--island {item!r}: expected MODULE:N with N a positive integer")
        if name in out:
            raise ConfigError(f"--island {name} given twice; give each module one island")
        out[name] = int(count)
    return out


def main(config: TrainConfig) -> int:
    # Before anything touches JAX: XLA reads it when it loads, and a multi-process run
    # must join its job before any backend exists.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from hetjax import distributed

    try:
        info = distributed.initialize(
            coordinator=config.coordinator,
            num_processes=config.num_processes,
            process_id=config.process_id,
            local_device_count=config.devices,
            cpu=not accelerator_installed(),
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    multi = info.is_multiprocess
    if multi:
        # First: from here on, a process that stops takes the others with it.
        distributed.watch_peers()
    with _stop_peers_on_error(multi):  # GPU counts may differ between machines
        devices = setup_devices(config.devices, multiprocess=multi)
    # JAX-using imports come after the device count is fixed.
    import jax
    import jax.numpy as jnp

    import hetjax
    from models.config import get_preset
    from models.data import DataConfig, SyntheticLlava
    from models.mllm import MLLM

    if multi:
        try:  # on every process alike, so every process reports it and exits normally
            distributed.check_consistent("training config", _shared_settings(config, devices))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    lead = jax.process_index() == 0  # prints and writes files
    with _stop_peers_on_error(multi):  # only process 0 checks where it writes
        for flag, path in (("--metrics", config.metrics), ("--timeline", config.timeline)):
            if lead and path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
                raise ConfigError(
                    f"{flag} {path}: directory {os.path.dirname(os.path.abspath(path))} does "
                    "not exist; create it or write the file elsewhere"
                )

    # The settings agree, so a bad one fails alike on every process (a normal exit).
    try:
        preset = get_preset(config.model)
        seq_len = config.seq_len or preset.seq_len
        dataset = SyntheticLlava(DataConfig.for_model(preset, seq_len=seq_len, seed=config.seed))
        opt_cfg = hetjax.OptimizerConfig(
            lr=config.lr,
            total_steps=config.steps,
            warmup_steps=(
                max(1, config.steps // 10) if config.warmup_steps is None else config.warmup_steps
            ),
            weight_decay=config.weight_decay,
            clip_norm=config.clip_norm,
        )
        model = MLLM(preset, dtype=jnp.bfloat16 if config.dtype == "bfloat16" else jnp.float32)

        def init_params():  # only after every check: init runs (and compiles) JAX ops
            return model.init(jax.random.key(config.seed))

        if config.reference:
            trainer, layout_text = _reference(config, model, init_params, opt_cfg, devices)
        else:
            trainer, layout_text = _heterogeneous(config, model, init_params, opt_cfg, devices)
    except ValueError as e:  # LayoutError, BoundaryError, ScheduleError are ValueErrors
        raise ConfigError(str(e)) from None

    hooks: list = []
    if lead:
        if config.metrics:
            hooks.append(hetjax.JsonlWriter(config.metrics))
        hooks.append(hetjax.ProgressBar(config.steps))
        counts = model.num_params()
        over = f" over {info.num_processes} processes" if multi else ""
        hooks.append(
            hetjax.Summary(
                {
                    "model": f"{preset.name}: {sum(counts.values()):,} params ("
                    + ", ".join(f"{k} {v:,}" for k, v in counts.items())
                    + ")",
                    "devices": f"{len(devices)} x {devices[0].platform}{over}",
                    "layout": layout_text,
                    "batch": f"{config.global_batch} samples x {seq_len} tokens, "
                    f"{config.microbatches} microbatch(es), {config.dtype}",
                }
            )
        )

    def step(i: int):
        profile = config.timeline is not None and i == config.steps - 1
        # Every process builds the same global batch (seed, step); the trainer keeps
        # only this process's shards of it.
        batch = dataset.batch(i, config.global_batch)
        return trainer.step(batch, profile=True) if profile else trainer.step(batch)

    hetjax.run_training(
        step, config.steps, tokens_per_step=config.global_batch * seq_len, hooks=hooks
    )
    if config.timeline and lead:
        timeline = trainer.timeline()
        timeline.to_png(config.timeline)
        bubbles = ", ".join(f"{b:.2f}" for b in timeline.bubble)
        note = " (stages on other processes were not timed here: read as 0)" if multi else ""
        print(f"timeline: {config.timeline} (simulated bubble per stage: {bubbles}){note}")
    return 0


def _shared_settings(config: TrainConfig, devices: Sequence[Any]) -> dict[str, Any]:
    """What every process of a job must agree on: the config minus :data:`_PER_PROCESS`,
    plus the devices and JAX version each process found."""
    import jax

    shared = {k: v for k, v in dataclasses.asdict(config).items() if k not in _PER_PROCESS}
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


def _reference(config, model, init_params, opt_cfg, devices):
    import hetjax

    for flag, on in (
        ("--timeline", config.timeline),
        ("--zero1", config.zero1),
        ("--sequence-parallel", config.sequence_parallel),
        ("--offload-encoder", config.offload_encoder),
    ):
        if on:
            raise ConfigError(f"{flag} is a heterogeneous-executor option; drop --reference")
    hetjax.runtime.check_batch_split(config.global_batch, config.microbatches, len(devices))
    axes = {name: m.logical_axes() for name, m in model.modules.items()}
    trainer = hetjax.ReferenceTrainer(
        model.loss_sum,
        init_params(),
        hetjax.make_optimizer(opt_cfg, logical_axes=axes),
        devices=devices,
        microbatches=config.microbatches,
    )
    return trainer, f"reference data parallel: dp={len(devices)}"


def _heterogeneous(config, model, init_params, opt_cfg, devices):
    import hetjax
    from hetjax.runtime.executor import check_batch, homogeneous_graph

    names = model.module_names
    given = hetjax.runtime.parse_layouts(config.layout, names)
    if not given:
        given = {n: hetjax.Layout.parse(t) for n, t in default_layouts(names, len(devices)).items()}
    elif "llm" not in given:
        raise ConfigError("give the LLM's layout too, e.g. --layout llm:dp=2,tp=2,pp=2")
    layouts = {n: given.get(n, given["llm"]) for n in names}
    model.validate_layouts(layouts, seq_len=config.seq_len or model.config.seq_len)
    mode = "homogeneous" if config.homogeneous else config.placement
    if config.island and mode != "non-colocated":
        raise ConfigError("--island is only for --placement non-colocated")
    graph = model.train_graph(layouts)
    # Before parameters exist, so a bad batch fails without compiling anything.
    effective = homogeneous_graph(graph) if mode == "homogeneous" else graph
    if mode == "homogeneous":  # the encoders' inherited layouts must fit them too
        model.validate_layouts({m.name: m.layout for m in effective.modules if m.name != "llm"})
    check_batch(effective, config.global_batch, config.microbatches)
    trainer = hetjax.Executor(
        graph,
        init_params(),
        devices=devices,
        mode=mode,
        islands=parse_islands(config.island) if config.island else None,
        microbatches=config.microbatches,
        schedule=config.schedule,
        optimizer=opt_cfg,
        offload_encoders=config.offload_encoder,
        options=hetjax.ParallelOptions(
            zero1=config.zero1, sequence_parallel=config.sequence_parallel
        ),
    )
    shown = {spec.name: str(spec.layout) for spec in trainer.graph.modules}
    text = f"{mode}: " + "; ".join(f"{n} {l}" for n, l in shown.items())
    return trainer, text + f"; schedule {trainer.schedule.name}"


if __name__ == "__main__":
    run_cli(lambda argv: main(parse_args(argv)), PROG)
