"""Mixture of experts: expert-parallel all-to-all against the dense GShard einsum, and both
against a float64 numpy loop (routing, renormalised gates, capacity, drops, aux loss).

Shape key: B batch, L sequence, D width, F expert width, E experts, T tokens.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetjax.meshes.rules import param_shardings
from hetjax.modules import StagedModule
from hetjax.ops import MoEFFN, expert_capacity, moe_ffn

RTOL, ATOL = 1e-5, 1e-6
AXES = ("dp", "ep", "cp", "tp")
B, L, D, F, E = 8, 8, 16, 32, 8


def stage_mesh(dp=1, ep=1, cp=1, tp=1) -> Mesh:
    n = dp * ep * cp * tp
    return Mesh(np.array(jax.devices()[:n]).reshape(dp, ep, cp, tp), AXES)


def make_params(seed=0):
    """Router std 1 so routing is decisive (no near-ties between layouts); experts std 0.1
    so outputs and gradients are of order 1 and atol 1e-6 is a few ulps of their scale
    (layouts sum a parameter's per-token gradient contributions in different orders)."""
    k = jax.random.split(jax.random.key(seed), 4)
    normal = lambda key, shape, std: std * jax.random.normal(key, shape, jnp.float32)
    return {
        "router": normal(k[0], (D, E), 1.0),
        "gate": normal(k[1], (E, D, F), 0.1),
        "up": normal(k[2], (E, D, F), 0.1),
        "down": normal(k[3], (E, F, D), 0.1),
    }


def make_x(seed=1):
    return jax.random.normal(jax.random.key(seed), (B, L, D), jnp.float32)


def numpy_moe(params, x_BxLxD, *, top_k, capacity_factor, renormalize, groups=None):
    """Float64 loop over (slot, token) in GShard priority order within each token group.

    ``groups``: lists of flat token ids, one per rank that routes its own tokens (capacity
    is per group); default one group of all tokens.
    """
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x = np.asarray(x_BxLxD, np.float64).reshape(-1, D)
    t = x.shape[0]
    logits = x @ p["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    choice = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    gates = np.take_along_axis(probs, choice, -1)
    if renormalize:
        gates /= gates.sum(-1, keepdims=True)

    def expert(e, xt):
        h = xt @ p["gate"][e]
        return ((h / (1 + np.exp(-h))) * (xt @ p["up"][e])) @ p["down"][e]

    y = np.zeros_like(x)
    dropped = np.zeros((t, top_k), bool)
    for group in groups or [list(range(t))]:
        cap = expert_capacity(len(group), E, top_k, capacity_factor)
        fill = np.zeros(E, int)
        for slot in range(top_k):
            for tok in group:
                e = choice[tok, slot]
                if fill[e] < cap:
                    y[tok] += gates[tok, slot] * expert(e, x[tok])
                else:
                    dropped[tok, slot] = True
                fill[e] += 1
    frac = np.bincount(choice.ravel(), minlength=E) / (t * top_k)
    aux = E * np.sum(frac * probs.mean(0))
    return y.reshape(x_BxLxD.shape), aux, dropped


def rank_groups(dp, ep, cp):
    """Flat token ids held by each rank when batch is split over (dp, ep) and seq over cp."""
    ids = np.arange(B * L).reshape(B, L)
    return [
        blk.ravel().tolist()
        for bblk in np.split(ids, dp * ep, axis=0)
        for blk in np.split(bblk, cp, axis=1)
    ]


@functools.cache
def value_and_grads(top_k, capacity_factor, mesh):
    """Jitted ``(y, aux, grads of sum(sin(y) * w) + aux w.r.t. (params, x))``."""
    w = np.random.default_rng(9).normal(size=(B, L, D)).astype(np.float32)

    def loss(params, x):
        y, aux = moe_ffn(params, x, top_k=top_k, capacity_factor=capacity_factor, mesh=mesh)
        return jnp.sum(jnp.sin(y) * w) + aux, (y, aux)

    @jax.jit
    def f(params, x):
        grads, (y, aux) = jax.grad(loss, argnums=(0, 1), has_aux=True)(params, x)
        return y, aux, grads

    return f


# -- single device against numpy --------------------------------------------------------


def test_expert_capacity():
    assert expert_capacity(64, 8, 1, None) == 64
    assert expert_capacity(64, 8, 1, 1.0) == 8
    assert expert_capacity(64, 8, 2, 1.25) == 20
    assert expert_capacity(10, 8, 1, 1.0) == 2  # ceil
    assert expert_capacity(4, 2, 2, 100.0) == 4  # never above T
    with pytest.raises(ValueError, match="capacity_factor"):
        expert_capacity(4, 2, 1, 0.0)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("capacity_factor", [None, 1.0, 0.5])
def test_dense_matches_numpy(top_k, capacity_factor):
    params, x = make_params(), make_x()
    y, aux = jax.jit(lambda p, x: moe_ffn(p, x, top_k=top_k, capacity_factor=capacity_factor))(
        params, x
    )
    want_y, want_aux, dropped = numpy_moe(
        params, x, top_k=top_k, capacity_factor=capacity_factor, renormalize=top_k > 1
    )
    np.testing.assert_allclose(y, want_y, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(aux, want_aux, rtol=RTOL)
    assert dropped.any() == (capacity_factor is not None)


def test_aux_loss_small_case_by_hand():
    """Two experts, four tokens: the router is the identity on the first two features."""
    params = {
        "router": jnp.eye(2, dtype=jnp.float32),
        "gate": jnp.zeros((2, 2, 3)),
        "up": jnp.zeros((2, 2, 3)),
        "down": jnp.zeros((2, 3, 2)),
    }
    x = jnp.asarray([[[2.0, 0.0], [0.0, 1.0], [3.0, 0.0], [1.0, 0.5]]])
    dropless_top1 = jax.jit(lambda p, x: moe_ffn(p, x, top_k=1, capacity_factor=None))
    _, aux = dropless_top1(params, x)
    logits = np.asarray(x[0], np.float64)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    frac = np.array([3, 1]) / 4  # tokens 0, 2, 3 pick expert 0
    np.testing.assert_allclose(aux, 2 * np.sum(frac * probs.mean(0)), rtol=1e-6)
    # A uniform router gives exactly 1.
    _, aux = dropless_top1({**params, "router": jnp.zeros((2, 2))}, x)
    np.testing.assert_allclose(aux, 1.0, rtol=1e-6)


def test_top2_drops_second_choices_first():
    """With room for only half the assignments, first choices take every slot they can."""
    params, x = make_params(), make_x()
    *_, dropped = numpy_moe(params, x, top_k=2, capacity_factor=0.5, renormalize=True)
    assert dropped[:, 1].sum() > dropped[:, 0].sum()
    y, _ = jax.jit(lambda p, x: moe_ffn(p, x, top_k=2, capacity_factor=0.5))(params, x)
    fully_dropped = dropped.all(axis=1).reshape(B, L)
    np.testing.assert_array_equal(np.all(np.asarray(y) == 0, axis=-1), fully_dropped)


def test_top1_gate_is_the_probability_unless_renormalised():
    params, x = make_params(), make_x()
    y_raw, _ = value_and_grads(1, None, None)(params, x)[:2]
    y_one, _ = jax.jit(lambda p, x: moe_ffn(p, x, top_k=1, capacity_factor=None, renormalize=True))(
        params, x
    )
    want, *_ = numpy_moe(params, x, top_k=1, capacity_factor=None, renormalize=True)
    np.testing.assert_allclose(y_one, want, rtol=RTOL, atol=ATOL)
    assert not np.allclose(y_raw, y_one)


# -- expert parallelism against the dense path ------------------------------------------


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize(
    "layout",
    [dict(ep=1, dp=2), dict(ep=2), dict(ep=4), dict(ep=2, dp=2, cp=2), dict(ep=4, tp=2)],
    ids=str,
)
def test_dropless_ep_matches_dense(layout, top_k):
    params, x = make_params(), make_x()
    mesh = stage_mesh(**layout)
    y, aux, grads = value_and_grads(top_k, None, mesh)(params, x)
    want_y, want_aux, want_grads = value_and_grads(top_k, None, None)(params, x)
    np.testing.assert_allclose(y, want_y, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(aux, want_aux, rtol=RTOL, atol=ATOL)
    got = jax.tree_util.tree_flatten_with_path(grads)[0]
    for (path, g), w in zip(got, jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=jax.tree_util.keystr(path))
    if layout["ep"] > 1:
        spec = PartitionSpec(("dp", "ep"), "cp", None)
        assert y.sharding.is_equivalent_to(NamedSharding(mesh, spec), 3)


def test_under_replica_vmap():
    """The executor's per-replica backward: ``vmap(grad(...), spmd_axis_name="dp")`` with
    each replica's tokens split over ``ep``; parameter gradients summed over replicas."""
    params, x = make_params(), make_x()
    mesh = stage_mesh(dp=2, ep=2, cp=2)

    def loss(params, x, mesh, batch_axes):
        y, _ = moe_ffn(params, x, top_k=2, capacity_factor=None, mesh=mesh, batch_axes=batch_axes)
        return jnp.sum(jnp.sin(y)), y

    per_replica = jax.grad(functools.partial(loss, mesh=mesh, batch_axes=("ep",)), has_aux=True)
    replicas = x.reshape(2, B // 2, L, D)
    grads, y = jax.jit(
        lambda p, x: jax.vmap(per_replica, in_axes=(None, 0), spmd_axis_name="dp")(p, x)
    )(params, replicas)
    dense = jax.grad(functools.partial(loss, mesh=None, batch_axes=None), has_aux=True)
    want_grads, want_y = jax.jit(dense)(params, x)
    np.testing.assert_allclose(y.reshape(want_y.shape), want_y, rtol=RTOL, atol=ATOL)
    for name, g in grads.items():
        np.testing.assert_allclose(g.sum(0), want_grads[name], rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("top_k", [1, 2])
def test_capacity_is_per_rank_with_ep(top_k):
    """Drops follow a per-rank capacity; dropped tokens get exactly zero, the rest finite."""
    layout = dict(dp=2, ep=2, cp=2)
    params, x = make_params(), make_x()
    y, aux = jax.jit(
        lambda p, x: moe_ffn(p, x, top_k=top_k, capacity_factor=1.0, mesh=stage_mesh(**layout))
    )(params, x)
    assert np.all(np.isfinite(y)) and np.isfinite(aux)
    want_y, want_aux, dropped = numpy_moe(
        params,
        x,
        top_k=top_k,
        capacity_factor=1.0,
        renormalize=top_k > 1,
        groups=rank_groups(**layout),
    )
    assert dropped.any()
    np.testing.assert_allclose(y, want_y, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(aux, want_aux, rtol=RTOL)  # routing stats ignore capacity
    if top_k == 1:
        zero_rows = np.all(np.asarray(y) == 0, axis=-1)
        np.testing.assert_array_equal(zero_rows, dropped[:, 0].reshape(B, L))
    # The global-capacity (no-mesh) run drops a different set of tokens.
    *_, dense_dropped = numpy_moe(
        params, x, top_k=top_k, capacity_factor=1.0, renormalize=top_k > 1
    )
    assert not np.array_equal(dropped, dense_dropped)


def test_hlo_has_all_to_all_only_with_ep():
    params, x = make_params(), make_x()

    def text(mesh):
        f = lambda p, x: moe_ffn(p, x, top_k=2, capacity_factor=1.25, mesh=mesh)
        return jax.jit(f).lower(params, x).compile().as_text()

    assert text(stage_mesh(ep=4, dp=2)).count("all-to-all(") >= 2
    assert "all-to-all" not in text(stage_mesh(dp=8))


def test_errors_name_the_problem():
    params, x = make_params(), make_x()
    with pytest.raises(ValueError, match="top_k=3"):
        moe_ffn(params, x, top_k=3, capacity_factor=None)
    six = {k: (v[:, :6] if k == "router" else v[:6]) for k, v in params.items()}
    with pytest.raises(ValueError, match="experts 6 over ep=4"):
        moe_ffn(six, x, top_k=1, capacity_factor=None, mesh=stage_mesh(ep=4))
    with pytest.raises(ValueError, match="batch_axes"):
        moe_ffn(params, x, top_k=1, capacity_factor=None, mesh=stage_mesh(ep=2), batch_axes=("dp",))
    with pytest.raises(ValueError, match="batch 3 over"):
        moe_ffn(params, x[:3], top_k=1, capacity_factor=None, mesh=stage_mesh(ep=2, dp=2))


# -- NNX wrapper ------------------------------------------------------------------------


def test_module_axes_and_staged_use():
    module = StagedModule(
        "moe",
        pre=lambda rngs: MoEFFN(D, F, E, top_k=2, capacity_factor=None, rngs=rngs),
    )
    axes = module.logical_axes()["pre"]
    assert axes == {
        "router": ("embed", None),
        "gate": ("experts", "embed", "mlp"),
        "up": ("experts", "embed", "mlp"),
        "down": ("experts", "mlp", "embed"),
    }
    mesh = stage_mesh(ep=4, tp=2)
    shardings = param_shardings(axes, mesh)
    assert shardings["down"].spec == PartitionSpec("ep", "tp", None)
    params = jax.device_put(module.init(jax.random.key(0)), {"pre": shardings})
    x = make_x()
    y, aux = jax.jit(lambda p, x: module.apply_pre(p["pre"], x, mesh=mesh))(params, x)
    want_y, want_aux = value_and_grads(2, None, None)(params["pre"], x)[:2]
    np.testing.assert_allclose(y, want_y, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(aux, want_aux, rtol=RTOL)
    assert y.shape == x.shape and math.isfinite(float(aux))
