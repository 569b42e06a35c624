"""The planner prices every activation policy of :mod:`hetjax.recompute` as the engine
runs it: ``none`` replays nothing, ``selective`` the attention core (with its CP ring)
and MoE experts (with their all-to-alls) and keeps the weight matmuls' outputs, ``full``
the whole forward from each layer's input."""

import dataclasses

import pytest

from hetjax.meshes.layout import Layout
from hetjax.plan import ModulePlan, get_profile
from hetjax.plan.memory import BF16, activation_bytes_per_token, selective_bytes_per_token
from hetjax.plan.parts import llm_shape
from hetjax.plan.search import SAVERS
from hetjax.plan.stage import attention_kernel, module_stages
from hetjax.recompute import RECOMPUTE_POLICIES
from models.config import get_preset, paper_preset

CFG = paper_preset("vit-3b", "llm-70b", 8192)
H100 = get_profile("h100")


def stages(shape, layout, policy, **kw):
    plan, live = ModulePlan(layout, recompute=policy), [4] * layout.pp
    return module_stages(shape, plan, samples=8, microbatches=4, live=live, hw=H100, **kw)


def by_policy(shape, layout, stage=0, **kw):
    return {p: stages(shape, layout, p, **kw)[stage] for p in RECOMPUTE_POLICIES}


def test_the_search_tries_every_policy():
    assert {s["recompute"] for s in SAVERS} == set(RECOMPUTE_POLICIES)
    assert str(ModulePlan(Layout(tp=2), recompute="selective")) == "tp=2,recompute=selective"


def test_selective_keeps_the_weight_matmuls_outputs():
    # A GPT block (Q = KV = D, F = 4 D, GELU: up only): Q + 2 KV + F + 2 D = 9 D elements
    # per token, against 16 D (32 D bytes) without recompute.
    s = dataclasses.replace(llm_shape(CFG, 8192), q_width=64, kv_width=64, mlp=256, mlp_mats=2)
    s = dataclasses.replace(s, width=64)
    assert selective_bytes_per_token(s) == 9 * 64 * BF16
    assert activation_bytes_per_token(s) == 16 * 64 * BF16
    # TP splits the column-parallel outputs; the two output projections only with SP.
    assert selective_bytes_per_token(s, 4) == 9 * 64 * BF16 / 4
    assert selective_bytes_per_token(s, 4, sp=False) == (7 * 64 / 4 + 2 * 64) * BF16


def test_policies_trade_time_for_memory_dense():
    shape = llm_shape(CFG, 8192)
    st = by_policy(shape, Layout(tp=8, pp=4), vocab=CFG.llm.vocab)
    none, sel, full = (st[p] for p in ("none", "selective", "full"))
    assert none.forward_s == sel.forward_s == full.forward_s
    assert none.backward_s < sel.backward_s < full.backward_s
    assert none.memory.activations > sel.memory.activations > full.memory.activations
    # Selective's extra backward is the attention core: its FLOPs at its kernel's rate and
    # the score matrix's bytes where the kernel is plain (a middle stage without TP).
    mid = by_policy(shape, Layout(pp=4), stage=1, vocab=CFG.llm.vocab)
    tokens, layers = 8 * shape.tokens, shape.depth // 4
    rate, passes = attention_kernel(H100, BF16, shape.q_width / shape.heads, tokens)
    scores = tokens * layers * passes * shape.heads * shape.tokens * BF16
    core = 8 * layers * shape.attention_flops / rate + H100.memory_seconds(scores)
    extra = mid["selective"].backward_s - mid["none"].backward_s
    assert extra == pytest.approx(core)
    assert mid["full"].backward_s - mid["none"].backward_s == pytest.approx(mid["none"].forward_s)
    # No TP collective runs again (only full replays the forward's).
    assert sel.comm == none.comm
    assert full.comm["all-gather"] == pytest.approx(
        none.comm["all-gather"] + 4 * none.forward_comm["all-gather"]
    )


def test_selective_replays_the_cp_ring_and_moe_all_to_alls():
    shape = llm_shape(CFG, 8192)
    st = by_policy(shape, Layout(tp=8, cp=2, pp=4), vocab=CFG.llm.vocab)
    ring = 4 * st["none"].forward_comm["collective-permute"]  # M microbatches
    assert ring > 0
    for p, again in (("none", 0), ("selective", ring), ("full", ring)):
        assert st[p].comm["collective-permute"] == pytest.approx(
            st["none"].comm["collective-permute"] + again
        )

    moe = llm_shape(get_preset("tiny-moe"), 64)
    assert moe.experts > 1
    st = by_policy(moe, Layout(dp=2, ep=2), vocab=get_preset("tiny-moe").llm.vocab)
    a2a = 4 * st["none"].forward_comm["all-to-all"]
    assert a2a > 0
    assert st["selective"].comm["all-to-all"] == pytest.approx(st["none"].comm["all-to-all"] + a2a)
    # The experts' matmuls batch over experts, so selective keeps none of their outputs:
    # fewer bytes than a dense layer's selective count, and more backward than none's.
    assert st["selective"].backward_s > st["none"].backward_s
    dense = dataclasses.replace(moe, experts=1)
    assert selective_bytes_per_token(moe) < selective_bytes_per_token(dense)
