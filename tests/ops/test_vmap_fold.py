"""``hetjax.ops.vmap_fold``: a function of independent rows under ``jax.vmap`` runs once
on the folded rows, and equals the function applied per replica.

The wrapped function here is a toy with the cuDNN kernels' contract: rows leading, one
argument that gets no gradient, a residual whose leading axis is a multiple of the batch
whose rows are not the batch's (cuDNN's packed statistics are ``[B M, H, L]``, numbered
by segment over the whole batch). Each part records the shapes it is
traced with, which shows where the fold ran. Values and gradients are compared with the
same maths written without the wrapper (float32, a few ulps).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from hetjax.ops.vmap_fold import folded_vjp
from tests.ops.test_ring_attention import stage_mesh

R, B, L = 2, 3, 4  # replicas, rows per replica, row length


def toy(traced: list):
    """``x * sin(s)`` row by row; the forward keeps ``sin(s)`` transposed into
    ``[2 B, L / 2]``: a residual whose rows mix the batch's (as cuDNN's packed statistics,
    numbered by segment over the whole batch, do)."""

    def primal(x, s):
        traced.append(("primal", x.shape[0]))
        return x * jnp.sin(s)

    def forward(x, s):
        traced.append(("forward", x.shape[0]))
        b, l = x.shape
        return x * jnp.sin(s), jnp.sin(s).T.reshape(2 * b, l // 2)

    def backward(res, g):
        traced.append(("backward", g.shape[0]))
        return (g * res.reshape(g.shape[::-1]).T,)

    return folded_vjp(primal, forward, backward, differentiable=1)


def reference(x, s):
    return x * jnp.sin(s)


def loss_and_grad(f):
    return jax.value_and_grad(lambda x, s, w: jnp.sum(jnp.tanh(f(x, s)) * w))


def data(*lead):
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.normal(size=(*lead, B, L)), jnp.float32) for _ in range(3)]


def assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("replicas", [1, R])
def test_folds_the_replicas_into_one_call(replicas):
    traced = []
    x, s, w = data(replicas)
    got = jax.jit(jax.vmap(loss_and_grad(toy(traced))))(x, s, w)
    assert_close(got, jax.vmap(loss_and_grad(reference))(x, s, w))
    # custom_vmap traces each part at one replica's shape; the rule then calls it once on
    # all the rows (the primal is not what a gradient runs)
    folded = {("forward", replicas * B), ("backward", replicas * B)}
    assert folded <= set(traced) <= folded | {("forward", B), ("backward", B)}


def test_nested_vmaps_fold_twice():
    traced = []
    x, s, w = data(R, R)
    got = jax.vmap(jax.vmap(loss_and_grad(toy(traced))))(x, s, w)
    assert_close(got, jax.vmap(jax.vmap(loss_and_grad(reference)))(x, s, w))
    assert ("forward", R * R * B) in traced and ("backward", R * R * B) in traced


def test_unmapped_arguments_are_broadcast():
    """Segment ids shared by the replicas (``in_axes=None``), and the primal alone."""
    traced = []
    x, s, w = data(R)
    f = toy(traced)
    grads = jax.vmap(loss_and_grad(f), in_axes=(0, None, 0))(x, s[0], w)
    assert_close(grads, jax.vmap(loss_and_grad(reference), in_axes=(0, None, 0))(x, s[0], w))
    assert_close(jax.vmap(f, in_axes=(0, None))(x, s[0]), reference(x, s[0][None]))
    assert ("primal", R * B) in traced


def test_cotangents_mapped_alone_run_per_replica():
    """A vmap over the vjp of an unmapped forward (what ``jax.jacrev`` does) maps only
    the cotangents: the backward runs once per cotangent, on the residual as the forward
    left it, never folded with copies of it (whose rows would then be misread)."""
    traced = []
    x, s, _ = data()
    gs = data(R)[0]
    vjp = jax.vjp(lambda x: toy(traced)(x, s), x)[1]
    assert_close(jax.vmap(vjp)(gs), jax.vmap(jax.vjp(lambda x: reference(x, s), x)[1])(gs))
    assert ("backward", R * B) not in traced


def test_residuals_leave_one_vmap_and_enter_another():
    """The executor's ``none`` policy: the forward program returns the vjp's residuals out
    of its replica vmap; the backward program maps over them again."""
    x, s, w = data(R)
    f = toy([])
    _, vjps = jax.jit(jax.vmap(lambda x, s: jax.vjp(lambda x: f(x, s), x)))(x, s)
    got = jax.jit(jax.vmap(lambda vjp, g: vjp(g)))(vjps, w)
    assert_close(got, jax.vjp(reference, x, s)[1](w)[:1])


def test_under_remat_policy():
    x, s, w = data(R)
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    f = toy([])
    loss = loss_and_grad(jax.checkpoint(f, policy=policy))
    assert_close(jax.jit(jax.vmap(loss))(x, s, w), jax.vmap(loss_and_grad(reference))(x, s, w))


def test_under_gspmd_and_shard_map():
    """The executor's two replica maps: ``vmap(spmd_axis_name="dp")`` on replicas split
    over dp by GSPMD, and a ``shard_map`` manual over dp with one replica per device."""
    mesh = stage_mesh(dp=R)
    x, s, w = data(R)
    f = loss_and_grad(toy([]))
    want = jax.vmap(loss_and_grad(reference))(x, s, w)
    split = NamedSharding(mesh, PartitionSpec("dp"))
    args = [jax.device_put(a, split) for a in (x, s, w)]
    assert_close(jax.jit(jax.vmap(f, spmd_axis_name="dp"))(*args), want)
    spec = PartitionSpec("dp")
    region = jax.shard_map(
        jax.vmap(f), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, axis_names={"dp"}
    )
    assert_close(jax.jit(region)(*args), want)
