"""Activation policies (``ModuleSpec.recompute``): none, selective and full vs the reference.

Each policy changes only WHERE the backward's inputs come from (vjp residuals kept by the
forward, matmul outputs kept and the rest recomputed, or the stage input and a replayed
forward), never the values: FP32 losses, norms and parameters match the single-device
reference at rtol 1e-5 under a colocated pp=2, a non-colocated pp=2 and a cp=2 layout
(and ``full`` with cp=2,tp=2), and with a frozen encoder. No program compiles again
after the first step (residuals' shardings are XLA's choice, stable from step 2 on).
Stash entries per stage follow 1F1B's bound in every policy.

Three steps (not the harness's ten): the policies' programs differ from the first step
on, and the full ten-step matrix runs in ``test_executor_parity.py`` under the default.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

import hetjax
from hetjax import LayoutError
from hetjax.inspect import Recorder
from models.config import get_preset
from models.mllm import MLLM
from tests.runtime import parity
from tests.runtime.parity import assert_cp_reduced_once_per_step, check_matches_reference

STEPS = 3
GLOBAL_BATCH = 16

LAYOUTS = {
    "colocated-pp2": ("colocated", 2, dict(vision="dp=8", llm="dp=2,tp=2,pp=2")),
    "noncolocated-pp2": ("non-colocated", 4, dict(vision="dp=2,tp=2", llm="dp=2,pp=2")),
    "colocated-cp2pp2": ("colocated", 2, dict(vision="dp=8", llm="dp=2,cp=2,pp=2")),
    # cp with tensor parallelism: still per cp rank, reduced once per step
    "colocated-cp2tp2pp2": ("colocated", 2, dict(vision="dp=8", llm="cp=2,tp=2,pp=2")),
}
FAST = {("none", "colocated-pp2"), ("none", "noncolocated-pp2"), ("selective", "colocated-cp2pp2")}


def _case(policy: str, layout: str, **kwargs):
    mode, microbatches, layouts = LAYOUTS[layout]
    slow = (policy, layout) not in FAST
    return parity.case(
        "tiny",
        mode,
        microbatches,
        slow=slow,
        recompute=policy,
        id=f"{policy}-{layout}",
        **kwargs,
        **layouts,
    )


@functools.cache
def _reference(frozen: frozenset[str] = frozenset()) -> parity.Reference:
    ref = parity.reference("tiny", GLOBAL_BATCH, frozen)
    return dataclasses.replace(ref, batches=ref.batches[:STEPS], metrics=ref.metrics[:STEPS])


@pytest.mark.parametrize(
    "case",
    [
        _case(p, layout)
        for layout in LAYOUTS
        for p in ("none", "selective", "full")
        if layout != "colocated-cp2tp2pp2" or p == "full"  # none: the parity matrix's A, H
    ],
)
def test_policy_matches_reference(case):
    rec = Recorder()
    ex = check_matches_reference(case, _reference(), observers=(rec,))
    # 1F1B's bound in every policy: a stage keeps at most as many microbatches as there
    # are stages from it to the end of the pipeline (three-phase encoders keep all M).
    for spec in ex.graph.modules:
        for s in range(spec.layout.pp):
            depth = spec.layout.pp - s
            if spec.name != ex.graph.sink:
                depth += ex.graph.module(ex.graph.sink).layout.pp
                if ex.mode == "colocated":
                    depth = ex.microbatches
            assert rec.stash_entries[(spec.name, s)] <= min(depth, ex.microbatches), (spec.name, s)
    if any(p.mesh.shape["cp"] > 1 for p in ex.programs.values()):
        assert_cp_reduced_once_per_step(rec, ex, STEPS)


def test_frozen_encoder_none():
    """LLaVA stage 2 (the encoder frozen) non-colocated with the encoder pipelined: its
    first stage runs forward only, its last stage keeps residuals of the projector
    alone (the frozen encoder's output is their input, not a replay)."""
    case = _case("none", "noncolocated-pp2").values[0]
    layouts = (("vision", "dp=2,pp=2"), ("llm", "dp=2,pp=2"))
    case = dataclasses.replace(case, layouts=layouts, microbatches=2, freeze=("vision",))
    rec = Recorder()
    ex = check_matches_reference(case, _reference(frozen=frozenset({"vision"})), (rec,))
    assert ("vision", 0) not in rec.stash_entries  # forward only: nothing stashed
    assert ex.programs[("vision", 1)].keeps_residuals


def test_unknown_policy_or_module_is_one_line():
    graph = MLLM(get_preset("tiny")).train_graph(dict.fromkeys(("vision", "llm"), hetjax.Layout()))
    with pytest.raises(LayoutError, match=r"recompute llm:'some' is not a policy; use one of"):
        graph.with_recompute({"llm": "some"})
    with pytest.raises(LayoutError, match=r"recompute names unknown module 'lm'; use one of"):
        graph.with_recompute({"lm": "full"})
    mixed = graph.with_recompute({"*": "selective", "llm": "full"})
    assert [m.recompute for m in mixed.modules] == ["selective", "full"]


def test_recompute_flag_sets_the_config_and_errors_name_it():
    from experiments import flags

    cfg = flags.parse_args(["--recompute", "full", "--recompute", "llm:none"], prog="t")
    assert cfg.parallel.recompute == {"*": "full", "llm": "none"}
    with pytest.raises(
        flags.ConfigError,
        match=r"^--recompute llm:some is not .* one of 'none', 'selective', 'full'$",
    ):
        flags.parse_args(["--recompute", "llm:some"], prog="t")
    graph = MLLM(get_preset("tiny")).train_graph(dict.fromkeys(("vision", "llm"), hetjax.Layout()))
    with pytest.raises(LayoutError) as e:
        graph.with_recompute({"lm": "none"})
    assert flags.as_flags(str(e.value)).startswith("--recompute names unknown module 'lm'")
