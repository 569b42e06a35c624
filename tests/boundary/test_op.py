"""The custom_vjp op beyond the case matrix: one-jit colocated use, errors, odd layouts."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hetjax.boundary import (
    Boundary,
    BoundaryError,
    EdgeSpec,
    Endpoint,
    InProcessTransport,
    MultiProcessTransport,
    Transport,
    boundary,
)
from hetjax.meshes import param_shardings, place_modules

from .cases import (
    LLM_NAMES,
    REFERENCE,
    W1_DxH,
    W2_HxD,
    W_FxD,
    X_BxNxD,
    X_BxNxF,
    assert_grads_close,
    encode,
    llm_loss,
)


def _meshes(enc: str, llm: str, placement: str):
    return place_modules({"enc": enc, "llm": llm}, placement=placement)


def test_transports_satisfy_the_protocol():
    assert isinstance(InProcessTransport(), Transport)
    assert isinstance(MultiProcessTransport(), Transport)


def test_colocated_boundary_inside_one_jit_with_grad():
    meshes = _meshes("dp=8", "dp=2,tp=4", "colocated")
    edge = EdgeSpec(Endpoint.source(meshes["enc"]), Endpoint.destination(meshes["llm"]))
    bnd = Boundary(edge)
    llm_mesh = meshes["llm"].stage_mesh(0)
    shardings = param_shardings(LLM_NAMES, llm_mesh)
    x = jax.device_put(X_BxNxF, edge.src.sharding)
    w = jax.device_put(W_FxD, NamedSharding(edge.src.sharding.mesh, P()))
    w1 = jax.device_put(W1_DxH, shardings["w1"])
    w2 = jax.device_put(W2_HxD, shardings["w2"])

    @jax.jit
    def step(w, w1, w2, x):
        f = lambda w, w1, w2: llm_loss(bnd(encode(w, x)), w1, w2)
        return jax.value_and_grad(f, argnums=(0, 1, 2))(w, w1, w2)

    loss, grads = step(w, w1, w2, x)
    chex.assert_trees_all_close(loss, REFERENCE[0], rtol=1e-6)
    assert_grads_close(grads, REFERENCE[1])
    # The forward transform is a Fan-In all-gather among the shared devices.
    assert "all-gather" in step.lower(w, w1, w2, x).compile().as_text()


def test_copy_boundary_inside_jit_is_a_clear_error():
    meshes = _meshes("dp=2", "dp=2,tp=2", "non-colocated")
    edge = EdgeSpec(Endpoint.source(meshes["enc"]), Endpoint.destination(meshes["llm"]))
    x = jax.device_put(X_BxNxD, edge.src.sharding)
    with pytest.raises(BoundaryError, match="cannot run inside jit"):
        jax.jit(Boundary(edge))(x)


def test_input_on_wrong_devices_is_a_clear_error():
    meshes = _meshes("dp=2", "dp=2,tp=2", "non-colocated")
    edge = EdgeSpec(Endpoint.source(meshes["enc"]), Endpoint.destination(meshes["llm"]))
    x = jax.device_put(X_BxNxD, edge.dst.sharding)
    with pytest.raises(BoundaryError, match=r"input lives on devices \[2, 3, 4, 5\]"):
        Boundary(edge)(x)


def test_input_in_another_layout_on_the_source_devices_is_resharded():
    meshes = _meshes("dp=2,tp=2", "dp=4", "non-colocated")
    edge = EdgeSpec(Endpoint.source(meshes["enc"]), Endpoint.destination(meshes["llm"]))
    x = jax.device_put(X_BxNxD, NamedSharding(edge.src.sharding.mesh, P(None, None, "tp")))
    y = boundary(x, edge)
    assert y.sharding == edge.dst.sharding
    chex.assert_trees_all_equal(np.asarray(y), X_BxNxD)


@pytest.mark.parametrize("transport", [InProcessTransport(), MultiProcessTransport()], ids=repr)
def test_source_split_over_batch_and_tokens(transport):
    # Source blocks are cut along two dims; the one destination lane joins all four.
    meshes = _meshes("dp=2,cp=2", "dp=1,tp=2", "non-colocated")
    src = Endpoint.of(meshes["enc"], P(("dp", "ep"), "cp"), stage=-1)
    edge = EdgeSpec(src, Endpoint.destination(meshes["llm"]))
    x = jax.device_put(X_BxNxD, edge.src.sharding)
    bnd = Boundary(edge, transport)
    y = bnd(x)
    chex.assert_trees_all_equal(np.asarray(y), X_BxNxD)
    g = bnd.backward(y)
    assert g.sharding == edge.src.sharding
    chex.assert_trees_all_equal(np.asarray(g), X_BxNxD)


def test_expert_parallel_destination_and_bfloat16():
    meshes = _meshes("dp=2", "dp=4,ep=2", "non-colocated")
    edge = EdgeSpec(Endpoint.source(meshes["enc"]), Endpoint.destination(meshes["llm"]))
    assert edge.transform == "fan_out" and edge.dst.batch_lanes == 4
    x_bf16 = jnp.asarray(X_BxNxD, jnp.bfloat16)
    y = Boundary(edge)(jax.device_put(x_bf16, edge.src.sharding))
    assert y.dtype == jnp.bfloat16 and y.sharding == edge.dst.sharding
    chex.assert_trees_all_equal(y, x_bf16)


def test_colocated_pipelined_encoder_to_first_llm_stage():
    # Colocated on 8 devices, but the encoder's last stage (devices 4-7) and the LLM's
    # first stage (devices 0-3) are disjoint: explicit copies inside the shared island.
    meshes = _meshes("dp=2,tp=2,pp=2", "dp=2,tp=2,pp=2", "colocated")
    edge = EdgeSpec(Endpoint.source(meshes["enc"]), Endpoint.destination(meshes["llm"]))
    bnd = Boundary(edge)
    plan = bnd.plan(X_BxNxD.shape, jnp.float32)
    assert plan.mode == "copies" and plan.cross_island_bytes == 0
    assert plan.local_collective_bytes == 2 * plan.activation_bytes  # each tp replica
    x = jax.device_put(X_BxNxD, edge.src.sharding)
    y = bnd(x)
    assert y.sharding == edge.dst.sharding
    chex.assert_trees_all_equal(np.asarray(y), X_BxNxD)
    g = jax.grad(lambda x: jnp.sum(bnd(x) ** 2))(x)
    assert g.sharding == edge.src.sharding
    chex.assert_trees_all_equal(np.asarray(g), 2 * X_BxNxD)
