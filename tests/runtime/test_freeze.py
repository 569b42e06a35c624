"""Frozen parts vs the reference trainer with the same parts frozen (FP32).

LLaVA stage 1 (``freeze=("vision", "llm")``: only the projector trains, so gradients
flow through the frozen LLM into it) and stage 2 (``freeze=("vision",)``), each under a
colocated and a non-colocated layout with pp > 1 (non-colocated, the vision encoder is
pipelined too, so its first stage runs forward only), the homogeneous baseline with
ZeRO-1, and the whole vision module frozen. Beyond the parity harness's checks (the same
10 losses and norms, rtol 1e-5): frozen parameters are bit-identical to the initial ones
after 10 steps while every trained part moved, frozen parts have no optimizer state and
no ``grad_norm/<part>``, and forward-only stages get no backward op.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import hetjax
from hetjax import Layout, LayoutError
from models.config import get_preset
from models.mllm import MLLM
from tests.runtime import parity
from tests.runtime.parity import check_matches_reference, reference

GLOBAL_BATCH = 8
case = functools.partial(parity.case, "tiny")

CASES = [
    case(
        "colocated",
        1,
        freeze=("vision", "llm"),
        id="stage1-colocated-vis_dp8-llm_dp2tp2pp2",
        vision="dp=8",
        llm="dp=2,tp=2,pp=2",
    ),
    case(
        "non-colocated",
        2,
        freeze=("vision",),
        id="stage2-noncolocated-vis_dp2pp2-llm_dp2pp2-mb2",
        vision="dp=2,pp=2",
        llm="dp=2,pp=2",
    ),
    case(
        "colocated",
        1,
        slow=True,
        freeze=("vision",),
        id="stage2-colocated-vis_dp8-llm_dp2tp2pp2",
        vision="dp=8",
        llm="dp=2,tp=2,pp=2",
    ),
    case(
        "non-colocated",
        2,
        slow=True,
        freeze=("vision", "llm"),
        id="stage1-noncolocated-vis_dp2pp2-llm_dp2pp2-mb2",
        vision="dp=2,pp=2",
        llm="dp=2,pp=2",
    ),
    case(  # the homogeneous baseline (the encoder on the LLM's first stage), ZeRO-1
        "homogeneous",
        1,
        slow=True,
        freeze=("vision",),
        options=("zero1",),
        id="stage2-homogeneous-llm_dp2tp2pp2-zero1",
        vision="dp=2,tp=2",
        llm="dp=2,tp=2,pp=2",
    ),
    case(  # the whole vision module frozen: it runs forward only
        "colocated",
        1,
        slow=True,
        freeze=("vision", "projector"),
        id="llm_only-colocated-vis_dp8-llm_dp2tp2pp2",
        vision="dp=8",
        llm="dp=2,tp=2,pp=2",
    ),
]


@pytest.mark.parametrize("case", CASES)
def test_frozen_matches_reference(case):
    frozen = MLLM(get_preset(case.preset)).frozen_parts(case.freeze)
    ref = reference(case.preset, GLOBAL_BATCH, frozen)
    ex = check_matches_reference(case, ref)
    after = ex.full_params()
    initial = jax.device_get(ref.params)
    for name in ref.params:
        same = jax.tree.map(np.array_equal, after[name], initial[name])
        if name in frozen:  # bit-identical after 10 steps
            assert all(jax.tree.leaves(same)), name
        else:  # every trained leaf moved
            assert not any(jax.tree.leaves(same)), name
    # No optimizer state, accumulator or gradient norm for frozen parts.
    for key, prog in ex.programs.items():
        opt_parts = {k for k in ex.params[key] if k in prog.trainable}
        assert not opt_parts & frozen
        if not prog.trainable:
            assert ex.opt_state[key] == ()
    # Forward-only stages (frozen, nothing trainable upstream): no B, nothing sent back.
    pp = case.parsed["vision"].pp  # the projector on the last stage trains unless frozen
    forward_only = {("vision", s) for s in range(pp if "projector" in frozen else pp - 1)}
    b_stages = {op.stage for op in ex.ops if op.kind == "B"}
    assert b_stages == set(ex.programs) - forward_only
    assert not any(op.kind == "SEND_B" and op.peer in forward_only for op in ex.ops)


def test_bad_freeze_is_one_line():
    model = MLLM(get_preset("tiny"))
    layouts = {"vision": Layout.parse("dp=8"), "llm": Layout.parse("dp=8")}
    with pytest.raises(LayoutError, match=r"^freeze names unknown part 'vsion'; use .*vision"):
        model.train_graph(layouts, freeze=["vsion"])
    with pytest.raises(LayoutError, match=r"^freeze names every part.*leave at least one"):
        model.train_graph(layouts, freeze=["vision", "projector", "llm"])
    with pytest.raises(ValueError, match="frozen names every module"):
        hetjax.ReferenceTrainer(
            model.loss_sum, {"llm": {}}, None, devices=jax.devices()[:1], frozen=["llm"]
        )
