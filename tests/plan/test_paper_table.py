"""experiments.paper_table on a small world: the issue's keys, the regime, the plot."""

import json

from experiments import paper_table as pt

KEYS = {"regime", "encoder", "llm", "seq_len", "gpus", "paper_gain_pct"}
KEYS |= {"predicted_gain_pct", "paper_mode", "chosen_mode"}


def test_rows_regime_and_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pt, "GPUS", 16)
    monkeypatch.setattr(pt, "ROWS", pt.ROWS[2:3])  # vit-1b + llm-14b at 8K
    monkeypatch.setattr(pt, "REGIME_LLM", "llm-14b")
    monkeypatch.setattr(pt, "SWEEP", ("vit-1b", "vit-3b"))
    monkeypatch.setattr(pt, "context_sweep", lambda gpu: [{"seq_len": 8192, "gain_pct": 1.0}])
    out = tmp_path / "t.json"
    png = tmp_path / "t.png"
    pt.main(pt.parse_args(["--json", str(out), "--plot", str(png)]))
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert KEYS <= set(row) and row["gpus"] == 16
    assert row["chosen_mode"] in ("colocated", "non-colocated")
    assert [s["encoder"] for s in data["regime"]["sweep"]] == ["vit-1b", "vit-3b"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "regime boundary" in printed and "settings:" in printed
