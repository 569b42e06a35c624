"""Optimiser: which leaves decay, the learning-rate schedule, and gradient clipping."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hetjax.runtime import AdamWConfig, decay_mask, learning_rate_schedule, make_optimizer
from models.config import get_preset
from models.mllm import MLLM


@pytest.fixture(scope="module")
def axes():
    model = MLLM(get_preset("tiny-av"))
    return {name: m.logical_axes() for name, m in model.modules.items()}


def _flat(tree):
    return {
        jax.tree_util.keystr(path): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(
            tree, is_leaf=lambda x: isinstance(x, tuple)
        )
    }


def test_decay_mask_matrices_only(axes):
    mask, names = _flat(decay_mask(axes)), _flat(axes)
    assert mask.keys() == names.keys()
    for path, decays in mask.items():
        last = path.rsplit("[", 1)[-1]
        if "'bias'" in last or "'scale'" in last:
            assert decays is False, path  # biases and norm scales, stacked or not
        elif "'kernel'" in last or "'table'" in last:
            assert decays is True, path  # matrices, stacked or not
    # Spot checks on stacked leaves: the "layers" axis does not make a vector a matrix.
    assert names["['llm']['blocks']['attn_norm']['scale']"] == ("layers", "embed")
    assert mask["['llm']['blocks']['attn_norm']['scale']"] is False
    assert mask["['vision']['blocks']['up']['bias']"] is False
    assert mask["['audio']['blocks']['norm1']['bias']"] is False
    assert mask["['llm']['blocks']['qkv']['kernel']"] is True
    assert mask["['llm']['post']['head']['kernel']"] is True
    assert mask["['projector']['pre']['fc1']['bias']"] is False
    assert mask["['vision']['post']['scale']"] is False


def test_weight_decay_applies_only_to_masked_leaves():
    """With zero gradients AdamW's step is exactly -lr * wd * param on decayed leaves."""
    axes = {"w": ("layers", "embed", "mlp"), "b": ("layers", "mlp"), "s": ("embed",)}
    params = {"w": jnp.ones((2, 3, 4)), "b": jnp.ones((2, 4)), "s": jnp.ones((3,))}
    cfg = AdamWConfig(lr=0.1, warmup_steps=0, total_steps=10, weight_decay=0.5)
    opt = make_optimizer(cfg, logical_axes=axes)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = opt.update(zeros, opt.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * np.ones((2, 3, 4)), rtol=1e-6)
    np.testing.assert_array_equal(updates["b"], np.zeros((2, 4)))
    np.testing.assert_array_equal(updates["s"], np.zeros((3,)))
    # Without logical axes every leaf decays.
    updates, _ = make_optimizer(cfg).update(zeros, make_optimizer(cfg).init(params), params)
    np.testing.assert_allclose(updates["s"], -0.05 * np.ones(3), rtol=1e-6)


def test_schedule_warms_up_then_decays():
    cfg = AdamWConfig(lr=1e-2, warmup_steps=10, total_steps=100, end_lr_ratio=0.1)
    sched = learning_rate_schedule(cfg)
    lrs = np.asarray([float(sched(s)) for s in range(101)])
    assert lrs[0] == 0.0
    assert np.all(np.diff(lrs[:11]) > 0)  # linear warm-up ...
    np.testing.assert_allclose(lrs[:11], np.linspace(0, 1e-2, 11), rtol=1e-5, atol=1e-9)
    assert lrs.max() == pytest.approx(1e-2) and int(lrs.argmax()) == 10  # ... to the peak ...
    assert np.all(np.diff(lrs[10:]) < 0)  # ... then cosine decay ...
    assert lrs[100] == pytest.approx(1e-3, rel=1e-5)  # ... to end_lr_ratio * lr.
    assert lrs[55] == pytest.approx(1e-3 + 0.5 * (1e-2 - 1e-3), rel=1e-4)  # half-way


def test_schedule_short_runs_still_train():
    """A one-step run must not have lr == 0 on its only step (warm-up is cut short)."""
    sched = learning_rate_schedule(AdamWConfig(lr=1e-2, warmup_steps=5, total_steps=1))
    assert float(sched(0)) == pytest.approx(1e-2)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="lr=0.0"):
        AdamWConfig(lr=0.0)
    with pytest.raises(ValueError, match="warmup_steps >= 0"):
        AdamWConfig(warmup_steps=-1)
    with pytest.raises(ValueError, match="total_steps >= 1"):
        AdamWConfig(total_steps=0)


def _first_moment_norm(opt, grads, params):
    _, state = opt.update(grads, opt.init(params), params)
    return float(optax.global_norm(optax.tree_utils.tree_get(state, "mu")))


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e4])
def test_clipping_bounds_the_gradient(scale):
    params = {"a": jnp.zeros((3, 4)), "b": jnp.zeros((5,))}
    rng = np.random.default_rng(0)
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
    grads = jax.tree.map(lambda g: g * scale / optax.global_norm(grads), grads)  # norm = scale
    cfg = AdamWConfig(clip_norm=1.0, warmup_steps=0, b1=0.9)
    clipped = _first_moment_norm(make_optimizer(cfg), grads, params)
    # Adam's first moment after one step is (1 - b1) * (clipped gradient).
    assert clipped == pytest.approx(0.1 * min(scale, 1.0), rel=1e-5)
    unclipped = _first_moment_norm(
        make_optimizer(AdamWConfig(clip_norm=0.0, warmup_steps=0)), grads, params
    )
    assert unclipped == pytest.approx(0.1 * scale, rel=1e-5)
