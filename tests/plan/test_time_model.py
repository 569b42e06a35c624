"""The planner's time model (issue 33): host calls, element-wise bytes, attention kernels,
shared CPU devices, frozen modules; calibration as data (fits, profile files)."""

import dataclasses
import json
import os

import pytest

from experiments.plan import StepTimeCheck, hetjax_workload
from hetjax.meshes.layout import Layout
from hetjax.plan import ModulePlan, Plan, Workload, estimate, get_profile
from hetjax.plan.calibrate import fit_efficiencies, fit_line
from hetjax.plan.cost import calls
from hetjax.plan.hardware import PROFILE_DIR, load_profile, save_profile
from hetjax.plan.parts import encoder_shape, llm_shape
from hetjax.plan.stage import module_stages
from models.config import get_preset, paper_preset

TINY = get_preset("tiny")
WORK = hetjax_workload(16, TINY.seq_len, act_bytes=4)
PIPE = Plan("non-colocated", ModulePlan(Layout(dp=4)), ModulePlan(Layout(dp=2, pp=2)), 2)


def test_fit_line_recovers_fixed_cost_and_rate():
    line = fit_line([(n, 3e-5 + n / 2e9) for n in (1e4, 1e5, 1e6, 1e7)])
    assert line.fixed == pytest.approx(3e-5) and line.rate == pytest.approx(2e9)
    with pytest.raises(ValueError, match="two different sizes"):
        fit_line([(1.0, 1.0), (1.0, 2.0)])


def test_fit_efficiencies_recovers_the_profile_that_timed_the_programs():
    # single-device stages (what gpu_check times): compute, bytes and the rest add up
    cfg = paper_preset("vit-1b", "llm-14b", 4096)
    truth = dataclasses.replace(get_profile("h200"), matmul_efficiency=0.6, memory_efficiency=0.3)
    shapes = [(llm_shape(cfg, 4096, True), 1, cfg.llm.vocab), (encoder_shape(cfg), 16, 0)]
    shapes.append((llm_shape(cfg, 1024), 4, 0))

    def price(shape, samples, vocab):
        def run(hw):
            plan = ModulePlan(Layout())
            kw = dict(samples=samples, microbatches=1, live=[1], hw=hw, vocab=vocab)
            st = module_stages(shape, plan, **kw)[0]
            return st.forward_s + st.backward_s

        return run

    measured = [(price(*s)(truth), price(*s)) for s in shapes]
    fitted, errors = fit_efficiencies(get_profile("h200"), measured)
    assert fitted.matmul_efficiency == pytest.approx(0.6, rel=1e-6)
    assert fitted.memory_efficiency == pytest.approx(0.3, rel=1e-6)
    assert max(map(abs, errors)) < 1e-6


def test_calls_are_what_the_executor_dispatches():
    # per microbatch: vision F + send, B; llm/0 F + send, B + send back; llm/1 (the loss
    # stage) B + send back; per step 3 programs per stage: 2 x (2 + 1 + 2 + 2 + 2) + 9
    est = estimate(TINY, PIPE, WORK, "cpu")
    per = calls(PIPE, WORK, list(est.stages[:1]), list(est.stages[1:]))
    assert sum(2 * (f + b) + n for f, b, n in per) == 27
    frozen = dataclasses.replace(PIPE, vision=ModulePlan(Layout(dp=4), frozen=True))
    est = estimate(TINY, frozen, WORK, "cpu")
    per = calls(frozen, WORK, list(est.stages[:1]), list(est.stages[1:]))
    assert per[0] == (2, 0, 3) and per[1][1] == 1  # no backward, nothing sent back to it
    assert est.stages[0].backward_s == 0 and est.stages[0].memory.optimizer == 0


def test_shared_devices_add_host_calls_and_spread_work():
    hw = get_profile("cpu")
    base = estimate(TINY, PIPE, WORK, dataclasses.replace(hw, dispatch_us=0.0))
    slow = estimate(TINY, PIPE, WORK, dataclasses.replace(hw, dispatch_us=1000.0))
    assert slow.step_time_s - base.step_time_s == pytest.approx(27 * 1e-3)
    # no bubble on shared cores: the step is the devices' work over all of them
    work = sum(s.devices * 2 * (s.forward_s + s.backward_s + 2 * s.recv_s) for s in base.stages)
    work += sum(s.devices * (s.reduce_s + s.optimizer_s) for s in base.stages)
    assert base.step_time_s >= work / 8
    dedicated = estimate(TINY, PIPE, WORK, dataclasses.replace(hw, shared_compute=False))
    assert dedicated.step_time_s > base.step_time_s  # a pipeline with bubbles


def test_fused_attention_only_for_bf16_on_a_device_that_has_it():
    cfg = paper_preset("vit-1b", "llm-14b", 8192)
    hw = get_profile("h200")
    plan = Plan("colocated", ModulePlan(Layout(dp=8)), ModulePlan(Layout(dp=8)), 1)
    plain = dataclasses.replace(hw, fused_attention_efficiency=0.0)
    work = Workload(8, 8192, 4)
    assert hw.fused_attention(2) and not hw.fused_attention(4) and not plain.fused_attention(2)
    assert estimate(cfg, plan, work, hw).step_time_s < estimate(cfg, plan, work, plain).step_time_s


def test_profiles_are_files_that_say_what_they_were_fitted_on(tmp_path):
    for name in ("cpu", "h200", "h100"):
        path = os.path.join(PROFILE_DIR, f"{name}.json")
        with open(path) as f:
            on = json.load(f)["fitted_on"]
        assert load_profile(path) == get_profile(name)
        assert {"date", "jax", "machine", "devices"} <= set(on)
    path = str(tmp_path / "p.json")
    save_profile(get_profile("cpu"), path, {"machine": "test"})
    assert load_profile(path) == get_profile("cpu")
    with open(path) as f:
        data = json.load(f)
    data["profile"]["warp_drive"] = 1.0
    with open(path, "w") as f:
        json.dump(data, f)
    with pytest.raises(ValueError, match="unknown profile fields") as err:
        load_profile(path)
    assert "\n" not in str(err.value)


def test_layout_auto_prints_predicted_against_measured():
    lines = []
    check = StepTimeCheck(0.2, lines.append)
    check.on_end([{"step_time_s": 9.0}, {"step_time_s": 0.25}, {"step_time_s": 0.15}])
    assert lines == [
        "--layout auto: predicted step 0.2 s, measured 0.2 s (median of 2 steps after the "
        "first): +0%"
    ]


def test_validate_plan_quick_counts_the_calls_it_plans(tmp_path):
    from experiments import validate_plan as vp

    path = tmp_path / "v.json"
    out = vp.main(vp.ValidateConfig(quick=True, steps=3, json=str(path)))
    assert json.loads(path.read_text())["summary"] == out["summary"]
    (row,) = out["rows"]
    assert {"layout", "predicted_step_s", "measured_step_s", "error"} <= set(row)
    assert 0 < row["predicted_step_s"] < 1e3 and 0 < row["measured_step_s"] < 1e3
    assert row["measured_calls"] == row["predicted_calls"]  # what the executor dispatched
    assert out["summary"]["kendall_tau"] == 1.0 and out["summary"]["rows"] == 1
    assert vp.kendall_tau([1, 2, 3], [3, 2, 1]) == -1.0


def test_collectives_hide_behind_compute_only_on_devices_with_their_own_links():
    from hetjax.plan.stage import exposed

    cpu, gpu = get_profile("cpu"), get_profile("h100")
    assert exposed(3.0, 2.0, cpu) == 3.0  # XLA:CPU: the cores copy the buffers themselves
    assert exposed(3.0, 2.0, gpu) == 1.0 and exposed(1.0, 2.0, gpu) == 0.0
    # the colocated dp=8 step's gradient all-reduce, smaller than its backward, costs whole
    plan = Plan("colocated", ModulePlan(Layout(dp=8)), ModulePlan(Layout(dp=8)), 1)
    for st in estimate(TINY, plan, WORK, cpu).stages:
        assert 0 < st.reduce_s < st.backward_s
