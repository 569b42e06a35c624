"""ReferenceTrainer: the loss and the update do not depend on how the batch is split.

Microbatches (gradient accumulation) and data-parallel devices only reorder float sums,
so losses agree to FP32 rtol 1e-5 and parameters after one step to atol 1e-6; two runs
of the same layout and seed are bitwise identical.
"""

import jax
import numpy as np
import pytest

from hetjax.runtime import (
    AdamWConfig,
    ReferenceTrainer,
    check_batch_split,
    make_optimizer,
    split_microbatches,
)
from models.config import get_preset
from models.data import SyntheticConfig, SyntheticLlava
from models.mllm import MLLM

GLOBAL_BATCH = 8
STEPS = 3
LAYOUTS = [(1, 1), (1, 2), (1, 4), (8, 1)]  # (data-parallel devices, microbatches)


@pytest.fixture(scope="module")
def setup():
    cfg = get_preset("tiny")
    model = MLLM(cfg)
    data = SyntheticLlava(SyntheticConfig.for_model(cfg, seq_len=cfg.seq_len, seed=0))
    batches = [data.batch(s, GLOBAL_BATCH) for s in range(STEPS)]
    axes = {name: m.logical_axes() for name, m in model.modules.items()}
    # No warm-up: the first step already moves the parameters. Adam's first update is
    # lr * g / (|g| + eps), whose sensitivity to g is lr / eps: with the default eps=1e-8 a
    # gradient entry that is ~0 up to summation-order noise (1e-9) can move by up to lr.
    # eps=1e-4 keeps that amplification at lr / eps = 30, so the parameter comparison
    # checks the gradient reduction, not the conditioning of a near-zero division.
    opt_cfg = AdamWConfig(lr=3e-3, warmup_steps=0, total_steps=STEPS, eps=1e-4)

    def run(dp: int, microbatches: int, seed: int = 0):
        params = model.init(jax.random.key(seed))
        trainer = ReferenceTrainer(
            model.loss_sum,
            params,
            make_optimizer(opt_cfg, logical_axes=axes),
            devices=jax.devices()[:dp],
            microbatches=microbatches,
        )
        losses, after_one = [], None
        for s, batch in enumerate(batches):
            metrics = trainer.step(batch)
            if s == 0:
                after_one = jax.device_get(trainer.params)  # before the next step donates
            losses.append(np.float32(metrics["loss"]))
        return {"losses": np.asarray(losses), "params": after_one, "init": params}

    return run


@pytest.fixture(scope="module")
def runs(setup):
    return {layout: setup(*layout) for layout in LAYOUTS}


@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_losses_match_single_device_single_microbatch(runs, layout):
    ref, got = runs[(1, 1)], runs[layout]
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_params_after_one_step_match(runs, layout):
    ref, got = runs[(1, 1)], runs[layout]
    paths = jax.tree_util.tree_leaves_with_path(ref["params"])
    for (path, a), b in zip(paths, jax.tree.leaves(got["params"]), strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_first_step_moves_parameters(runs):
    run = runs[(1, 1)]
    moved = [
        np.abs(np.asarray(a) - np.asarray(b)).max()
        for a, b in zip(jax.tree.leaves(run["params"]), jax.tree.leaves(run["init"]), strict=True)
    ]
    assert min(moved) > 1e-4  # every leaf received an update of about lr
    assert np.all(np.isfinite(run["losses"])) and run["losses"][-1] < run["losses"][0]


def test_caller_params_survive_the_donating_step(runs):
    """The trainer donates its own copy; the caller's initial parameters stay usable."""
    for leaf in jax.tree.leaves(runs[(8, 1)]["init"]):
        assert not leaf.is_deleted()
        np.asarray(leaf)


def test_same_seed_runs_are_bitwise_identical(setup, runs):
    again = setup(1, 1)
    np.testing.assert_array_equal(again["losses"], runs[(1, 1)]["losses"])
    for a, b in zip(
        jax.tree.leaves(again["params"]), jax.tree.leaves(runs[(1, 1)]["params"]), strict=True
    ):
        np.testing.assert_array_equal(a, b)


def test_split_microbatches_layout():
    batch = {"x": np.arange(12).reshape(6, 2), "y": np.arange(6)}
    out = split_microbatches(batch, 3)
    assert out["x"].shape == (3, 2, 2)
    np.testing.assert_array_equal(out["y"], [[0, 1], [2, 3], [4, 5]])


def test_check_batch_split_errors_name_the_fix():
    check_batch_split(8, 2, 4)
    with pytest.raises(ValueError, match="not divisible by microbatches=4"):
        check_batch_split(10, 4, 1)
    with pytest.raises(ValueError, match="use a global batch that is a multiple of 8"):
        check_batch_split(12, 2, 4)
