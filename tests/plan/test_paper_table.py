"""experiments.paper_table on a small world: the issue's keys, both baselines, the regime,
the plot, and --sensitivity's hold fraction, spread and what-would-change note."""

import dataclasses
import json

import pytest

from experiments import paper_table as pt
from hetjax.plan import get_profile

KEYS = {"regime", "encoder", "llm", "seq_len", "gpus", "paper_gain_pct", "meets_paper"}
KEYS |= {"predicted_gain_pct", "predicted_gain_pct_best", "paper_mode", "chosen_mode"}
KEYS |= {"mode_hold_fraction", "gain_pct_min", "gain_pct_max", "perturbations"}


def test_rows_regime_sensitivity_and_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pt, "GPUS", 8)
    monkeypatch.setattr(pt, "ROWS", pt.ROWS[2:3])  # vit-1b + llm-14b at 8K
    monkeypatch.setattr(pt, "REGIME_LLM", "llm-14b")
    monkeypatch.setattr(pt, "SWEEP", ("vit-1b",))  # the row's pair: planned once
    monkeypatch.setattr(pt, "constants", lambda hw: ["matmul_knee"])
    monkeypatch.setattr(pt, "context_sweep", lambda gpu, b: [{"seq_len": 8192, "gain_pct": 1.0}])
    out = tmp_path / "t.json"
    png = tmp_path / "t.png"
    argv = ["--json", str(out), "--plot", str(png), "--sensitivity", "--workers", "1"]
    pt.main(pt.parse_args(argv))
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert KEYS <= set(row) and row["gpus"] == 8
    assert row["chosen_mode"] in ("colocated", "non-colocated")
    r = pt.plan_pair("vit-1b", "llm-14b", 8192, get_profile("h100"))
    assert row["predicted_gain_pct"] == round(r.gain("paper"), 2)
    assert row["predicted_gain_pct_best"] == round(r.gain("best"), 2)
    assert row["predicted_gain_pct"] >= row["predicted_gain_pct_best"]
    # Each perturbation is the planner's answer for that profile, and the row's summary.
    runs = row["perturbations"]
    assert [(p["constant"], p["scale"]) for p in runs] == [
        ("matmul_knee", 0.8),
        ("matmul_knee", 1.2),
    ]
    hw = get_profile("h100")
    for p in runs:
        knee = pt.summary("vit-1b", "llm-14b", 8192, pt.scaled(hw, "matmul_knee", p["scale"]))
        assert p["gain_pct"] == knee["gain_pct"] and p["mode"] == knee["mode"]
    assert row["mode_hold_fraction"] == sum(p["mode"] == "colocated" for p in runs) / 2
    assert row["gain_pct_min"] == min(p["gain_pct"] for p in runs)
    assert row["gain_pct_max"] == max(p["gain_pct"] for p in runs)
    assert ("note" in row) == (not row["meets_paper"])
    assert [s["encoder"] for s in data["regime"]["sweep"]] == ["vit-1b"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "regime boundary" in printed and "settings:" in printed and "mode held" in printed


def test_constants_are_every_nonzero_float_and_scaling_renames():
    hw = get_profile("h100")
    names = pt.constants(hw)
    assert {"peak_tflops", "matmul_knee", "ib_gbps", "hbm_gib"} <= set(names)
    assert "gpus_per_node" not in names and "name" not in names
    knee = pt.scaled(hw, "matmul_knee", 1.2)
    assert knee.matmul_knee == pytest.approx(1.2 * hw.matmul_knee)
    assert knee.name == "h100:matmul_kneex1.2"
    assert dataclasses.replace(knee, name="h100", matmul_knee=hw.matmul_knee) == hw


def test_what_would_change_finds_the_smallest_factor(monkeypatch):
    """On a planner whose gain is linear in the knee and whose mode flips when InfiniBand
    slows: the note names the knee and the factor that meets the paper."""
    base = get_profile("h100")

    def fake(enc, llm, seq, hw, baseline="paper", gpus=None):
        gain = 10.0 * hw.matmul_knee / base.matmul_knee
        mode = "colocated" if hw.ib_gbps >= base.ib_gbps else "non-colocated"
        return {"mode": mode, "gain_pct": gain, "mode_gain_pct": {"colocated": gain}}

    monkeypatch.setattr(pt, "summary", fake)
    row = {"encoder": "vit-1b", "llm": "llm-14b", "seq_len": 8192, "paper_gain_pct": 21.6}
    row |= {"paper_mode": "colocated", "chosen_mode": "colocated", "meets_paper": False}
    pt.sensitivity([row], base, "paper", workers=1)
    n = len(pt.constants(base))
    assert row["mode_hold_fraction"] == pytest.approx((2 * n - 1) / (2 * n))
    assert (row["gain_pct_min"], row["gain_pct_max"]) == pytest.approx((8.0, 12.0))
    # 10 + 10 (f - 1) = 21.6 at f = 2.16: knee 96 -> 207.
    assert row["note"] == "+21.6% needs matmul_knee x2.16 (96 -> 207): then colocated, +21.6%"
    # A gain that jumps (a layout switch) is no line: the planned check says so.
    monkeypatch.setattr(pt, "summary", lambda *a, **k: fake(*a, **k) | {"gain_pct": 10.0})
    assert pt.what_would_change(row, row["perturbations"], base, "paper") == (
        "no single hardware constant within x0.25-x4 reaches +21.6% (extrapolated, planned: "
        "matmul_knee x2.16 (96 -> 207) gives colocated, +10.0%)"
    )
