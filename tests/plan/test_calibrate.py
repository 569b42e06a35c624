"""The efficiency fit recovers a known curve; bad samples get one line."""

import pytest

from hetjax.plan import get_profile
from hetjax.plan.calibrate import fit_line, fit_matmul


def test_fit_recovers_rate_and_knee():
    rate, knee = 5e9, 64.0
    samples = [(w, 2e9 * w, 2e9 * w * (w + knee) / (rate * w)) for w in (16, 64, 256, 1024)]
    fit = fit_matmul(samples)
    assert fit.tflops == pytest.approx(rate / 1e12) and fit.knee == pytest.approx(knee)
    assert fit.max_rel_error < 1e-9
    hw = fit.apply(get_profile("cpu"))
    assert hw.matmul_tflops(1e12) == pytest.approx(rate / 1e12)


def test_one_width_is_not_enough():
    with pytest.raises(ValueError, match="two different widths"):
        fit_matmul([(64, 1e9, 1.0), (64, 2e9, 2.0)])


def test_lines_fit_relative_error_so_small_buffers_set_the_fixed_cost():
    # the largest buffer 30% slower than the line (a burst of load): on absolute seconds
    # it alone would pull the intercept to 2.2e-4; on relative error the fixed cost holds
    truth = [(n, 3e-4 + n / 1e9) for n in (1e3, 1e4, 1e5, 1e6, 1e7)]
    truth[-1] = (1e7, truth[-1][1] * 1.3)
    assert fit_line(truth).fixed == pytest.approx(3e-4, rel=0.03)


def test_probes_keep_the_fastest_call_of_their_rounds(monkeypatch):
    import jax

    from experiments import calibrate

    monkeypatch.setattr(calibrate, "BLOCKS", ((8, 16, 32), (16, 8, 8)))
    monkeypatch.setattr(calibrate, "ATTENTION", ((2, 8, 2, 1, 4, True),))
    monkeypatch.setattr(calibrate, "SIZES", (16, 64))
    monkeypatch.setattr(calibrate, "MODEL_BLOCKS", ())
    probes = calibrate.Probes(jax.devices(), call_s=0.0)
    probes.time_once()
    # 2 block stacks and an attention (forward and backward programs each), axpys, sums,
    # chains
    assert probes.rounds == 1 and len(probes.times) == 12
    probes.times = [[3.0, 1.0, 2.0] for _ in probes.times]  # rounds 0, 1, 2
    points = probes.points()
    layers = calibrate.LAYERS
    assert points["blocks"] == [  # forward + backward: the fastest of each, summed
        (8.0, 16.0, 32.0, 12.0 * layers * 8 * 16 * 32, 12.0 * layers * 8 * (48 + 64), 2.0),
        (16.0, 8.0, 8.0, 12.0 * layers * 16 * 8 * 8, 12.0 * layers * 16 * (24 + 16), 2.0),
    ]
    assert points["attention"] == [(2, 8, 2, 1, 4, 2.0)]
    assert [s for _, s in points["elementwise"]] == [1.0, 1.0]
    assert [s for _, s in probes.points(start=2)["all_reduce"]] == [2.0, 2.0]  # a later group
    assert probes.points()["chained_all_reduces"] == [(1.0, 1.0), (33.0, 1.0)]


def test_latency_is_the_time_per_collective_a_program_issues():
    from experiments import calibrate

    points = {
        "blocks": [
            (w, w, 4 * w, 48.0 * w**3, 0.0, 1e-3 + 48.0 * w**3 / 1e10) for w in (8, 64, 512)
        ],
        "elementwise": [(n, 1e-4 + n / 1e9) for n in (1e3, 1e6)],
        "all_reduce": [(n, 2e-4 + n / 1e9) for n in (1e3, 1e6)],
        "chained_all_reduces": [(1.0, 2e-4 + 3e-5), (33.0, 2e-4 + 33 * 3e-5)],
    }
    hw, record = calibrate.micro_profile(points, 8)
    assert hw.latency_us == pytest.approx(30.0)  # not the program's set-up (200 us)
    assert record["points"]["blocks"] is points["blocks"] and hw.gpus_per_node == 8
    assert hw.peak_tflops == pytest.approx(0.01) and hw.matmul_knee == pytest.approx(0.0, abs=1e-6)


def test_block_points_leave_the_elementwise_bytes_to_the_memory_rate():
    from experiments import calibrate

    # 1 ms of matmuls at 10 GFLOP/s per block stack, plus its bytes at 1 GB/s
    blocks = [calibrate.block_point((t, d, f), 0.0) for t, d, f in ((16, 32, 64), (256, 512, 768))]
    blocks = [(*b[:5], b[3] / 1e10 + b[4] / 1e9) for b in blocks]
    assert calibrate.matmul_points(blocks, 1e9) == [
        (16.0, blocks[0][3], pytest.approx(blocks[0][3] / 1e10)),
        (256.0, blocks[1][3], pytest.approx(blocks[1][3] / 1e10)),
    ]


def test_score_passes_are_what_plain_attention_costs_beyond_its_matmuls():
    import dataclasses

    from experiments import calibrate
    from hetjax.plan.stage import attention_kernel

    hw = dataclasses.replace(get_profile("cpu"), score_passes=4.0)
    points = []
    for b, l, h, g, k in ((2, 64, 8, 4, 8), (8, 64, 8, 4, 8), (1, 128, 8, 4, 64)):
        matmuls = 12.0 * b * l * l * h * k / attention_kernel(hw, 4, k, b * l)[0]
        scores = hw.memory_seconds(3 * b * h * l * l * 4.0)
        points.append((b, l, h, g, k, 2 * 3e-4 + matmuls + 11.0 * scores))
    assert calibrate.score_passes(hw, points) == pytest.approx(11.0)


def test_block_terms_are_what_the_models_blocks_cost_beyond_their_priced_matmuls():
    import dataclasses

    from experiments import calibrate

    hw = dataclasses.replace(get_profile("cpu"), elementwise_scale=1.0, moe_buffer_passes=0.0)
    points = []
    for preset, part, n in calibrate.MODEL_BLOCKS:
        c = calibrate.model_block_parts(hw, preset, part, n)
        assert c["compute"] > 0 and c["elementwise"] > 0 and c["weights"] > 0
        assert (c["moe"] > 0) == (c["moe_launch"] > 0) == (preset == "tiny-moe")
        work = c["compute"] + c["scores"] + 3.0 * c["elementwise"] + 2.0 * c["moe"]
        work += 900.0 * c["moe_launch"] + 5.0 * c["weights"]
        points.append((preset, part, n, 2e-3 + work))
    coef, rows = calibrate.block_terms(hw, points)
    assert coef["elementwise"] == pytest.approx(3.0) and coef["moe"] == pytest.approx(2.0)
    assert coef["moe_launch"] == pytest.approx(900.0) and coef["weights"] == pytest.approx(5.0)
    assert coef["fixed_s"] == pytest.approx(2e-3)
    assert max(abs(r["error"]) for r in rows) < 1e-6


def test_host_costs_recover_dispatch_launch_and_the_fsdp_chain():
    """Steps priced with known host constants give them back: dispatch and launch from
    the rows without fsdp, then the fsdp chain's cost per collective from the fsdp row
    beside its twin (each row's planned calls recorded beside it); a load that slows both
    twins alike leaves the chain's cost as it was."""
    import dataclasses

    from experiments import calibrate
    from experiments import validate_plan as vp

    truth = dict(dispatch_us=150.0, launch_us=700.0, fsdp_call_us=80.0)
    hw = dataclasses.replace(get_profile("cpu"), **truth)
    rows, models = calibrate.dispatch_rows()
    assert [("fsdp" in r.llm) for r in rows] == [False, False, False, True]
    measured = [{"measured_step_s": vp.predict(r, hw, cfg=models[r.name])[0]} for r in rows]
    fits, out = calibrate.host_costs(get_profile("cpu"), measured)
    assert fits == pytest.approx(truth)
    assert [o["layout"] for o in out] == [r.name for r in rows]
    assert all(o["planned_calls"] > 0 for o in out)
    for twin in measured[2:]:  # the islands rows, 5 ms slower each
        twin["measured_step_s"] += 0.005
    fits, _ = calibrate.host_costs(get_profile("cpu"), measured)
    assert fits["fsdp_call_us"] == pytest.approx(truth["fsdp_call_us"])
