"""The answers need the image: training with real images beats training with blank ones.

Without images the model can only learn the answer format (and the prior over colours and
positions); with them it can answer from the image. On ``tiny`` the visual grounding sets
in after ~100 steps of 32 samples, so this runs 200 steps.

The check is held-out answer accuracy (a row counts when every supervised token is the
greedy prediction), not a ratio of training losses: after 200 steps the real-image loss
is still falling and its last steps' mean moves by ~10% between CPUs (XLA's rounding
differs by instruction set, and 200 steps of training amplify it), which put a loss
ratio of 3 on the edge (3.3 on one machine, 2.95 on another). Accuracy is ~0.78 against
chance ~0.19 ((1/4 + 1/4 + 1/16) / 3 over the three tasks) on every machine tried.
"""

import jax
import numpy as np
import pytest

from hetjax.runtime import AdamWConfig, ReferenceTrainer, make_optimizer
from models.config import get_preset
from models.data import SyntheticConfig, SyntheticLlava
from models.llava.evaluate import answer_accuracy
from models.mllm import MLLM
from tests._xla import OPTIMISED

STEPS = 200
BATCH = 32
TAIL = 20  # steps averaged at the end (single-step losses are noisy)
HELD_OUT = 100_000  # first held-out sample index (training reads 0 .. STEPS * BATCH)
CHANCE = (1 / 4 + 1 / 4 + 1 / 16) / 3  # colour, position, both: guessing from the prior


def _train(blank_images: bool) -> tuple[np.ndarray, dict[str, float]]:
    """Training losses, and held-out accuracy with the real and with blanked images."""
    cfg = get_preset("tiny")
    model = MLLM(cfg)
    data_cfg = SyntheticConfig.for_model(cfg, seq_len=cfg.seq_len, seed=0)
    data_cfg = SyntheticConfig(**{**data_cfg.__dict__, "seq_len": data_cfg.max_sample_tokens() - 1})
    data = SyntheticLlava(data_cfg)
    axes = {name: m.logical_axes() for name, m in model.modules.items()}
    # Constant learning rate after warm-up: a decaying one stalls before grounding.
    opt = AdamWConfig(lr=3e-3, warmup_steps=20, total_steps=STEPS, end_lr_ratio=1.0)
    trainer = ReferenceTrainer(
        model.loss_sum,
        model.init(jax.random.key(0)),
        make_optimizer(opt, logical_axes=axes),
        devices=jax.devices()[:1],
        # 200 steps: the step's run time counts here, so it keeps XLA:CPU's O1 back end
        # while the rest of the suite compiles at O0 (tests/_xla.py)
        compiler_options=OPTIMISED,
    )
    losses = []
    for step in range(STEPS):
        batch = data.batch(step, BATCH)
        if blank_images:
            batch["images"] = np.zeros_like(batch["images"])
        losses.append(trainer.step(batch)["loss"])
    held = data.batch(HELD_OUT // 256, 256)
    blanked = {**held, "images": np.zeros_like(held["images"])}
    accuracy = {
        "real": float(np.nanmean(answer_accuracy(model, trainer.params, held))),
        "blank": float(np.nanmean(answer_accuracy(model, trainer.params, blanked))),
    }
    return np.asarray([float(x) for x in losses]), accuracy


@pytest.mark.slow
def test_only_a_model_trained_on_the_images_answers_from_them():
    (real, real_acc), (blank, blank_acc) = _train(blank_images=False), _train(blank_images=True)
    assert np.all(np.isfinite(real)) and np.all(np.isfinite(blank))
    # Both learn the format ...
    assert blank[-TAIL:].mean() < 0.1 * blank[0]
    assert real[-TAIL:].mean() < blank[-TAIL:].mean()
    # ... but only the model that sees the images learns their content: it answers most
    # held-out questions, and falls to chance when its images are blanked ...
    assert real_acc["real"] > 0.6, real_acc
    assert real_acc["blank"] < 2 * CHANCE, real_acc
    # ... while the model trained on blank images stays at chance whatever it is shown.
    assert max(blank_acc.values()) < 2 * CHANCE, blank_acc
