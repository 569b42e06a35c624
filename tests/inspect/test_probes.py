"""The step probes on real program calls: the AsyncTimer waits on whatever a call's
arguments and outputs still hold (donated buffers are skipped, whatever their position),
and a failing watcher raises in the caller instead of dying silently."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import pytest

from hetjax.inspect import AsyncTimer, wait_alive
from hetjax.runtime.observers import Dispatch

DEVICES = frozenset(jax.devices()[:1])


def call(program: str, stage: tuple, fn, *args) -> Dispatch:
    """Calls ``fn`` and returns the event the executor would report."""
    t0 = time.perf_counter()
    out = fn(*args)
    return Dispatch(stage, program, None, args, out, t0, time.perf_counter())


def test_wait_alive_skips_deleted_arrays_and_non_arrays():
    gone, kept = jnp.ones(4), jnp.arange(3.0)
    gone.delete()
    wait_alive({"a": gone, "b": (kept, None, 1.0)})  # no "deleted or donated buffer" error
    assert kept.is_ready()


def test_the_timer_skips_donated_arguments_and_outputs():
    # bwd(params, acc, stash, data, g) donates its accumulator and stash, as the stage
    # programs with residuals do (the position issue 34's timer waited on); the next
    # call donates this call's accumulator output before the watcher may get to it.
    bwd = jax.jit(
        lambda p, acc, stash, data, g: (acc + p * stash * g, stash * g, jnp.sum(data)),
        donate_argnums=(1, 2),
    )
    fwd = jax.jit(lambda x: x * 3.0)
    timer = AsyncTimer()
    stages = {("enc", 0): 0, ("llm", 0): 1}
    timer.start(stages.__getitem__, 2)
    x = jnp.ones((64, 64))
    e1 = call("fwd", ("enc", 0), fwd, x)
    timer.on_dispatch(e1)
    acc, stash = jnp.zeros((64, 64)), x + 1.0
    e2 = call("bwd", ("llm", 0), bwd, x, acc, stash, x, e1.outputs)
    timer.on_dispatch(e2)
    e3 = call("bwd", ("llm", 0), bwd, x, e2.outputs[0], x + 2.0, x, e1.outputs)
    timer.on_dispatch(e3)
    timer.on_dispatch(call("update", ("llm", 0), fwd, x))  # not an F/B: not timed
    assert acc.is_deleted() and stash.is_deleted() and e2.outputs[0].is_deleted()
    bubble = timer.bubble(dict.fromkeys(stages, DEVICES))
    assert len(bubble) == 2 and all(0.0 <= b <= 1.0 for b in bubble)
    assert [key for key, _, _ in timer.ops] == [("enc", 0), ("llm", 0), ("llm", 0)]
    for _, dispatched, (ready, end) in timer.ops:
        assert dispatched <= ready <= end


class Failing(AsyncTimer):
    def _wait(self, tree):
        raise ValueError("watcher broke")


def test_a_failing_watcher_raises_in_the_caller():
    timer = Failing()
    timer.start(lambda key: 0, 1)
    x = jnp.ones(4)
    for _ in range(3):  # later items are drained, so the watcher still stops
        timer.on_dispatch(call("fwd", ("llm", 0), jnp.negative, x))
    with pytest.raises(ValueError, match="watcher broke"):
        timer.bubble({("llm", 0): DEVICES})


def test_nothing_timed_is_an_error_not_an_empty_unpack():
    timer = AsyncTimer()
    timer.start(lambda key: 0, 1)
    with pytest.raises(RuntimeError, match="no fwd/bwd call"):
        timer.bubble({})


def test_overlapping_spans_of_one_stage_count_once():
    """A watcher woken late ends an op after its stage's next op began: the busy time is
    the union of the spans, so the bubble stays within [0, 1]."""
    from hetjax.inspect.probes import _covered

    assert _covered([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0
    assert _covered([(1.0, 3.0), (0.0, 4.0)]) == 4.0
    assert _covered([]) == 0.0
    assert _covered([(0.0, 1.0), (3.0, 2.0)]) == 1.0  # a start after its end: nothing
