"""Train an LLaVA-style MLLM on synthetic data: ``python -m experiments.llava_train``.

With no flags: the ``tiny`` preset on 8 simulated CPU devices (or the visible GPUs),
data parallel, for a run that finishes in well under two minutes on a laptop CPU.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Literal

from experiments.cli import (
    ConfigError,
    OneLineParser,
    positive_float,
    positive_int,
    run_cli,
    setup_devices,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a run depends on; flags map one-to-one onto these fields."""

    model: str = "tiny"  # model preset: tiny, tiny-av, small
    steps: int = 200  # optimiser steps
    global_batch: int = 32  # samples per step, over all devices and microbatches
    microbatches: int = 1  # gradient-accumulation steps per global batch
    seq_len: int | None = None  # text+media tokens per sample (None: the preset's)
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype; params stay float32
    seed: int = 0  # initialisation and data seed
    lr: float = 3e-3  # peak learning rate
    warmup_steps: int | None = None  # warm-up steps (None: 10% of the run)
    weight_decay: float = 0.01
    clip_norm: float = 1.0  # global gradient-norm clip
    devices: int | None = None  # simulated CPU devices if no GPU (None: 8; on GPU: all)
    metrics: str | None = None  # JSON Lines path for per-step metrics


def parse_args(argv: Sequence[str]) -> TrainConfig:
    p = OneLineParser(prog="llava_train", description=__doc__.splitlines()[0])
    d = TrainConfig()
    p.add_argument("--model", default=d.model, help="model preset: tiny, tiny-av, small")
    p.add_argument("--steps", type=positive_int, default=d.steps)
    p.add_argument("--global-batch", type=positive_int, default=d.global_batch)
    p.add_argument("--microbatches", type=positive_int, default=d.microbatches)
    p.add_argument("--seq-len", type=positive_int, default=d.seq_len)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=d.dtype)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--lr", type=positive_float, default=d.lr)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--clip-norm", type=float, default=d.clip_norm)
    p.add_argument("--devices", type=positive_int, default=d.devices,
                   help="simulated CPU devices when there is no GPU (default 8)")
    p.add_argument("--metrics", default=d.metrics, help="write per-step metrics (JSON Lines)")
    args = p.parse_args(list(argv))
    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


def main(config: TrainConfig) -> int:
    devices = setup_devices(config.devices)
    # JAX-using imports come after the device count is fixed.
    import jax
    import jax.numpy as jnp

    import hetjax
    from models.config import get_preset
    from models.data import DataConfig, SyntheticLlava
    from models.mllm import MLLM

    try:
        preset = get_preset(config.model)
        seq_len = config.seq_len or preset.seq_len
        dataset = SyntheticLlava(DataConfig.for_model(preset, seq_len=seq_len, seed=config.seed))
        hetjax.runtime.check_batch_split(config.global_batch, config.microbatches, len(devices))
        opt_cfg = hetjax.OptimizerConfig(
            lr=config.lr,
            total_steps=config.steps,
            warmup_steps=(
                max(1, config.steps // 10) if config.warmup_steps is None else config.warmup_steps
            ),
            weight_decay=config.weight_decay,
            clip_norm=config.clip_norm,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None

    model = MLLM(preset, dtype=jnp.bfloat16 if config.dtype == "bfloat16" else jnp.float32)
    params = model.init(jax.random.key(config.seed))
    axes = {name: m.logical_axes() for name, m in model.modules.items()}
    trainer = hetjax.ReferenceTrainer(
        model.loss_sum,
        params,
        hetjax.make_optimizer(opt_cfg, logical_axes=axes),
        devices=devices,
        microbatches=config.microbatches,
    )

    hooks: list = []
    if jax.process_index() == 0:
        if config.metrics:
            hooks.append(hetjax.JsonlWriter(config.metrics))
        hooks.append(hetjax.ProgressBar(config.steps))
        counts = model.num_params()
        hooks.append(hetjax.Summary({
            "model": f"{preset.name}: {sum(counts.values()):,} params ("
                     + ", ".join(f"{k} {v:,}" for k, v in counts.items()) + ")",
            "devices": f"{len(devices)} x {devices[0].platform}",
            "layout": f"reference data parallel: dp={len(devices)}, "
                      f"{config.microbatches} microbatch(es)",
            "batch": f"{config.global_batch} samples x {seq_len} tokens, {config.dtype}",
        }))
    hetjax.run_training(
        lambda step: trainer.step(dataset.batch(step, config.global_batch)),
        config.steps,
        tokens_per_step=config.global_batch * seq_len,
        hooks=hooks,
    )
    return 0


if __name__ == "__main__":
    run_cli(lambda argv: main(parse_args(argv)), "llava_train")
