"""The cost model: closed form vs simulator, memory per saver, topology, schedules."""

import dataclasses

import pytest

from hetjax import schedules as hs
from hetjax.meshes.layout import Layout
from hetjax.plan import ModulePlan, Plan, Workload, estimate, get_profile, homogeneous
from hetjax.plan.comm import crosses_nodes
from hetjax.plan.parts import encoder_shape, llm_shape
from models.config import paper_preset

CFG = paper_preset("vit-3b", "llm-70b", 8192)
WORK = Workload(64, 8192, images_per_sample=4)
LLM = ModulePlan(Layout(dp=2, tp=8, pp=4), zero1=True)


def test_shapes_reuse_the_models_counts():
    llm = llm_shape(CFG, 8192)
    assert llm.params == pytest.approx(CFG.num_params()["llm"])
    total = llm.depth * llm.layer_flops + llm.last_flops
    assert total == pytest.approx(CFG.forward_flops(1, 8192, 8192)["llm"])
    enc = encoder_shape(CFG)
    assert enc.params == pytest.approx(CFG.num_params()["vision"] + CFG.num_params()["projector"])


@pytest.mark.parametrize("mode", ["homogeneous", "colocated", "non-colocated"])
def test_closed_form_tracks_the_simulator(mode):
    if mode == "homogeneous":
        plan = homogeneous(LLM, 16)
    elif mode == "colocated":
        plan = Plan(mode, ModulePlan(Layout(dp=64)), LLM, 16)
    else:
        plan = Plan(mode, ModulePlan(Layout(dp=8, pp=2)), LLM, 16)
    sim = estimate(CFG, plan, WORK, "h100")
    closed = estimate(CFG, plan, WORK, "h100", simulate=False)
    assert sim.simulated and not closed.simulated
    assert closed.step_time_s == pytest.approx(sim.step_time_s, rel=0.02)
    assert sim.tokens_per_s == pytest.approx(WORK.tokens / sim.step_time_s)


def test_simulated_step_within_the_1f1b_bounds():
    # 1F1B with P stages and M microbatches: at least M x the slowest stage's F + B, at
    # most (M + P - 1) x it (plus transfers, the encoder on stage 0 and the step's end).
    m = 16
    est = estimate(CFG, homogeneous(ModulePlan(Layout(dp=2, tp=8, pp=4)), m), WORK, "h100")
    assert [s.module for s in est.stages] == ["vision"] + ["llm"] * 4
    enc, llm = est.stages[0], est.stages[1:]
    per = [s.forward_s + s.backward_s + 2 * s.recv_s for s in llm]
    per[0] += enc.forward_s + enc.backward_s
    end = max(s.reduce_s + s.optimizer_s for s in llm) + enc.reduce_s + enc.optimizer_s
    assert m * max(per) <= est.step_time_s <= (m + len(llm) - 1) * max(per) + end


def test_memory_savers_lower_memory():
    base = estimate(CFG, homogeneous(ModulePlan(Layout(dp=2, tp=8, pp=4)), 16), WORK, "h100")
    zero = estimate(CFG, homogeneous(LLM, 16), WORK, "h100")
    full = dataclasses.replace(LLM, recompute="full")
    rc = estimate(CFG, homogeneous(full, 16), WORK, "h100")
    assert zero.peak_memory_bytes < base.peak_memory_bytes
    assert rc.peak_memory_bytes < zero.peak_memory_bytes
    assert rc.step_time_s > zero.step_time_s  # recompute costs a forward


def test_colocated_encoder_stashes_every_microbatch():
    sched = hs.three_phase(["vision"], 4, 16)
    assert sched.max_live[0] == 16  # what the cost model's live count follows
    enc = ModulePlan(Layout(dp=64))
    one = estimate(CFG, Plan("colocated", enc, LLM, 16), WORK, "h100").stages[0]
    four = estimate(
        CFG, Plan("colocated", enc, LLM, 16), dataclasses.replace(WORK, global_batch=256), "h100"
    ).stages[0]
    assert four.memory.activations == pytest.approx(4 * one.memory.activations)


def test_topology():
    hw = get_profile("h100")
    assert not crosses_nodes(1, 8, hw) and crosses_nodes(8, 2, hw) and not crosses_nodes(8, 1, hw)
    slow = dataclasses.replace(hw, ib_gbps=5.0)
    plan = homogeneous(LLM, 16)
    assert estimate(CFG, plan, WORK, slow).step_time_s > estimate(CFG, plan, WORK, hw).step_time_s


@pytest.mark.parametrize(
    "plan, match",
    [
        (Plan("colocated", ModulePlan(Layout(dp=32)), LLM, 16), "must span"),
        (homogeneous(LLM, 3), "must divide global_batch"),
        (Plan("non-colocated", ModulePlan(Layout(dp=3)), LLM, 16), "dp=3 must divide"),
        (homogeneous(ModulePlan(Layout(dp=2, pp=128)), 16), "exceeds its 80 layers"),
    ],
)
def test_bad_plans_get_one_line(plan, match):
    with pytest.raises(ValueError, match=match) as err:
        estimate(CFG, plan, WORK, "h100")
    assert "\n" not in str(err.value)
