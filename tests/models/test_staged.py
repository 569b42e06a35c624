"""StagedModule on the real models: stage slicing, logical axes, abstract shapes, counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hetjax.modules import StagedModule
from models.config import PRESETS, get_preset
from models.layers import Dense
from models.mllm import MLLM


@pytest.fixture(scope="module")
def tiny():
    model = MLLM(get_preset("tiny"))
    return model, model.init(jax.random.key(0))


def _is_axes(x):
    return isinstance(x, tuple)


@pytest.mark.parametrize(("name", "k"), [("vision", 2), ("llm", 1), ("llm", 2)])
def test_blocks_split_into_stages_equal_all_blocks(tiny, name, k):
    model, params = tiny
    module = model.modules[name]
    blocks = params[name]["blocks"]
    depth = module.num_layers
    width = model.config.vision.width if name == "vision" else model.config.llm.width
    h0 = jnp.asarray(np.random.default_rng(0).normal(size=(2, 16, width)), jnp.float32)

    def run(p, h, start, stop):
        return module.apply_blocks(p, h, start=start, stop=stop)

    whole = np.asarray(run(blocks, h0, 0, depth))
    # The full stack, sliced inside apply_blocks ...
    h = run(blocks, h0, 0, k)
    assert not np.allclose(np.asarray(h), whole)
    split = np.asarray(run(blocks, h, k, depth))
    np.testing.assert_array_equal(split, whole)  # the same per-layer program: bitwise
    # ... and pre-sliced stage parameters, as a pipeline stage holds them.
    first = jax.tree.map(lambda a: a[:k], blocks)
    rest = jax.tree.map(lambda a: a[k:], blocks)
    staged = np.asarray(run(rest, run(first, h0, 0, k), k, depth))
    np.testing.assert_array_equal(staged, whole)


def test_apply_blocks_rejects_wrong_depth(tiny):
    model, params = tiny
    llm = model.modules["llm"]
    three = jax.tree.map(lambda a: a[:3], params["llm"]["blocks"])
    h = jnp.zeros((1, 4, model.config.llm.width))
    with pytest.raises(ValueError, match=r"hold 3 layers, range \[0, 2\) needs 2"):
        llm.apply_blocks(three, h, start=0, stop=2)


def test_logical_axes_tree_matches_params(tiny):
    model, params = tiny
    for name, module in model.modules.items():
        axes = module.logical_axes()
        p = params[name]
        assert jax.tree.structure(axes, is_leaf=_is_axes) == jax.tree.structure(p)
        for leaf_axes, leaf in zip(
            jax.tree.leaves(axes, is_leaf=_is_axes), jax.tree.leaves(p), strict=True
        ):
            assert len(leaf_axes) == leaf.ndim
        if "blocks" in p:
            for leaf_axes, leaf in zip(
                jax.tree.leaves(axes["blocks"], is_leaf=_is_axes),
                jax.tree.leaves(p["blocks"]),
                strict=True,
            ):
                assert leaf_axes[0] == "layers"
                assert "layers" not in leaf_axes[1:]
                assert leaf.shape[0] == module.num_layers
        for part in ("pre", "post"):
            for leaf_axes in jax.tree.leaves(axes.get(part, {}), is_leaf=_is_axes):
                assert "layers" not in leaf_axes


def test_abstract_params_match_init(tiny):
    model, params = tiny
    for name, module in model.modules.items():
        abstract = module.abstract_params()
        assert jax.tree.structure(abstract) == jax.tree.structure(params[name])
        for a, p in zip(jax.tree.leaves(abstract), jax.tree.leaves(params[name]), strict=True):
            assert isinstance(a, jax.ShapeDtypeStruct)
            assert (a.shape, a.dtype) == (p.shape, p.dtype)


def test_init_is_deterministic_and_layers_differ(tiny):
    model, params = tiny
    llm = model.modules["llm"]
    again = llm.init(jax.random.fold_in(jax.random.key(0), 4))  # MLLM.init's key for "llm"
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params["llm"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    q = np.asarray(params["llm"]["blocks"]["qkv"]["kernel"])
    assert not np.array_equal(q[0], q[1])


@pytest.mark.parametrize("preset", ["tiny", "tiny-av", "small"])
def test_num_params_matches_config(preset):
    cfg = PRESETS[preset]
    model = MLLM(cfg)  # builds abstract shapes only; nothing is allocated
    expected = cfg.num_params()
    counted = model.num_params()
    assert counted == {k: v for k, v in expected.items() if k != "total"}
    assert sum(counted.values()) == expected["total"]
    for name, module in model.modules.items():
        size = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(module.abstract_params()))
        assert size == counted[name]


def test_num_params_of_initialised_tiny(tiny):
    model, params = tiny
    for name, p in params.items():
        assert sum(x.size for x in jax.tree.leaves(p)) == model.config.num_params()[name]


def _dense(rngs):
    return Dense(4, 4, axes=("embed", "mlp"), rngs=rngs)


def test_bad_construction_raises():
    with pytest.raises(ValueError, match="num_layers=0 but block is given"):
        StagedModule("m", block=_dense)
    with pytest.raises(ValueError, match="num_layers=2 but block is missing"):
        StagedModule("m", pre=_dense, num_layers=2)


def test_axes_of_wrong_length_raise():
    class Bad(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jnp.zeros((2, 3)), axes=("embed",))

    with pytest.raises(ValueError, match="one logical name"):
        StagedModule("bad", pre=Bad)


def test_module_without_blocks_passes_through():
    m = StagedModule("proj", pre=_dense)
    params = m.init(jax.random.key(0))
    assert set(params) == {"pre"} and m.num_params() == 4 * 4
    x = jnp.ones((1, 4))
    np.testing.assert_array_equal(m.apply_blocks({}, x), x)
    np.testing.assert_allclose(m(params, x), x @ params["pre"]["kernel"], rtol=1e-6)


def test_unrolled_blocks_compute_the_same_without_a_loop(tiny):
    """``unroll=True``: the same blocks with no ``while`` loop in the program; the module's
    default stays a loop over the layers."""
    model, params = tiny
    llm, blocks = model.modules["llm"], params["llm"]["blocks"]
    x = jax.random.normal(jax.random.key(1), (2, 8, model.config.llm.width))

    def run(unroll):
        fn = jax.jit(lambda b, x: llm.apply_blocks(b, x, unroll=unroll))
        return fn(blocks, x), fn.lower(blocks, x).compile().as_text()

    (scanned, loop), (unrolled, flat) = run(None), run(True)
    np.testing.assert_allclose(unrolled, scanned, rtol=1e-6, atol=1e-6)
    assert llm.unroll == 1 and " while(" in loop and " while(" not in flat
    whole = llm.with_unroll(True)
    assert whole.unroll is True and llm.unroll == 1 and whole._defs is llm._defs
    got = jax.jit(lambda b, x: whole.apply_blocks(b, x))(blocks, x)
    np.testing.assert_allclose(got, scanned, rtol=1e-6, atol=1e-6)
