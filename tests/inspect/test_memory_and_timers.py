"""Live-memory sampling, compiled peak bytes and the wall-clock timer."""

from __future__ import annotations

import gc
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hetjax.inspect import Timer, array_bytes_per_device, live_bytes_per_device, peak_bytes


def mesh():
    return jax.sharding.Mesh(np.array(jax.devices()), ("x",))


def test_live_bytes_see_a_new_sharded_array_on_every_device():
    gc.collect()
    before = live_bytes_per_device()
    a = jax.device_put(np.zeros((8, 64), np.float32), NamedSharding(mesh(), P("x")))
    after = live_bytes_per_device()
    assert {d: after.get(d, 0) - before.get(d, 0) for d in jax.devices()} == dict.fromkeys(
        jax.devices(), 64 * 4
    )
    assert array_bytes_per_device(a) == dict.fromkeys(jax.devices(), 64 * 4)
    del a


def test_a_replicated_array_counts_on_each_device_and_a_deleted_one_not_at_all():
    a = jax.device_put(np.zeros((16,), np.float32), NamedSharding(mesh(), P()))
    assert live_bytes_per_device([a]) == dict.fromkeys(jax.devices(), 64)
    before = live_bytes_per_device()
    a.delete()
    after = live_bytes_per_device()
    assert all(before[d] - after.get(d, 0) == 64 for d in jax.devices())


def test_peak_bytes_covers_arguments_and_outputs():
    x = np.zeros((128,), np.float32)
    compiled = jax.jit(lambda a: (a * 2, a + 1)).lower(x).compile()
    assert peak_bytes(compiled) >= 3 * x.nbytes  # one argument, two outputs


def test_timer_keeps_one_sample_per_block():
    timer = Timer()
    assert timer.elapsed() == 0.0
    for pause in (0.01, 0.03, 0.02):
        with timer:
            time.sleep(pause)
            assert timer.elapsed() > 0.0
    assert len(timer.samples) == 3 and timer.last == timer.samples[-1]
    assert 0.02 <= timer.median < 0.03 + 0.05
    assert timer.total >= 0.06
