"""``python -m experiments.export``: an orbax training checkpoint -> a Hugging Face
LLaVA directory whose reload holds the checkpoint's parameters bit for bit."""

from __future__ import annotations

import jax
import numpy as np

import hetjax
from hetjax import checkpoint
from models import hf
from models.config import config_to_dict, get_preset
from models.mllm import MLLM
from tests import launch


def test_export_of_a_checkpoint_reloads_bit_exactly(tmp_path):
    config = get_preset("llava-1.5-tiny")
    model = MLLM(config)
    params = model.init(jax.random.key(1))
    trainer = hetjax.ReferenceTrainer(
        model.loss_sum,
        params,
        hetjax.make_optimizer(hetjax.AdamWConfig(total_steps=10)),
        devices=jax.devices()[:1],
    )
    meta = {"model": {"preset": config.name, "config": config_to_dict(config)}}
    checkpoint.save(tmp_path / "ckpt", trainer, 3, metadata=meta)
    cmd = ["experiments.export", "--checkpoint", str(tmp_path / "ckpt")]
    out = launch.run(*cmd, "--out", str(tmp_path / "hf"))
    assert out.returncode == 0, out.stderr
    assert "exported step 3" in out.stdout
    again, reloaded = hf.load(tmp_path / "hf")
    assert again.config.vision == config.vision and again.config.llm == config.llm
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reloaded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    # a second export into the same directory is refused in one line
    again = launch.run(*cmd, "--out", str(tmp_path / "hf"))
    assert again.returncode == 2 and "not empty" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
