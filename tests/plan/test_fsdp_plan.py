"""The cost model prices fsdp: state / fsdp per device, per-microbatch gathers and
reduce-scatters of the weights, the batch split over dp x fsdp; the search offers the
LLM's fsdp degrees by default (``search(..., fsdp=False)``: dp only), never in the paper's
stock baseline."""

import dataclasses

import pytest

from hetjax.meshes.layout import Layout
from hetjax.plan import ModulePlan, Plan, Workload, estimate, get_profile
from hetjax.plan.search import llm_layouts, search
from models.config import get_preset, paper_preset

CFG = paper_preset("vit-3b", "llm-70b", 8192)
WORK = Workload(64, 8192, images_per_sample=4)
M = 8


def llm_stages(llm: Layout):
    plan = Plan("colocated", ModulePlan(Layout(dp=64)), ModulePlan(llm), M)
    return [
        s for s in estimate(CFG, plan, WORK, "h100", simulate=False).stages if s.module == "llm"
    ]


def test_fsdp_splits_the_state_and_gathers_the_weights_per_microbatch():
    dp = llm_stages(Layout(dp=8, tp=8))[0]  # the same devices and data ranks, fsdp folded into dp
    fsdp = llm_stages(Layout(dp=2, fsdp=4, tp=8))[0]
    assert fsdp.devices == dp.devices == 64
    for part in ("weights", "grads", "optimizer"):
        assert getattr(fsdp.memory, part) == pytest.approx(getattr(dp.memory, part) / 4)
    assert fsdp.memory.activations == pytest.approx(dp.memory.activations)  # same batch split
    held = dp.memory.grads  # the stage's float32 weights per device without fsdp
    # Beyond sequence parallelism's gathers and reduce-scatters (the same in both):
    added = {
        (pass_, kind): getattr(fsdp, f"{pass_}_comm")[kind] - getattr(dp, f"{pass_}_comm")[kind]
        for pass_, kind in (
            ("forward", "all-gather"),
            ("backward", "all-gather"),
            ("backward", "reduce-scatter"),
        )
    }
    assert added == pytest.approx(dict.fromkeys(added, held))
    # The once-per-step reduction is over the remaining dp, of 1 / fsdp of the gradients.
    assert fsdp.step_comm["all-reduce"] == pytest.approx(dp.step_comm["all-reduce"] / 4)
    assert fsdp.flops == pytest.approx(dp.flops)


def test_batch_must_split_over_dp_times_fsdp():
    with pytest.raises(ValueError, match=r"llm: dp\*fsdp=64 must divide the 8 samples"):
        llm_stages(Layout(dp=8, fsdp=8))


def test_search_offers_fsdp_shares_of_the_data_ranks():
    tiny, work, hw = get_preset("tiny"), Workload(8, 64, 1, act_bytes=4), get_profile("cpu")
    plain = llm_layouts(tiny, 8, work, hw, fsdp=False)
    both = llm_layouts(tiny, 8, work, hw)
    assert set(plain) < set(both) and all(lay.fsdp == 1 for lay in plain)
    folded = {dataclasses.replace(lay, dp=lay.data_ranks, fsdp=1) for lay in both}
    assert folded == set(plain)  # fsdp only re-splits the data ranks of a plain layout
    assert {lay.fsdp for lay in both} == {1, 2, 4, 8}
    without = search(tiny, 8, work, hw, fsdp=False)
    found = search(tiny, 8, work, hw)
    assert found.best.step_time_s <= without.best.step_time_s


def test_fsdp_by_default_but_not_in_the_stock_baseline():
    """At 8 H100s the planner's 14B LLM takes fsdp (faster and leaner than its best plan
    without); the paper's baseline, Megatron's stock layout, stays without."""
    cfg, work = paper_preset("vit-1b", "llm-14b", 8192), Workload(16, 8192, 4)
    without = search(cfg, 8, work, "h100", fsdp=False)
    found = search(cfg, 8, work, "h100")
    assert found.best.plan.llm.layout.fsdp > 1
    assert found.best.step_time_s < without.best.step_time_s
    # The colocated encoder may take the LLM's share: never slower than the homogeneous.
    assert found.best.step_time_s <= found.homogeneous.step_time_s
    assert found.stock.plan.llm.layout.fsdp == 1
    assert found.stock.step_time_s == pytest.approx(without.stock.step_time_s)
