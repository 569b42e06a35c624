"""The answers need the image: training with real images beats training with blank ones.

Without images the model can only learn the answer format (and the prior over colours and
positions); with them it can drive the answer loss towards zero. On ``tiny`` the
visual grounding sets in after ~100 steps of 32 samples, so this runs 200 steps.
"""

import jax
import numpy as np
import pytest

from hetjax.runtime import OptimizerConfig, ReferenceTrainer, make_optimizer
from models.config import get_preset
from models.data import DataConfig, SyntheticLlava
from models.mllm import MLLM

STEPS = 200
BATCH = 32
TAIL = 20  # steps averaged at the end (single-step losses are noisy)


def _train(blank_images: bool) -> np.ndarray:
    cfg = get_preset("tiny")
    model = MLLM(cfg)
    data_cfg = DataConfig.for_model(cfg, seq_len=cfg.seq_len, seed=0)
    data_cfg = DataConfig(**{**data_cfg.__dict__, "seq_len": data_cfg.max_sample_tokens() - 1})
    data = SyntheticLlava(data_cfg)
    axes = {name: m.logical_axes() for name, m in model.modules.items()}
    # Constant learning rate after warm-up: a decaying one stalls before grounding.
    opt = OptimizerConfig(lr=3e-3, warmup_steps=20, total_steps=STEPS, end_lr_ratio=1.0)
    trainer = ReferenceTrainer(
        model.loss_sum,
        model.init(jax.random.key(0)),
        make_optimizer(opt, logical_axes=axes),
        devices=jax.devices()[:1],
    )
    losses = []
    for step in range(STEPS):
        batch = data.batch(step, BATCH)
        if blank_images:
            batch["images"] = np.zeros_like(batch["images"])
        losses.append(trainer.step(batch)["loss"])
    return np.asarray([float(x) for x in losses])


@pytest.mark.slow
def test_real_images_reach_much_lower_loss_than_blank_images():
    real, blank = _train(blank_images=False), _train(blank_images=True)
    assert np.all(np.isfinite(real)) and np.all(np.isfinite(blank))
    # Both learn the format ...
    assert blank[-TAIL:].mean() < 0.1 * blank[0]
    # ... but only the model that sees the images learns their content.
    assert real[-TAIL:].mean() * 3 < blank[-TAIL:].mean(), (
        real[-TAIL:].mean(),
        blank[-TAIL:].mean(),
    )
