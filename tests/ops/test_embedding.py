"""The explicit vocabulary-parallel lookup equals a plain ``take`` of the whole table."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetjax.ops.embedding import vocab_parallel_lookup


@pytest.mark.parametrize("shape, seq_axis", [((2, 4), None), ((2, 2, 2), "cp")])
def test_lookup_matches_take_with_gradient(shape, seq_axis):
    names = ("dp", "tp") if len(shape) == 2 else ("dp", "cp", "tp")
    mesh = Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)
    rng = np.random.default_rng(0)
    table = rng.normal(size=(16, 5)).astype(np.float32)
    ids = rng.integers(0, 16, size=(4, 8)).astype(np.int32)
    table_s = jax.device_put(table, NamedSharding(mesh, PartitionSpec("tp", None)))
    ids_s = jax.device_put(ids, NamedSharding(mesh, PartitionSpec("dp", seq_axis)))

    def f(t, i):
        return vocab_parallel_lookup(t, i, mesh=mesh, batch_axes=("dp",), seq_axis=seq_axis)

    got = jax.jit(f)(table_s, ids_s)
    np.testing.assert_array_equal(np.asarray(got), table[ids])
    w = rng.normal(size=got.shape).astype(np.float32)
    grad = jax.grad(lambda t: jnp.sum(f(t, ids_s) * w))(table_s)
    want = jax.grad(lambda t: jnp.sum(jnp.take(t, ids, axis=0) * w))(table)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_vocabulary_must_divide_by_tp():
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("dp", "tp"))
    with pytest.raises(ValueError, match="vocabulary 10 is not divisible by tp=4"):
        vocab_parallel_lookup(
            jnp.zeros((10, 3)), jnp.zeros((2, 4), jnp.int32), mesh=mesh, batch_axes=("dp",)
        )
