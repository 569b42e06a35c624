"""Frozen parts held in the compute dtype (``ParallelOptions.frozen_dtype``).

A bf16 tiny model with the vision encoder frozen, trained by two executors of one layout:
one holding the encoder's matrices in bfloat16 (no float32 master, no gradient, no
optimizer state), one holding float32 masters that every use casts to bfloat16. The
forward and backward read the same bf16 values, so the losses, norms and trained
parameters are bit-identical, with fewer parameter bytes on every device. Then the
checkpoint: the bf16 leaves are saved as they are held and restore into either executor
(cast by the restore), and a checkpoint with other trained parts is refused in one line.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hetjax
from hetjax.checkpoint import Checkpointer, CheckpointError
from hetjax.checkpoint import restore as restore_checkpoint
from hetjax.checkpoint import save as save_checkpoint
from hetjax.runtime.state import stored_params
from models.config import get_preset
from models.data import SyntheticConfig, SyntheticLlava
from models.mllm import MLLM
from tests.runtime.parity import OPTIMIZER

FREEZE = ("vision",)  # the encoder; its projector trains
LAYOUTS = {"vision": "dp=4", "llm": "dp=2,tp=2"}
STEPS = 2


@functools.cache
def bf16_model() -> tuple[MLLM, dict, list]:
    cfg = get_preset("tiny")
    model = MLLM(cfg, dtype=jnp.bfloat16)
    data = SyntheticLlava(SyntheticConfig.for_model(cfg, seq_len=cfg.seq_len, seed=0))
    return model, model.init(jax.random.key(0)), [data.batch(s, 8) for s in range(STEPS)]


def executor(frozen_dtype, freeze=FREEZE, params=True) -> hetjax.Executor:
    model, init, _ = bf16_model()
    layouts = {k: hetjax.Layout.parse(v, module=k) for k, v in LAYOUTS.items()}
    plan = hetjax.plan_run(
        model.train_graph(layouts, freeze=freeze),
        num_devices=8,
        mode="non-colocated",
        islands={"vision": 4, "llm": 4},
    )
    return hetjax.Executor(
        plan,
        init if params else None,
        devices=jax.devices(),
        optimizer=OPTIMIZER,
        options=hetjax.ParallelOptions(frozen_dtype=frozen_dtype),
    )


@pytest.fixture(scope="module")
def runs():
    """(executor, metrics per step) holding frozen matrices in bf16, then in float32."""
    out = []
    for dtype in ("bfloat16", None):
        ex = executor(dtype)
        out.append((ex, [jax.device_get(ex.step(b)) for b in bf16_model()[2]]))
    return out


def bytes_per_device(ex: hetjax.Executor) -> dict:
    """Parameter + optimizer-state bytes held on each device."""
    held: dict = {}
    for a in jax.tree.leaves((ex.state.params, ex.state.opt_state)):
        for shard in a.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


def test_frozen_matrices_are_held_in_the_compute_dtype():
    model, _, _ = bf16_model()
    vit = model.modules["vision"]
    stored = stored_params(
        {"vision": vit.abstract_params()},
        {"vision": vit.logical_axes()},
        {"vision"},
        "bfloat16",
    )["vision"]
    dtypes = {jax.tree_util.keystr(k): a.dtype for k, a in jax.tree.leaves_with_path(stored)}
    assert dtypes["['blocks']['qkv']['kernel']"] == jnp.bfloat16
    assert dtypes["['pre']['pos']"] == jnp.bfloat16  # a [N, D] table, cast where it is read
    # Vectors stay float32: the norms multiply their scales in float32.
    assert dtypes["['blocks']['norm1']['scale']"] == jnp.float32
    assert dtypes["['blocks']['up']['bias']"] == jnp.float32
    # Trained parts, and float32 runs, keep float32 masters.
    assert (
        stored_params({"v": vit.abstract_params()}, {"v": vit.logical_axes()}, (), "bfloat16")["v"]
        is vit.abstract_params()
    )
    assert stored_params({"v": 1}, {"v": 1}, {"v"}, "float32") == {"v": 1}


def test_moe_router_stays_float32():
    moe = MLLM(get_preset("tiny-moe"), dtype=jnp.bfloat16).modules["llm"]
    stored = stored_params(
        {"llm": moe.abstract_params()}, {"llm": moe.logical_axes()}, {"llm"}, "bfloat16"
    )["llm"]["blocks"]["moe"]["ffn"]
    assert stored["router"].dtype == jnp.float32  # hetjax.ops.moe routes in float32
    assert stored["gate"].dtype == jnp.bfloat16


def test_bf16_frozen_encoder_trains_bit_identically_with_fewer_bytes(runs):
    (held, got), (master, want) = runs
    after, ref = held.full_params(), master.full_params()
    for a, b in zip(got, want, strict=True):
        assert set(a) == set(b)
        for k in set(a) - {"param_norm/vision"}:
            assert a[k] == b[k], k  # bit-identical losses and norms
        # The frozen encoder's norm is that of the values held: the bf16 ones.
        held_norm = np.sqrt(
            sum(
                np.sum(np.square(x, dtype=np.float64))
                for x in jax.tree.leaves(
                    jax.tree.map(lambda x: np.asarray(x, np.float64), after["vision"])
                )
            )
        )
        np.testing.assert_allclose(a["param_norm/vision"], held_norm, rtol=1e-6)
    for part in ("projector", "llm"):  # trained: bit-identical float32
        jax.tree.map(np.testing.assert_array_equal, after[part], ref[part])
    init = jax.device_get(bf16_model()[1]["vision"])
    for path, a in jax.tree.leaves_with_path(after["vision"]):
        want_leaf = functools.reduce(lambda t, k: t[k.key], path, init)
        if a.dtype == jnp.bfloat16:  # the cast of the initial float32 value, never moved
            np.testing.assert_array_equal(a, np.asarray(jnp.asarray(want_leaf, jnp.bfloat16)))
        else:
            np.testing.assert_array_equal(a, want_leaf)
    # Every device holds half the bytes of its frozen matrices less, and nothing else moved.
    mine, theirs = bytes_per_device(held), bytes_per_device(master)
    halved = dict.fromkeys(mine, 0)
    for a in jax.tree.leaves(held.state.params):
        for shard in a.addressable_shards if a.dtype == jnp.bfloat16 else ():
            halved[shard.device] += shard.data.nbytes
    assert all(halved[d] > 0 for d in held.programs[("vision", 0)].devices)
    assert {d: theirs[d] - halved[d] for d in theirs} == mine


def test_checkpoint_of_bf16_frozen_parts_restores_into_either_holding(runs, tmp_path):
    (held, _), (master, _) = runs
    save_checkpoint(tmp_path, held, STEPS)
    for dtype, like in (("bfloat16", held), (None, master)):
        ex = executor(dtype, params=False)
        restore_checkpoint(tmp_path, ex)
        got, want = ex.full_params(), held.full_params()
        for part, tree in like.full_params().items():
            # Each leaf in the dtype this executor holds it in, with the saved values.
            jax.tree.map(lambda a, b: np.testing.assert_equal(a.dtype, b.dtype), got[part], tree)
            jax.tree.map(
                lambda a, b: np.testing.assert_array_equal(a, b.astype(a.dtype)),
                got[part],
                want[part],
            )
        np.testing.assert_equal(ex.state.step, STEPS)
    # The export's read (the model's float32 tree on one device) upcasts the bf16 leaves.
    model, _, _ = bf16_model()
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    like = {
        n: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), m)
        for n, m in ((n, m.abstract_params()) for n, m in model.modules.items())
    }
    ckpt = Checkpointer(tmp_path)
    params = ckpt.restore_params(like)
    ckpt.close()
    kernel = params["vision"]["blocks"]["qkv"]["kernel"]
    assert kernel.dtype == jnp.float32
    want = held.full_params()["vision"]["blocks"]["qkv"]["kernel"]
    np.testing.assert_array_equal(kernel, want.astype(np.float32))


def test_checkpoint_with_other_trained_parts_is_refused_in_one_line(runs, tmp_path):
    held, _ = runs[0]
    save_checkpoint(tmp_path, held, STEPS)
    other = executor("bfloat16", freeze=("vision", "llm"), params=False)
    with pytest.raises(CheckpointError) as err:
        restore_checkpoint(tmp_path, other)
    message = str(err.value)
    assert len(message.splitlines()) == 1
    assert "trained llm, projector but this run trains projector," in message
    assert "model.freeze" in message
