"""The parity harness shared by ``test_executor_parity.py`` and ``test_parallelism_parity.py``.

A :class:`Case` is one executor configuration; :func:`check_matches_reference` trains it
for ``STEPS`` steps next to the single-device :class:`hetjax.ReferenceTrainer` run of the
same preset and batches (:func:`reference`, cached per preset and global batch) and checks:

- parameters after exactly ONE step equal the reference's within atol 1e-6;
- losses, the global and per-module gradient norms and the per-module parameter norms
  agree within rtol 1e-5 at each step, and the supervised-token counts exactly;
- nothing compiles again after the first step, and the caller's parameters survive (the
  executor donates only its own copies).

Optimiser: no warm-up and ``eps=1e-3`` (why: ``test_executor_parity.py``'s docstring).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter

import chex
import jax
import numpy as np
import pytest

import hetjax
from hetjax import Layout
from hetjax.inspect import Recorder, expect_compiles
from models.config import get_preset
from models.data import SyntheticConfig, SyntheticLlava
from models.mllm import MLLM

STEPS = 10
OPTIMIZER = hetjax.AdamWConfig(total_steps=STEPS, warmup_steps=0, eps=1e-3)


@dataclasses.dataclass(frozen=True)
class Case:
    """One executor configuration of a parity matrix."""

    preset: str  # a models.config preset
    mode: str  # "colocated", "non-colocated", "homogeneous"
    layouts: tuple[tuple[str, str], ...]  # (module, layout text); islands follow this order
    microbatches: int
    schedule: str = "1f1b"
    options: tuple[str, ...] = ()  # ParallelOptions switches to turn on
    freeze: tuple[str, ...] = ()  # modules or parts not trained (MLLM.train_graph's freeze)
    recompute: tuple[tuple[str, str], ...] = ()  # (module or "*", activation policy)
    rebalance: tuple[str, ...] = ()  # encoders dealt over their batch ranks per step

    @property
    def parsed(self) -> dict[str, Layout]:
        return {name: Layout.parse(text, module=name) for name, text in self.layouts}


def case(
    preset,
    mode,
    microbatches,
    schedule="1f1b",
    *,
    slow=False,
    options=(),
    freeze=(),
    recompute=None,
    rebalance=(),
    id,
    **layouts,
):
    """A ``pytest.param`` of a :class:`Case`, marked ``slow`` if asked; ``recompute``: one
    activation policy for every module (None: the graph's default)."""
    c = Case(
        preset,
        mode,
        tuple(layouts.items()),
        microbatches,
        schedule,
        tuple(options),
        tuple(freeze),
        (("*", recompute),) if recompute else (),
        tuple(rebalance),
    )
    return pytest.param(c, id=id, marks=[pytest.mark.slow] if slow else [])


@dataclasses.dataclass
class Reference:
    model: MLLM
    params: dict  # initial parameters (device arrays; the executors copy them)
    batches: list  # host batches, one per step
    metrics: list  # host metrics per step
    after_one: dict  # host parameters after exactly one step
    after: list  # host parameters after each step


@functools.cache
def reference(preset: str, global_batch: int, frozen: frozenset[str] = frozenset()) -> Reference:
    """The single-device run of ``STEPS`` steps of ``preset`` with the parts ``frozen``
    (computed once per process)."""
    cfg = get_preset(preset)
    data = SyntheticLlava(SyntheticConfig.for_model(cfg, seq_len=cfg.seq_len, seed=0))
    batches = [data.batch(s, global_batch) for s in range(STEPS)]
    return reference_run(MLLM(cfg), batches, frozen)


def reference_run(model: MLLM, batches: list, frozen: frozenset[str] = frozenset()) -> Reference:
    """The single-device run of ``model`` (initialised from key 0) over ``batches``."""
    params = model.init(jax.random.key(0))
    axes = {n: m.logical_axes() for n, m in model.modules.items() if n not in frozen}
    trainer = hetjax.ReferenceTrainer(
        model.loss_sum,
        params,
        hetjax.make_optimizer(OPTIMIZER, logical_axes=axes),
        devices=jax.devices()[:1],
        frozen=frozen,
    )
    metrics, after = [], []
    for batch in batches:
        metrics.append(jax.device_get(trainer.step(batch)))
        after.append(jax.device_get(trainer.params))  # before the next step donates them
    return Reference(model, params, batches, metrics, after[0], after)


def compared_keys(metrics: dict) -> list[str]:
    return sorted(k for k in metrics if k in ("loss", "grad_norm") or "_norm/" in k)


def check_matches_reference(case: Case, ref: Reference, observers: tuple = ()) -> hetjax.Executor:
    """Trains ``case`` on all devices over ``ref``'s batches and checks it against ``ref``
    (trained with the same parts frozen); returns the executor after the last step.
    ``observers`` watch the executor."""
    layouts = case.parsed
    ref.model.validate_layouts(layouts, seq_len=ref.batches[0]["tokens"].shape[1])
    islands = (
        {name: layout.num_devices for name, layout in layouts.items()}
        if case.mode == "non-colocated"
        else None
    )
    graph = ref.model.train_graph(layouts, freeze=case.freeze).with_recompute(dict(case.recompute))
    plan = hetjax.plan_run(
        graph,
        num_devices=len(jax.devices()),
        mode=case.mode,
        islands=islands,
        microbatches=case.microbatches,
        schedule=case.schedule,
        rebalance=case.rebalance,
    )
    ex = hetjax.Executor(
        plan,
        ref.params,
        devices=jax.devices(),
        optimizer=OPTIMIZER,
        options=hetjax.ParallelOptions(**{name: True for name in case.options}),
        observers=observers,
    )
    got = [jax.device_get(ex.step(ref.batches[0]))]
    after_one = ex.full_params()
    # Steps 2..STEPS reuse step 1's executables.
    with expect_compiles(0, f"steps 2..{len(ref.batches)}"):
        got += [jax.device_get(ex.step(batch)) for batch in ref.batches[1:]]

    # One step: every parameter, gathered back into the reference's tree.
    chex.assert_trees_all_close(after_one, ref.after_one, atol=1e-6, rtol=0)

    # Every step: the same metric names, and values per step.
    keys = compared_keys(ref.metrics[0])
    assert compared_keys(got[0]) == keys
    frozen = ref.model.frozen_parts(case.freeze) if case.freeze else frozenset()
    assert {f"grad_norm/{name}" for name in ref.params if name not in frozen} <= set(keys)
    for key in keys:
        np.testing.assert_allclose(
            [m[key] for m in got], [m[key] for m in ref.metrics], rtol=1e-5, atol=0, err_msg=key
        )
    np.testing.assert_array_equal(
        [m["supervised_tokens"] for m in got], [m["supervised_tokens"] for m in ref.metrics]
    )
    for name in case.rebalance:  # never worse than the rows' order, better in some step
        after, before = (
            [m[f"{k}/{name}"] for m in got] for k in ("imbalance", "imbalance_without")
        )
        assert all(a <= b for a, b in zip(after, before, strict=True)), (after, before)
        assert any(a < b for a, b in zip(after, before, strict=True)), (after, before)

    # The caller's parameters are intact.
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(ref.params))
    return ex


def assert_cp_reduced_once_per_step(rec: Recorder, ex: hetjax.Executor, steps: int) -> None:
    """With cp > 1 the dense LLM (the sink) runs per cp rank (``StageProgram.cp_local``):
    none of its backwards all-reduces parameter gradients over cp; the step's one
    ``reduce`` does. (An encoder with cp > 1 - the homogeneous baseline's - still does
    in every backward.) ``rec`` watched ``ex`` for ``steps`` steps."""
    from experiments.bench_engine import cp_grad_reductions

    cp_stages = [
        k for k, p in ex.programs.items() if p.mesh.shape["cp"] > 1 and k[0] == ex.graph.sink
    ]
    assert cp_stages
    for key in cp_stages:
        assert ex.programs[key].cp_local, key
        for kind, want in (("bwd", 0), ("reduce", 1)):
            only = Counter({(key, kind): 1})
            assert cp_grad_reductions(_Calls(only, rec.compiled), ex) == want, (key, kind)
    sink_calls = Counter({c: n for c, n in rec.calls.items() if c[0] in cp_stages})
    assert cp_grad_reductions(_Calls(sink_calls, rec.compiled), ex) == steps  # once per step
    # The count does see per-microbatch reductions where they remain: an encoder with
    # cp > 1 (the homogeneous baseline's) sums its gradients over cp in every backward.
    for key, p in ex.programs.items():
        if p.mesh.shape["cp"] > 1 and key[0] != ex.graph.sink and (key, "bwd") in rec.compiled:
            only = Counter({(key, "bwd"): 1})
            assert cp_grad_reductions(_Calls(only, rec.compiled), ex) == 1, key


@dataclasses.dataclass
class _Calls:
    """A Recorder's view with chosen call counts (what cp_grad_reductions reads)."""

    calls: Counter
    compiled: dict
