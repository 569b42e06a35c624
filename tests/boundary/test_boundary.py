"""The boundary op over the case matrix: values, shardings, gradients and plan bytes."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetjax.boundary import (
    Boundary,
    MultiProcessTransport,
    make_plan,
    naive_device_put_bytes,
)
from hetjax.meshes import param_shardings

from .cases import (
    CASES,
    LLM_NAMES,
    REFERENCE,
    B,
    Case,
    D,
    N,
    W1_DxH,
    W2_HxD,
    W_FxD,
    X_BxNxD,
    X_BxNxF,
    assert_grads_close,
    encode,
    llm_loss,
)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_forward_value_and_sharding(case: Case):
    edge = case.edge()
    assert (edge.placement, edge.transform) == (case.placement, case.transform)
    x = jax.device_put(X_BxNxD, edge.src.sharding)
    y = Boundary(edge)(x)
    assert y.sharding == edge.dst.sharding
    chex.assert_trees_all_equal(np.asarray(y), X_BxNxD)
    for shard in y.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), X_BxNxD[shard.index])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_plan_bytes(case: Case):
    edge = case.edge()
    for plan in (
        make_plan(edge, (B, N, D), jnp.float32),
        make_plan(edge, (B, N, D), "float32").reverse(),
    ):
        naive = naive_device_put_bytes(
            plan.edge.src.sharding, plan.edge.dst.sharding, plan.shape, plan.dtype
        )
        if case.placement == "non-colocated":
            assert plan.cross_island_bytes == plan.activation_bytes == B * N * D * 4
            assert {c.src for c in plan.copies} <= {d.id for d in plan.edge.src.devices}
            assert {c.dst for c in plan.copies} == {lane.leader for lane in plan.lanes}
        else:
            assert plan.cross_island_bytes == 0
        assert plan.cross_island_bytes <= naive


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_gradient_matches_single_device(case: Case):
    edge = case.edge()
    bnd = Boundary(edge)
    src_mesh, dst_mesh = edge.src.sharding.mesh, edge.dst.sharding.mesh
    x = jax.device_put(X_BxNxF, edge.src.sharding)
    w = jax.device_put(W_FxD, jax.sharding.NamedSharding(src_mesh, jax.sharding.PartitionSpec()))
    shardings = param_shardings(LLM_NAMES, dst_mesh)
    w1 = jax.device_put(W1_DxH, shardings["w1"])
    w2 = jax.device_put(W2_HxD, shardings["w2"])

    f = lambda w, w1, w2: llm_loss(bnd(encode(w, x)), w1, w2)
    loss, grads = jax.value_and_grad(f, argnums=(0, 1, 2))(w, w1, w2)

    ref_loss, ref_grads = REFERENCE
    chex.assert_trees_all_close(loss, ref_loss, rtol=1e-6)
    assert_grads_close(grads, ref_grads)
    assert grads[0].sharding.device_set == w.sharding.device_set
    assert grads[1].sharding.is_equivalent_to(shardings["w1"], 2)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_gradient_of_boundary_alone_is_exact(case: Case):
    """No reduction crosses devices here, so the cotangent must come back bit-exact."""
    edge = case.edge()
    bnd = Boundary(edge)
    x = jax.device_put(X_BxNxD, edge.src.sharding)
    c_BxNxD = jax.device_put(X_BxNxD[::-1] * 0.5, edge.dst.sharding)
    g = jax.grad(lambda x: jnp.sum(bnd(x) * c_BxNxD))(x)
    assert g.sharding == edge.src.sharding
    chex.assert_trees_all_equal(np.asarray(g), X_BxNxD[::-1] * 0.5)


@pytest.mark.parametrize("case", CASES[::3], ids=lambda c: c.id)
def test_multiprocess_transport_in_one_process(case: Case):
    edge = case.edge()
    bnd = Boundary(edge, MultiProcessTransport())
    x = jax.device_put(X_BxNxD, edge.src.sharding)
    y = bnd(x)
    assert y.sharding == edge.dst.sharding
    chex.assert_trees_all_equal(np.asarray(y), X_BxNxD)
    g = bnd.backward(y)
    assert g.sharding.is_equivalent_to(edge.src.sharding, 3)
    chex.assert_trees_all_equal(np.asarray(g), X_BxNxD)
