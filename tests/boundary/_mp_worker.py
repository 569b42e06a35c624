"""One process of the multi-process boundary test (spawned by test_multiprocess.py).

Usage: python -m tests.boundary._mp_worker PROCESS_ID COORDINATOR OUT_DIR

Two processes with 4 CPU devices each: process 0 owns the encoder island (devices 0-3),
process 1 the LLM island (devices 4-7). Both run the SAME program in the same order;
jitted programs whose devices all live on the other process do nothing here, and the
boundary's collective permute runs on both. Each process saves what it owns to
OUT_DIR/p{PROCESS_ID}.npz: the shards of its forward values and gradients, for the test
to reassemble and compare with a single-device run.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hetjax.boundary import Boundary, EdgeSpec, Endpoint, MultiProcessTransport
from hetjax.meshes import param_shardings, place_modules

# (name, encoder layout, LLM layout, placement, islands, destination tokens over cp)
CASES = (
    ("fan_in", "dp=4", "dp=2,tp=2", "non-colocated", None, False),
    ("dp_equal_cp", "dp=2,tp=2", "dp=2,cp=2", "non-colocated", None, True),
    ("fan_out_stage", "dp=2,pp=2", "dp=4", "non-colocated", None, False),
    ("non_dividing_stage", "dp=3", "dp=2,pp=2", "non-colocated", {"enc": 0, "llm": 4}, False),
    ("colocated_fan_in", "dp=8", "dp=2,tp=4", "colocated", None, False),
)
B, N, D, F, H = 24, 6, 8, 5, 12


def inputs() -> dict[str, np.ndarray]:
    """The same arrays in every process and in the test (seeded)."""
    rng = np.random.default_rng(1)
    return dict(
        x=rng.standard_normal((B, N, F)).astype(np.float32),
        w=(rng.standard_normal((F, D)) / np.sqrt(F)).astype(np.float32),
        w1=(rng.standard_normal((D, H)) / np.sqrt(D)).astype(np.float32),
        w2=(rng.standard_normal((H, D)) / np.sqrt(H)).astype(np.float32),
    )


@jax.jit
def encode(w_FxD, x_BxNxF):
    return jnp.tanh(x_BxNxF @ w_FxD)


@jax.jit
def llm_loss(y_BxNxD, w1_DxH, w2_HxD):
    return jnp.mean((jnp.tanh(y_BxNxD @ w1_DxH) @ w2_HxD) ** 2)


def put(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a value every process knows; only local shards are built."""
    return jax.make_array_from_callback(
        value.shape, sharding, lambda index: value[index], dtype=value.dtype
    )


def save_shards(out: dict[str, np.ndarray], key: str, x: jax.Array) -> None:
    """Stores this process's shards of ``x`` with their [start, stop) index per dim."""
    for shard in x.addressable_shards:
        bounds = [s.indices(n)[:2] for s, n in zip(shard.index, x.shape, strict=True)]
        out[f"{key}@{shard.device.id}"] = np.asarray(shard.data)
        out[f"{key}@{shard.device.id}:index"] = np.array(bounds, np.int64).reshape(-1, 2)


def run_case(case, data, out: dict[str, np.ndarray]) -> None:
    name, enc, llm, placement, islands, shard_tokens = case
    meshes = place_modules({"enc": enc, "llm": llm}, placement=placement, islands=islands)
    edge = EdgeSpec(
        Endpoint.source(meshes["enc"]),
        Endpoint.destination(meshes["llm"], shard_tokens=shard_tokens),
    )
    bnd = Boundary(edge, MultiProcessTransport())
    llm_shardings = param_shardings(
        {"w1": ("embed", "mlp"), "w2": ("mlp", "embed")}, edge.dst.sharding.mesh
    )
    x = put(data["x"], edge.src.sharding)
    w = put(data["w"], NamedSharding(edge.src.sharding.mesh, P()))
    w1 = put(data["w1"], llm_shardings["w1"])
    w2 = put(data["w2"], llm_shardings["w2"])

    # Every process walks the same sequence: encoder, boundary, LLM, and back.
    y_src, enc_vjp = jax.vjp(encode, w, x)
    y_dst, bnd_vjp = jax.vjp(bnd, y_src)
    loss, llm_vjp = jax.vjp(llm_loss, y_dst, w1, w2)
    seed = put(np.ones((), np.float32), loss.sharding)
    g_y_dst, g_w1, g_w2 = llm_vjp(seed)
    (g_y_src,) = bnd_vjp(g_y_dst)
    g_w, _ = enc_vjp(g_y_src)

    assert y_dst.sharding == edge.dst.sharding, (name, y_dst.sharding)
    assert g_y_src.sharding.is_equivalent_to(edge.src.sharding, 3), (name, g_y_src.sharding)
    for key, value in dict(
        y=y_dst, loss=loss, g_w=g_w, g_w1=g_w1, g_w2=g_w2, g_y_src=g_y_src
    ).items():
        save_shards(out, f"{name}/{key}", value)


def main() -> None:
    process_id, coordinator, out_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    # Importing this module (as the test does for CASES) must not touch the backend, so
    # the configuration happens here, before the first JAX operation.
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", 4)
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=2, process_id=process_id
    )
    assert jax.process_count() == 2 and len(jax.devices()) == 8, jax.devices()
    data = inputs()
    out: dict[str, np.ndarray] = {}
    for case in CASES:
        run_case(case, data, out)
    np.savez(os.path.join(out_dir, f"p{process_id}.npz"), **out)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
