"""The compile counter: one compile for a new jit, none for a cached call."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from hetjax.inspect import CompileCounter, expect_compiles


@pytest.fixture
def x():
    return jax.device_put(np.arange(6, dtype=np.float32))  # a transfer, not a compile


def test_counts_one_compile_for_a_new_jit_and_none_for_a_cached_call(x):
    def double_plus_one(a):
        return a * 2 + 1

    f = jax.jit(double_plus_one)
    with CompileCounter() as compiles:
        f(x).block_until_ready()
    assert compiles.count == 1 and compiles.names == ["jit(double_plus_one)"]
    with CompileCounter() as compiles:
        f(x).block_until_ready()
    assert compiles.count == 0 and compiles.names == []


def test_stopped_counter_keeps_its_count_and_counts_no_more(x):
    counter = CompileCounter().start()
    jax.jit(lambda a: a - 3)(x)
    counter.stop()
    jax.jit(lambda a: a + 3)(x)
    assert counter.count == 1
    counter.start()  # counting again adds to the same totals
    jax.jit(lambda a: a * 3)(x)
    counter.stop()
    assert counter.count == 2


def test_expect_compiles_names_what_compiled(x):
    def unexpected(a):
        return a / 7

    with expect_compiles(1):
        jax.jit(lambda a: a / 5)(x)
    message = r"step 2 compiled 1 programs, expected 0: jit\(unexpected\)"
    with pytest.raises(AssertionError, match=message), expect_compiles(0, "step 2"):
        jax.jit(unexpected)(x)
