"""Context, expert, ZeRO-1 and sequence parallelism vs the single-device reference (FP32).

The executor's parallel strategies beyond DP/TP/PP change how every step is computed: a
K/V ring over ``cp`` with the sequence stored zigzag-permuted, token all-to-alls over
``ep`` (dropless top-2 MoE, in the LLM or in the vision encoder), optimiser moments
sharded over ``dp`` (ZeRO-1: the DP reduction becomes a reduce-scatter) and a residual
stream sharded on sequence over ``tp`` (sequence parallelism). None of them may change
the maths. For each configuration:

- parameters after exactly ONE step equal the reference's within atol 1e-6;
- losses, the global and per-module gradient norms and the per-module parameter norms
  agree within rtol 1e-5 at each of 10 steps;
- steps 2..10 compile nothing new.

Optimiser: no warm-up (the first step moves every parameter) and ``eps=1e-3``, for the
reason given in ``test_executor_parity.py``: Adam's ``m / (sqrt(v) + eps)`` amplifies the
summation-order noise of a split near zero gradients by ~``lr / eps``; the gradients
themselves agree to ~1e-7 relative. A small global batch (8) keeps the reference and
the steps cheap; one reference run per preset is shared by all cases
(``tests/runtime/parity.py``, the harness both parity files use).

Coverage (a covering set, not the product; ``A`` runs by default, the rest are ``slow``
and run in CI):

- CP=2 colocated with TP (A), CP=2 non-colocated with PP and Fan-In 4 -> 1 (B), CP=4
  colocated with ZeRO-1 (C), CP=2 non-colocated with TP and sequence parallelism over
  (cp, tp) (H), CP=4 non-colocated (I); in all of these the image tokens are routed to
  the cp rank storing their positions (``hetjax.ops.token_routing``); every encoder but
  the MoE one (F) is dp-only;
- the homogeneous baseline of a CP=2, TP=2 LLM (J): the encoder inherits cp and tp, so
  it splits its patch tokens over cp and runs bidirectional ring attention;
- MoE LLM (``tiny-moe``, dropless): EP=2 with expert weights split over TP (D), EP=4
  non-colocated with ZeRO-1 on an ``ep``-only replica axis (E);
- MoE vision encoder (``tiny-moe-enc``) with EP=4 (F);
- sequence parallelism with TP=4 (G).

"""

from __future__ import annotations

import functools

import pytest

from hetjax.inspect import Recorder
from models.config import get_preset
from tests.runtime import parity
from tests.runtime.parity import (
    Case,
    assert_cp_reduced_once_per_step,
    check_matches_reference,
    reference,
)

GLOBAL_BATCH = 8  # divisible by dp x microbatches of every module in CASES
case = functools.partial(parity.case, slow=True)  # A runs by default, the rest are slow


CASES = [
    case(
        "tiny",
        "colocated",
        1,
        slow=False,
        id="A-colocated-vis_dp8-llm_dp2cp2tp2",
        vision="dp=8",
        llm="dp=2,cp=2,tp=2",
    ),
    case(
        "tiny",
        "non-colocated",
        2,
        id="B-noncolocated-vis_dp4-llm_cp2pp2-mb2",
        vision="dp=4",
        llm="cp=2,pp=2",
    ),
    case(
        "tiny",
        "colocated",
        1,
        options=("zero1",),
        id="C-colocated-vis_dp8-llm_dp2cp4-zero1",
        vision="dp=8",
        llm="dp=2,cp=4",
    ),
    case(
        "tiny-moe",
        "colocated",
        1,
        id="D-moe-colocated-vis_dp8-llm_dp4ep2tp2",
        vision="dp=8",
        llm="dp=4,ep=2,tp=2",
    ),
    case(
        "tiny-moe",
        "non-colocated",
        2,
        options=("zero1",),
        id="E-moe-noncolocated-vis_dp4-llm_dp4ep4-mb2-zero1",
        vision="dp=4",
        llm="dp=4,ep=4",
    ),
    case(
        "tiny-moe-enc",
        "colocated",
        1,
        id="F-moeenc-colocated-vis_dp8ep4-llm_dp4tp2",
        vision="dp=8,ep=4",
        llm="dp=4,tp=2",
    ),
    case(
        "tiny",
        "colocated",
        1,
        options=("sequence_parallel",),
        id="G-colocated-vis_dp8-llm_dp2tp4-seqpar",
        vision="dp=8",
        llm="dp=2,tp=4",
    ),
    case(
        "tiny",
        "non-colocated",
        2,
        options=("sequence_parallel",),
        id="H-noncolocated-vis_dp4-llm_cp2tp2-mb2-seqpar",
        vision="dp=4",
        llm="cp=2,tp=2",
    ),
    case(
        "tiny",
        "non-colocated",
        2,
        id="I-noncolocated-vis_dp4-llm_cp4-mb2",
        vision="dp=4",
        llm="cp=4",
    ),
    case(
        "tiny",
        "homogeneous",
        1,
        id="J-homogeneous-llm_dp2cp2tp2",
        vision="dp=2,cp=2,tp=2",
        llm="dp=2,cp=2,tp=2",
    ),
]


@pytest.mark.parametrize("case", CASES)
def test_matches_single_device_reference(case):
    ref = reference(case.preset, GLOBAL_BATCH)
    rec = Recorder()
    ex = check_matches_reference(case, ref, observers=(rec,))
    llm = case.parsed["llm"]
    if llm.cp > 1 and get_preset(case.preset).llm.moe is None:
        # A dense LLM with cp > 1, whatever its tp (A: dp=2,cp=2,tp=2; H: cp=2,tp=2 with
        # sequence parallelism) and in the homogeneous baseline too (J: its image tokens
        # arrive whole over cp): its gradients are reduced over cp once per step.
        assert_cp_reduced_once_per_step(rec, ex, len(ref.batches))


def test_matrix_covers_the_requested_strategies():
    """The covering set keeps covering what it claims when cases are edited: CP 2 and 4
    (both placements), dropless EP 2 and 4 in the LLM, EP in the encoder, ZeRO-1 and
    sequence parallelism with tp > 1, with dp-only encoders elsewhere. (That the compiled
    programs really run a K/V ring, sharded moments and sequence-sharded activations is
    checked in ``test_parallelism_programs.py``.)"""
    got = {"cp2": 0, "cp4": 0, "llm_ep": set(), "vision_ep": 0, "zero1": 0, "seqpar": 0}
    for param in CASES:
        c: Case = param.values[0]
        lays = c.parsed
        llm, vision = lays["llm"], lays["vision"]
        got["cp2"] += llm.cp == 2
        got["cp4"] += llm.cp == 4
        if get_preset(c.preset).llm.moe is not None and llm.ep > 1:
            got["llm_ep"].add(llm.ep)
        got["vision_ep"] += get_preset(c.preset).vision.moe is not None and vision.ep > 1
        got["zero1"] += "zero1" in c.options
        got["seqpar"] += "sequence_parallel" in c.options and llm.tp > 1
        if c.mode != "homogeneous":
            assert vision.tp == vision.cp == 1 or c.preset == "tiny-moe-enc", c
    assert got["cp2"] >= 2 and got["cp4"] >= 2
    assert got["llm_ep"] == {2, 4}
    assert got["vision_ep"] >= 1 and got["zero1"] >= 1 and got["seqpar"] >= 1
    modes = {(p.values[0].mode, p.values[0].parsed["llm"].cp > 1) for p in CASES}
    assert {("colocated", True), ("non-colocated", True), ("homogeneous", True)} <= modes
    for moe in (get_preset("tiny-moe").llm.moe, get_preset("tiny-moe-enc").vision.moe):
        assert moe is not None and moe.capacity_factor is None  # dropless
