"""Which global batch rows a set of devices is fed (:func:`hetjax.runtime.feed.local_rows`),
the rows a multi-process run's loader decodes images for: exactly the rows that the
shards of :meth:`Feed.inputs` on those devices cover, here with the 8 simulated devices
split as two processes would hold them."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import hetjax
from hetjax import Layout
from hetjax.runtime.feed import Feed, local_rows, rows_held
from models.config import get_preset
from models.mllm import MLLM

B, M = 16, 2
SHAPES = {
    "images": (B, 16, 16, 3),
    "tokens": (B, 32),
    "targets": (B, 32),
    "loss_mask": (B, 32),
}


@pytest.mark.parametrize(
    "spec,shape",
    [
        (PartitionSpec("a"), (8, 3)),
        (PartitionSpec(("a", "b")), (8,)),
        (PartitionSpec(None, "a"), (8, 4)),  # rows replicated: every device holds all
        (PartitionSpec("b", "a"), (6, 4)),
    ],
)
def test_rows_held_are_the_rows_of_the_shards(spec, shape):
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    sharding = NamedSharding(mesh, spec)
    array = jax.make_array_from_callback(shape, sharding, lambda i: _row_ids(shape)[i])
    for devices in (mesh.devices[:2].flat, mesh.devices[:, 1], [mesh.devices[3, 0]]):
        devices = list(devices)
        # The rows whose data the shards of those devices carry.
        want = {
            int(r)
            for shard in array.addressable_shards
            if shard.device in devices
            for r in np.unique(np.asarray(shard.data))
        }
        assert rows_held(sharding, shape, devices).tolist() == sorted(want)
    # Default: this process's devices (here all of them).
    assert rows_held(sharding, shape).tolist() == list(range(shape[0]))


def _row_ids(shape) -> np.ndarray:
    """A ``shape`` array whose every element is its row's index."""
    rows = np.arange(shape[0], dtype=np.float32)
    return np.broadcast_to(rows.reshape(-1, *[1] * (len(shape) - 1)), shape)


def _programs(mode, islands=None, **layouts):
    model = MLLM(get_preset("tiny"))
    graph = model.train_graph({k: Layout.parse(v, module=k) for k, v in layouts.items()})
    devices = jax.devices()
    plan = hetjax.runtime.plan_run(
        graph, num_devices=len(devices), mode=mode, islands=islands, microbatches=M
    )
    ex = hetjax.Executor(plan, None, devices=devices)  # no parameters: nothing compiles
    return ex, devices


def _fed_rows(ex, devices, key):
    """The global rows whose values Feed.inputs puts on ``devices`` for ``key``."""
    batch = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    batch[key] = _row_ids(SHAPES[key])
    feed = Feed(batch, M, routed={}, links={}, cp={})
    rows = set()
    for prog in ex.programs.values():
        if key not in prog.batch_keys:
            continue
        for m in range(M):
            for shard in feed.inputs(prog, m)[key].addressable_shards:
                if shard.device in devices:
                    rows.update(np.unique(np.asarray(shard.data)).astype(int).tolist())
    return sorted(rows)


@pytest.mark.parametrize(
    "mode,islands,layouts,split",
    [
        # Vision on devices 0-3 (process 0 of 2 x 4), the LLM (cp=2) on 4-7 (process 1).
        ("non-colocated", {"vision": 4, "llm": 4}, {"vision": "dp=4", "llm": "cp=2,tp=2"}, 4),
        # Colocated: each process holds half of every microbatch's images.
        ("colocated", None, {"vision": "dp=8", "llm": "dp=2,tp=2,pp=2"}, 4),
        # 4 x 2: LLM pp stages on processes 2 and 3, vision dp=4 over processes 0-1.
        ("non-colocated", {"vision": 4, "llm": 4}, {"vision": "dp=4", "llm": "tp=2,pp=2"}, 2),
    ],
)
def test_local_rows_are_the_rows_the_feed_puts_there(mode, islands, layouts, split):
    ex, devices = _programs(mode, islands, **layouts)
    for start in range(0, len(devices), split):
        mine = devices[start : start + split]  # one process's devices
        got = local_rows(ex.programs.values(), M, SHAPES, mine)
        for key in SHAPES:
            assert got[key].tolist() == _fed_rows(ex, mine, key), (start, key)
    # All devices: every row of every key read.
    everything = local_rows(ex.programs.values(), M, SHAPES)
    assert all(v.tolist() == list(range(B)) for v in everything.values())


def test_island_split_feeds_images_to_vision_only():
    ex, devices = _programs(
        "non-colocated", {"vision": 4, "llm": 4}, vision="dp=4", llm="dp=2,tp=2"
    )
    vision = local_rows(ex.programs.values(), M, SHAPES, devices[:4])
    llm = local_rows(ex.programs.values(), M, SHAPES, devices[4:])
    assert vision["images"].tolist() == list(range(B)) and vision["tokens"].size == 0
    assert llm["images"].size == 0 and llm["tokens"].tolist() == list(range(B))
