"""The loss contract: a SUM over supervised tokens, normalised by the GLOBAL token count.

So ``sum_m loss_sum(mb_m) / N_global`` equals the whole-batch mean loss (and gradient)
for any split into microbatches.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import get_preset
from models.data import SyntheticConfig, SyntheticLlava
from models.mllm import MLLM

GLOBAL_BATCH = 8
MICROBATCH = 2  # every test reuses the two compiled shapes: 8 and 2 samples
ONE = np.float32(1.0)  # normaliser of a plain sum (a Python 1.0 is weakly typed: recompiles)


@pytest.fixture(scope="module")
def setup():
    cfg = get_preset("tiny")
    model = MLLM(cfg)
    params = model.init(jax.random.key(2))
    data = SyntheticLlava(SyntheticConfig.for_model(cfg, seq_len=cfg.seq_len, seed=5))
    batch = {k: jnp.asarray(v) for k, v in data.batch(0, GLOBAL_BATCH).items()}
    # value_and_grad of loss_sum / n: n=1 gives the plain sum; one compile per batch shape.
    grad_fn = jax.jit(jax.value_and_grad(lambda p, b, n: model.loss_sum(p, b) / n))
    return model, params, batch, grad_fn


def test_unsupervised_targets_do_not_matter(setup):
    model, params, batch, grad_fn = setup
    mask = np.asarray(batch["loss_mask"])
    assert 0 < mask.sum() < mask.size
    rng = np.random.default_rng(0)
    noise = jnp.asarray(rng.integers(0, 320, size=mask.shape), jnp.int32)
    scrambled = dict(batch, targets=jnp.where(mask == 0, noise, batch["targets"]))
    assert not np.array_equal(np.asarray(scrambled["targets"]), np.asarray(batch["targets"]))
    loss, grads = grad_fn(params, batch, ONE)
    loss_s, grads_s = grad_fn(params, scrambled, ONE)
    assert float(loss_s) == float(loss)
    for a, b in zip(jax.tree.leaves(grads_s), jax.tree.leaves(grads), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Supervised targets do matter.
    changed = dict(batch, targets=jnp.where(mask == 1, noise, batch["targets"]))
    assert float(grad_fn(params, changed, ONE)[0]) != float(loss)


def test_loss_sum_scales_with_mask(setup):
    """An all-zero mask gives exactly 0; repeating a batch doubles the sum."""
    model, params, batch, grad_fn = setup
    zero = dict(batch, loss_mask=jnp.zeros_like(batch["loss_mask"]))
    assert float(grad_fn(params, zero, ONE)[0]) == 0.0
    first = {k: v[:MICROBATCH] for k, v in batch.items()}
    repeated = {k: jnp.concatenate([v] * (GLOBAL_BATCH // MICROBATCH)) for k, v in first.items()}
    np.testing.assert_allclose(
        float(grad_fn(params, repeated, ONE)[0]),
        GLOBAL_BATCH // MICROBATCH * float(grad_fn(params, first, ONE)[0]),
        rtol=1e-5,
    )


def _assert_tree_close(a, b, rtol):
    for path, x, y in zip(
        jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(a), jax.tree.leaves(b), strict=True
    ):
        x, y = np.asarray(x), np.asarray(y)
        # rtol on each entry, with an absolute floor at rtol x the leaf's largest entry:
        # entries that cancel to ~0 carry reordering noise of that size.
        atol = rtol * float(np.max(np.abs(y)))
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=str(path[0]))


def test_microbatch_split_matches_whole_batch(setup):
    model, params, batch, grad_fn = setup
    n_global = jnp.sum(batch["loss_mask"])
    loss, grads = grad_fn(params, batch, n_global)
    microbatches = GLOBAL_BATCH // MICROBATCH
    mb_loss, mb_grads = 0.0, jax.tree.map(jnp.zeros_like, params)
    for m in range(microbatches):
        mb = {k: v[m * MICROBATCH : (m + 1) * MICROBATCH] for k, v in batch.items()}
        l_m, g_m = grad_fn(params, mb, n_global)
        mb_loss += float(l_m)
        mb_grads = jax.tree.map(jnp.add, mb_grads, g_m)
    np.testing.assert_allclose(mb_loss, float(loss), rtol=1e-5)
    _assert_tree_close(mb_grads, grads, rtol=1e-5)
    # Normalising per microbatch instead (a mean of means) would NOT match: the
    # microbatches hold different numbers of supervised tokens.
    counts = [
        float(batch["loss_mask"][m * MICROBATCH : (m + 1) * MICROBATCH].sum())
        for m in range(microbatches)
    ]
    assert len(set(counts)) > 1
