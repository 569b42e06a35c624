"""The end of a step (:func:`hetjax.runtime.reduce.finish_step`): one function for one
process and many, the two differing only in where per-stage scalars meet.

Run in one process, both strategies (:class:`OnDevice`, the single-process one, and
:class:`OnHosts`, the multi-process one, whose host all-gather then spans one process)
finish the same gradients into the same state and metrics, and report the same program
calls (a reduce and an update per stage) to the observers.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest

import hetjax
from hetjax import Layout
from hetjax.distributed.rendezvous import FirstCalls
from hetjax.runtime.inflight import InFlight
from hetjax.runtime.reduce import OnDevice, OnHosts, finish_step
from models.config import get_preset
from models.mllm import MLLM

LAYOUTS = {"vision": Layout.parse("dp=4"), "llm": Layout.parse("dp=2,pp=2")}


@functools.cache
def executor() -> hetjax.Executor:
    model = MLLM(get_preset("tiny"))
    return hetjax.Executor(
        hetjax.plan_run(model.train_graph(LAYOUTS), num_devices=4),
        model.init(jax.random.key(0)),
        devices=jax.devices()[:4],
        optimizer=optax.chain(hetjax.clip_by_global_norm(1e-3), optax.sgd(0.1)),
    )


def finish(totals):
    """One finish of fixed gradients from the executor's state, with ``totals``: the new
    state, the metrics and the ``(stage, program)`` calls reported."""
    ex = executor()
    state = jax.tree.map(lambda a: a.copy() if isinstance(a, jax.Array) else a, ex.state)
    acc = {
        k: jax.tree.map(lambda z, i=i: z + 0.01 * (i + 1), p.zeros())
        for i, (k, p) in enumerate(ex.programs.items())
    }
    losses = [jax.numpy.float32(3.0), jax.numpy.float32(5.0)]
    calls = []
    new, metrics = finish_step(
        ex.programs,
        state,
        acc,
        losses,
        jax.numpy.float32(4.0),
        totals=totals,
        guard=InFlight(True),
        record=lambda key, kind, args, out, t0: calls.append((key, kind)),
    )
    return new, metrics, calls


@pytest.fixture(scope="module")
def both():
    return {
        "device": finish(OnDevice(jax.devices()[0])),
        "hosts": finish(OnHosts(FirstCalls())),
    }


def test_both_strategies_report_a_reduce_and_an_update_per_stage(both):
    stages = list(executor().programs)
    want = [(k, "reduce") for k in stages] + [(k, "update") for k in stages]
    assert both["device"][2] == want
    assert both["hosts"][2] == want


def test_both_strategies_give_the_same_metrics_and_state(both):
    (dev_state, dev, _), (host_state, host, _) = both["device"], both["hosts"]
    assert not dev.on_host and host.on_host  # device scalars until read; host floats
    assert list(dev) == list(host)
    assert {"loss", "grad_norm", "grad_norm/vision", "grad_norm/llm", "supervised_tokens"} <= set(
        dev
    )
    assert dev["loss"] == host["loss"] == 8.0  # the microbatches' (normalised) losses summed
    assert dev["supervised_tokens"] == host["supervised_tokens"] == 4.0
    assert dev["grad_norm"] > 1e-3  # the clip is active, so the global norm matters
    for key in dev:
        np.testing.assert_allclose(host[key], dev[key], rtol=1e-6, err_msg=key)
    assert dev_state.step == host_state.step == executor().state.step + 1
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=0),
        jax.device_get(dev_state.params),
        jax.device_get(host_state.params),
    )
