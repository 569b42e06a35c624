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

    monkeypatch.setattr(calibrate, "WIDTHS", (8, 16))
    monkeypatch.setattr(calibrate, "SIZES", (16, 64))
    probes = calibrate.Probes(jax.devices(), call_s=0.0)
    probes.time_once()
    assert probes.rounds == 1 and len(probes.times) == 8  # 2 matmuls, axpys, sums, chains
    probes.times = [[3.0, 1.0, 2.0] for _ in probes.times]  # rounds 0, 1, 2
    points = probes.points()
    assert points["matmul"] == [
        (8.0, 6.0 * calibrate.TOKENS * 64, 1.0),
        (16.0, 6.0 * calibrate.TOKENS * 256, 1.0),
    ]
    assert [s for _, s in points["elementwise"]] == [1.0, 1.0]
    assert [s for _, s in probes.points(start=2)["all_reduce"]] == [2.0, 2.0]  # a later group
    assert probes.points()["chained_all_reduces"] == [(1.0, 1.0), (33.0, 1.0)]


def test_latency_is_the_time_per_collective_a_program_issues():
    from experiments import calibrate

    points = {
        "matmul": [(w, 6.0 * w * w, 1e-3 + 6.0 * w * w / 1e10) for w in (8, 64, 512)],
        "elementwise": [(n, 1e-4 + n / 1e9) for n in (1e3, 1e6)],
        "all_reduce": [(n, 2e-4 + n / 1e9) for n in (1e3, 1e6)],
        "chained_all_reduces": [(1.0, 2e-4 + 3e-5), (33.0, 2e-4 + 33 * 3e-5)],
    }
    hw, record = calibrate.micro_profile(points, 8)
    assert hw.latency_us == pytest.approx(30.0)  # not the program's set-up (200 us)
    assert record["points"] is points and hw.gpus_per_node == 8
