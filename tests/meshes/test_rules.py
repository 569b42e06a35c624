"""Logical-axis rules: Megatron TP, batch/sequence/expert/layer splits, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from hetjax.meshes import (
    LayoutError,
    logical_to_sharding,
    logical_to_spec,
    param_shardings,
    place_modules,
)


@pytest.mark.parametrize(
    "names, stage_mesh, spec",
    [
        (("embed", "heads"), True, P("fsdp", "tp")),  # QKV: column-parallel
        (("embed", "kv_heads"), True, P("fsdp", "tp")),
        (("heads", "embed"), True, P("tp", "fsdp")),  # attention out: row-parallel
        (("embed", "mlp"), True, P("fsdp", "tp")),  # MLP up: column-parallel
        (("mlp", "embed"), True, P("tp", "fsdp")),  # MLP down: row-parallel
        (("vocab", "embed"), True, P("tp", "fsdp")),  # vocab-parallel embedding
        (("embed", "vocab"), True, P("fsdp", "tp")),  # vocab-parallel LM head
        (("layers", "embed", "mlp"), False, P("pp", "fsdp", "tp")),
        (("layers", "embed", "mlp"), True, P(None, "fsdp", "tp")),
        (("experts", "embed", "mlp"), True, P("ep", "fsdp", "tp")),
        (("batch", "seq", "act_embed"), True, P(("dp", "fsdp", "ep"), "cp", None)),
        (("batch", "seq", "act_vocab"), True, P(("dp", "fsdp", "ep"), "cp", "tp")),
        ((None, "embed"), True, P(None, "fsdp")),  # fsdp: the model width
        ((), True, P()),
    ],
)
def test_logical_to_spec(names, stage_mesh, spec):
    assert logical_to_spec(names, stage_mesh=stage_mesh) == spec


def test_unknown_name_is_an_error():
    with pytest.raises(LayoutError, match=r"logical axis name 'hidden' in \('embed', 'hidden'\)"):
        logical_to_spec(("embed", "hidden"), stage_mesh=True)


def test_two_dims_on_one_mesh_axis_is_an_error():
    with pytest.raises(LayoutError, match=r"'heads' and 'mlp' .* both map to mesh axis 'tp'"):
        logical_to_spec(("heads", "mlp"), stage_mesh=True)


def test_param_shardings_give_megatron_tp_shards():
    mm = place_modules({"llm": "dp=2,tp=4,pp=1"}, placement="colocated")["llm"]
    names = {
        "qkv": ("embed", "heads"),
        "out": ("heads", "embed"),
        "up": ("embed", "mlp"),
        "down": ("mlp", "embed"),
        "table": ("vocab", "embed"),
        "norm": ("embed",),
        "blocks": {"w": ("layers", "embed", "mlp")},
    }
    shapes = {
        "qkv": (16, 32),
        "out": (32, 16),
        "up": (16, 64),
        "down": (64, 16),
        "table": (128, 16),
        "norm": (16,),
        "blocks": {"w": (3, 16, 64)},
    }
    stage = param_shardings(names, mm.stage_mesh(0))
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(n, int) for n in x)
    shard_shapes = jax.tree.map(
        lambda s, shape: s.shard_shape(shape), stage, shapes, is_leaf=is_shape
    )
    assert shard_shapes == {
        "qkv": (16, 8),
        "out": (8, 16),
        "up": (16, 16),
        "down": (16, 16),
        "table": (32, 16),
        "norm": (16,),
        "blocks": {"w": (3, 16, 16)},
    }
    full = param_shardings(names, mm.mesh)
    assert full["blocks"]["w"].spec == P("pp", "fsdp", "tp")


def test_tp_sharded_matmul_runs_and_matches():
    mm = place_modules({"llm": "dp=2,tp=4"}, placement="colocated")["llm"]
    mesh = mm.stage_mesh(0)
    # Small integers: every summation order is exact, so the check can be bitwise.
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 4, (4, 3, 16)).astype(np.float32)
    w = rng.integers(-3, 4, (16, 32)).astype(np.float32)
    xs = jax.device_put(x, logical_to_sharding(("batch", "seq", "act_embed"), mesh))
    ws = jax.device_put(w, logical_to_sharding(("embed", "mlp"), mesh))
    y = jax.jit(jnp.matmul)(xs, ws)
    np.testing.assert_array_equal(np.asarray(y), x @ w)
    assert ws.addressable_shards[0].data.shape == (16, 8)
