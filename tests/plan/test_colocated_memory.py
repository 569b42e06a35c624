"""What a colocated plan's three-phase schedule holds beyond its stages: every
microbatch's encoder output, or the gradient returned for it, on the LLM's first stage."""

import pytest

from hetjax.meshes.layout import Layout
from hetjax.plan import ModulePlan, Plan, Workload, estimate
from hetjax.plan.memory import colocated_held_bytes
from hetjax.plan.parts import image_tokens
from models.config import paper_preset

CFG = paper_preset("vit-3b", "llm-70b", 8192)
WORK = Workload(64, 8192, images_per_sample=4)
LLM = ModulePlan(Layout(dp=2, tp=4, cp=2, pp=4), zero1=True)
ENC = ModulePlan(Layout(dp=64), zero1=True)


def test_first_stage_holds_the_encoder_outputs_not_in_flight():
    plan = Plan("colocated", ENC, LLM, 16)
    # a lane's 64 / 16 / 2 samples of 4 images per microbatch, half of each per CP rank
    lane = 64 / 16 / 2 * 4 * image_tokens(CFG) / 2 * CFG.llm.width * WORK.act_bytes
    assert colocated_held_bytes(CFG, plan, WORK) == pytest.approx((16 - 4) * lane)
    one = Plan("colocated", ENC, LLM, 4)  # every microbatch in flight: nothing waits
    assert colocated_held_bytes(CFG, one, WORK) == 0.0
    est = estimate(CFG, plan, WORK, "h100")
    vis, first, *rest = (s.memory.total for s in est.stages)
    peaks = [vis + first + colocated_held_bytes(CFG, plan, WORK)] + [vis + s for s in rest]
    assert est.peak_memory_bytes == pytest.approx(max(peaks))


@pytest.mark.parametrize("mode", ["homogeneous", "non-colocated"])
def test_other_modes_hold_nothing_more(mode):
    """Without the three phases the first stage takes each output as its microbatch
    comes (its stash counts it): the peak is the stages' own."""
    lay = Layout(dp=2, tp=4, cp=2) if mode == "homogeneous" else Layout(dp=8)
    enc = ModulePlan(lay, zero1=True)
    est = estimate(CFG, Plan(mode, enc, LLM, 16), WORK, "h100")
    nv = enc.layout.pp
    vis, llm = est.stages[:nv], est.stages[nv:]
    if mode == "homogeneous":
        groups = [sum(s.memory.total for s in vis) + llm[0].memory.total]
        groups += [s.memory.total for s in llm[1:]]
    else:
        groups = [s.memory.total for s in est.stages]
    assert est.peak_memory_bytes == pytest.approx(max(groups))
