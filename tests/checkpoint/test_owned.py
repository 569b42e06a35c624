"""The ``owned`` item on its own: arrays written shard by shard (one writer per chunk),
read back into other shardings and to host, and missing or truncated chunks as errors.

In one process every array is whole here; the multi-process case (each stage's arrays
held by one process) is ``tests/distributed/test_train_multiprocess.py``.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hetjax.checkpoint import owned

SHAPE = (8, 4)


def _mesh():
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))


@pytest.fixture
def written(tmp_path):
    mesh = _mesh()
    value = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    arrays = {
        # Split over "a", replicated over "b": each chunk is written once (replica 0).
        "params/x": jax.device_put(value, NamedSharding(mesh, P("a"))),
        "opt_state/0/count": jax.device_put(np.int32(7), NamedSharding(mesh, P())),
    }
    owned.OwnedHandler().save(tmp_path, owned.OwnedSave(arrays))
    return tmp_path, value


def test_chunks_are_the_saving_shards_with_one_writer_each(written):
    directory, _ = written
    assert sorted(p.name for p in (directory / "params" / "x").iterdir()) == [
        ".zarray",
        *(f"{i}.0" for i in range(4)),
    ]
    copies = owned.host_copies(
        {"x": jax.device_put(np.zeros(SHAPE, np.float32), NamedSharding(_mesh(), P("a")))}
    )
    assert len(copies[0][4]) == 4  # of 8 shards: one per distinct slice


def test_reads_into_another_sharding_and_to_host(written):
    directory, value = written
    target = NamedSharding(_mesh(), P("b", "a"))  # another split: each device its slice
    got = owned.read(
        directory,
        {
            "params/x": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=target),
            "opt_state/0/count": np.zeros((), np.int32),
        },
    )
    assert got["params/x"].sharding == target
    np.testing.assert_array_equal(np.asarray(got["params/x"]), value)
    assert isinstance(got["opt_state/0/count"], np.ndarray) and got["opt_state/0/count"] == 7


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_damaged_chunk_is_an_error_not_zeros(written, damage):
    directory, _ = written
    chunk = directory / "params" / "x" / "2.0"
    if damage == "missing":
        chunk.unlink()
    else:
        chunk.write_bytes(chunk.read_bytes()[:5])
    target = jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=NamedSharding(_mesh(), P()))
    with pytest.raises(ValueError):
        owned.read(directory, {"params/x": target})
