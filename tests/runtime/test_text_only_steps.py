"""Steps whose batch holds no image: the vision encoder is left out (FP32 parity).

Three steps, the middle one text-only (its image placeholders replaced by text, its
images zero), under the colocated three-phase schedule and non-colocated graph-aware
1F1B (there with the encoder frozen, LLaVA stage 2). The text-only step dispatches no
forward or backward of the encoder and moves nothing across its boundary, reports
``skipped/vision`` 1 (0 on the other steps), and still updates the encoder on a zero
gradient: losses, norms and every parameter match the single-device reference (whose
encoder gets an exactly zero gradient there, which AdamW turns into a decayed-momentum
step and weight decay).
"""

from __future__ import annotations

import functools
from collections import Counter

import chex
import jax
import numpy as np
import pytest

import hetjax
from hetjax.runtime.feed import absent_modules, skippable_modules
from models.config import get_preset
from models.data import SyntheticConfig, SyntheticLlava
from models.mllm import MLLM
from tests.runtime import parity
from tests.runtime.parity import OPTIMIZER, compared_keys

TEXT_ONLY = 1  # the step whose batch holds no image


def text_only(batch: dict, placeholder: int) -> dict:
    """``batch`` with every image placeholder turned into a text token, images zero."""
    tokens = np.where(batch["tokens"] == placeholder, 10, batch["tokens"]).astype(np.int32)
    return {**batch, "tokens": tokens, "images": np.zeros_like(batch["images"])}


@functools.cache
def setup(frozen: frozenset[str]) -> parity.Reference:
    """Three single-device steps of ``tiny``, the middle one text-only."""
    cfg = get_preset("tiny")
    model = MLLM(cfg)
    data = SyntheticLlava(SyntheticConfig.for_model(cfg, seq_len=cfg.seq_len, seed=0))
    batches = [data.batch(s, 8) for s in range(3)]
    batches[TEXT_ONLY] = text_only(batches[TEXT_ONLY], model.placeholder("image"))
    return parity.reference_run(model, batches, frozen)


class Calls(hetjax.Observer):
    """Per step: program calls per (module, program), and boundary transfers' modules."""

    def __init__(self):
        self.steps: list[tuple[Counter, Counter]] = []

    def next_step(self) -> None:
        self.steps.append((Counter(), Counter()))

    def on_dispatch(self, event) -> None:
        self.steps[-1][0][(event.stage[0], event.program)] += 1

    def on_transfer(self, event) -> None:
        if event.boundary:
            self.steps[-1][1][event.src[0]] += 1


CASES = {
    # One microbatch: each stage's one backward writes its gradients (no accumulator);
    # the encoder's state parked in host memory during the LLM phase.
    "colocated-three_phase-offload": dict(
        mode="colocated",
        layouts={"vision": "dp=8", "llm": "dp=4,pp=2"},
        freeze=(),
        microbatches=1,
        offload_encoders=True,
    ),
    "noncolocated-graph_1f1b-frozen": dict(
        mode="non-colocated",
        layouts={"vision": "dp=4", "llm": "dp=2,pp=2"},
        freeze=("vision",),
        microbatches=2,
    ),
    # The baseline: the encoder inherits the LLM's layout on its first stage's devices.
    "homogeneous-fused_1f1b": dict(
        mode="homogeneous",
        layouts={"vision": "dp=4", "llm": "dp=4,pp=2"},
        freeze=(),
        microbatches=2,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_text_only_step_leaves_the_encoder_out_and_matches_one_device(name):
    c = CASES[name]
    frozen = MLLM(get_preset("tiny")).frozen_parts(c["freeze"])
    ref = setup(frozen)
    model, ref_metrics, ref_after = ref.model, ref.metrics, ref.after
    layouts = {k: hetjax.Layout.parse(v, module=k) for k, v in c["layouts"].items()}
    islands = {k: v.num_devices for k, v in layouts.items()}
    plan = hetjax.plan_run(
        model.train_graph(layouts, freeze=c["freeze"]),
        num_devices=8,
        mode=c["mode"],
        islands=islands if c["mode"] == "non-colocated" else None,
        microbatches=c["microbatches"],
        offload_encoders=c.get("offload_encoders", False),
    )
    calls = Calls()
    ex = hetjax.Executor(
        plan, ref.params, devices=jax.devices(), optimizer=OPTIMIZER, observers=[calls]
    )
    assert ex.skippable == ("vision",)
    got = []
    for s, batch in enumerate(ref.batches):
        calls.next_step()
        got.append(jax.device_get(ex.step(batch)))
        chex.assert_trees_all_close(ex.full_params(), ref_after[s], atol=1e-6, rtol=0)
    keys = compared_keys(ref_metrics[0])
    for key in keys:
        np.testing.assert_allclose(
            [m[key] for m in got], [m[key] for m in ref_metrics], rtol=1e-5, atol=0, err_msg=key
        )
    assert [m["skipped/vision"] for m in got] == [0.0, 1.0, 0.0]
    if ex.offload_encoders:  # parked in every step's LLM phase, back for the update
        assert [kind for _, kind in ex.memory_log].count("pinned_host") == 3
    # AdamW moves the encoder's trained parameters on a zero gradient (momentum, decay).
    before, after = ref_after[TEXT_ONLY - 1]["projector"], ref_after[TEXT_ONLY]["projector"]
    assert not any(jax.tree.leaves(jax.tree.map(np.array_equal, before, after)))
    assert got[TEXT_ONLY]["grad_norm/projector"] == 0.0
    for s, (programs, boundary) in enumerate(calls.steps):
        encoder = {p: n for (m, p), n in programs.items() if m == "vision"}
        if s == TEXT_ONLY:  # no F or B, nothing across the boundary; the update still runs
            assert set(encoder) == {"zeros", "reduce", "update"}, encoder
            assert not boundary
        else:
            mb = c["microbatches"]
            assert encoder["fwd"] == encoder["bwd"] == boundary["vision"] == mb


def test_which_modules_a_batch_leaves_out():
    layouts = {n: hetjax.Layout() for n in ("vision", "audio", "llm")}
    av = MLLM(get_preset("tiny-av"))
    graph = av.train_graph(layouts)
    assert skippable_modules(graph) == ("vision", "audio")
    tokens = np.full((2, 8), 10, np.int32)
    tokens[1, 3] = av.placeholder("image")
    assert absent_modules({"tokens": tokens}, graph, ("vision", "audio")) == {"audio"}
    tokens[0, 5] = av.placeholder("audio")
    assert absent_modules({"tokens": tokens}, graph, ("vision", "audio")) == frozenset()
    assert absent_modules({"tokens": tokens * 0}, graph, ("vision",)) == {"vision"}
    # An MoE encoder's balancing loss trains it on padding images too: never left out.
    moe = MLLM(get_preset("tiny-moe-enc")).train_graph(
        {"vision": layouts["vision"], "llm": layouts["llm"]}
    )
    assert skippable_modules(moe) == ()
