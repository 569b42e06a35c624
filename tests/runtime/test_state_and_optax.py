"""The executor's public state, metrics and optimiser contracts.

- any optax chain trains like the reference trainer given the same chain (clipping by
  the norm over ALL stages through :func:`hetjax.clip_by_global_norm`);
- :class:`hetjax.TrainState` is a pytree that a new executor continues from bit-exactly;
- :class:`hetjax.StepMetrics` is what ``step`` returns;
- :func:`hetjax.plan_run` checks settings with no parameters or devices, and its errors
  name parameters.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest

import hetjax
from hetjax import Layout, LayoutError
from models.config import get_preset
from models.data import SyntheticConfig, SyntheticLlava
from models.mllm import MLLM

GLOBAL_BATCH = 8
LAYOUTS = {"vision": Layout.parse("dp=4"), "llm": Layout.parse("dp=2,pp=2")}
ISLANDS = {"vision": 4, "llm": 4}


@functools.cache
def setup():
    cfg = get_preset("tiny")
    model = MLLM(cfg)
    data = SyntheticLlava(SyntheticConfig.for_model(cfg, seq_len=cfg.seq_len, seed=0))
    batches = [data.batch(s, GLOBAL_BATCH) for s in range(3)]
    return model, model.init(jax.random.key(0)), batches


def plan(model):
    return hetjax.plan_run(
        model.train_graph(LAYOUTS),
        num_devices=8,
        mode="non-colocated",
        islands=ISLANDS,
        microbatches=2,
        global_batch=GLOBAL_BATCH,
    )


def sgd_chain():
    return optax.chain(hetjax.clip_by_global_norm(0.05), optax.sgd(0.1, momentum=0.9))


def test_any_optax_chain_matches_the_reference_with_the_same_chain():
    model, params, batches = setup()
    ref = hetjax.ReferenceTrainer(model.loss_sum, params, sgd_chain(), devices=jax.devices()[:1])
    want = [jax.device_get(ref.step(b)) for b in batches]
    ex = hetjax.Executor(plan(model), params, devices=jax.devices(), optimizer=sgd_chain())
    got = [ex.step(b) for b in batches]
    # The clip is active (the norm is over both modules and both LLM stages).
    assert all(m["grad_norm"] > 0.05 for m in want)
    for key in ("loss", "grad_norm", "grad_norm/vision", "grad_norm/llm"):
        np.testing.assert_allclose(
            [m[key] for m in got], [m[key] for m in want], rtol=1e-5, err_msg=key
        )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=0),
        ex.full_params(),
        jax.device_get(ref.params),
    )


def test_clip_without_a_given_norm_is_optax_clip_by_global_norm():
    grads = {"a": np.full((3,), 2.0, np.float32), "b": np.full((2, 2), -1.0, np.float32)}
    ours, _ = hetjax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
    theirs, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
    jax.tree.map(np.testing.assert_array_equal, ours, theirs)


def test_a_new_executor_continues_from_the_state_bit_exactly():
    model, params, batches = setup()
    run = hetjax.Executor(plan(model), params, devices=jax.devices())
    losses = [run.step(b)["loss"] for b in batches]

    first = hetjax.Executor(plan(model), params, devices=jax.devices())
    for b in batches[:2]:
        first.step(b)
    state = first.state
    assert isinstance(state, hetjax.TrainState) and state.step == 2
    assert set(state.params) == {("vision", 0), ("llm", 0), ("llm", 1)}
    assert len(jax.tree.leaves(state)) > len(jax.tree.leaves(state.params))
    second = hetjax.Executor(plan(model), devices=jax.devices(), state=state)
    assert second.step(batches[2])["loss"] == losses[2]


def test_step_returns_step_metrics_read_on_demand():
    model, params, batches = setup()
    ex = hetjax.Executor(plan(model), params, devices=jax.devices())
    metrics = ex.step(batches[0])
    assert isinstance(metrics, hetjax.StepMetrics)
    jax.block_until_ready(metrics)  # a pytree of device scalars until read
    assert metrics.is_ready()
    assert isinstance(metrics["loss"], float) and metrics.on_host
    assert {"loss", "grad_norm", "grad_norm/llm", "param_norm/vision"} <= set(metrics)


def test_plan_needs_no_parameters_and_lowers_every_mode_to_a_checked_schedule():
    model, _, _ = setup()
    graph = model.train_graph(LAYOUTS)
    assert plan(model).schedule.name == "graph_1f1b"
    colocated = model.train_graph({"vision": Layout(dp=8), "llm": Layout(dp=2, tp=2, pp=2)})
    p = hetjax.plan_run(colocated, num_devices=8, microbatches=2)
    assert p.schedule.name == "three_phase"
    p = hetjax.plan_run(colocated, num_devices=8, mode="homogeneous", schedule="gpipe")
    assert p.schedule.name == "gpipe"
    assert [str(s) for s in p.schedule.stages] == ["vision[0/1]", "llm[0/2]", "llm[1/2]"]
    assert p.graph.module("vision").layout == Layout(dp=2, tp=2)  # inherited, applied once
    assert p.positions["vision"] == (0, 1, 2, 3)  # the LLM's first stage
    with pytest.raises(LayoutError, match=r"islands=\{'vision': 4, 'llm': 4\}"):
        hetjax.plan_run(graph, num_devices=8, mode="non-colocated")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"schedule": "gpipe"}, r"schedule='gpipe' is only for non-colocated"),
        ({"islands": ISLANDS}, r"islands are only for non-colocated.*mode='non-colocated'"),
        ({"mode": "non-colocated", "islands": ISLANDS, "offload_encoders": True}, "offload"),
        ({"mode": "nope"}, r"unknown mode='nope'"),
        ({"microbatches": 0}, r"microbatches=0"),
        (
            {"mode": "non-colocated", "islands": {"vision": 4, "llm": 8}},
            r"make islands=\{'llm': 4\} match",
        ),
        ({"mode": "non-colocated", "islands": ISLANDS, "global_batch": 6}, "multiple of"),
    ],
)
def test_plan_errors_name_parameters(kwargs, match):
    model, _, _ = setup()
    with pytest.raises(LayoutError, match=match) as excinfo:
        hetjax.plan_run(model.train_graph(LAYOUTS), num_devices=8, **kwargs)
    assert "\n" not in str(excinfo.value) and "--" not in str(excinfo.value)
