"""``experiments.bench_bf16 --quick``, run once in-process on the test session's CPU
devices: the row's keys and types, float32 gradient accumulation and reduction, and the
goal's verdict (reported, never an exit code). The overlap of the 200-step curves is a
benchmark figure (README), not a test: it needs minutes."""

import contextlib
import io
import json

import jax
import pytest

from experiments.bench_bf16 import QUICK_STEPS, BenchConfig, ma_diff, main, moving_average
from hetjax import Layout
from tests import launch


def test_moving_average_difference():
    assert moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.5, 2.5, 3.5]
    assert ma_diff([1.0] * 12, [1.5] * 12) == 0.5


def test_bad_flags_are_one_line_errors():
    out = launch.run_main("experiments.bench_bf16", "--quick", "--steps", "2")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "moving-average window" in out.stderr


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """(the row in the JSON file, the printed summary) of one quick run."""
    path = tmp_path_factory.mktemp("bench_bf16") / "rows.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(BenchConfig(json=str(path), quick=True), devices=jax.devices())
    (row,) = json.loads(path.read_text())
    return row, out.getvalue()


def test_quick_run_reports_curves_and_fp32_reduction(quick):
    row, printed = quick
    assert row["quick"] is True and row["steps"] == QUICK_STEPS
    # the full run's kinds of program: a pipelined LLM (three-phase schedule), dp > 1
    llm = Layout.parse(row["layouts"]["llm"])
    assert llm.pp > 1 and llm.dp > 1
    # both layouts at both seeds; the seed is the run's (initialisation and data)
    assert set(row["losses"]) == {"hetero", "homo", "hetero_seed1", "homo_seed1"}
    assert row["seed_varied"].startswith("the run's seed")
    assert all(len(v) == row["steps"] for v in row["losses"].values())
    for key in ("ma_diff_hetero_vs_homo", "ma_diff_seed0_vs_seed1"):
        assert isinstance(row[key], float) and row[key] >= 0
    assert row["ma_diff_layout_by_seed"][0] == row["ma_diff_hetero_vs_homo"]
    assert row["ma_diff_seed_pairs"] == {"0-1": row["ma_diff_seed0_vs_seed1"]}
    layout, seeds = row["mean_ma_diff_layout"], row["mean_ma_diff_seed_pairs"]
    assert layout == sum(row["ma_diff_layout_by_seed"]) / 2
    assert row["overlap_over_seeds"] is (layout <= seeds)
    assert isinstance(row["overlap"], bool)
    assert row["fp32_accumulation"] is True
    assert row["grad_dtypes"]["bwd_accumulators"] == ["float32"]
    assert row["grad_dtypes"]["reduce_dp_collectives"] == ["f32"]
    # the verdict is reported either way: met exactly when nothing is listed as missed
    assert row["goal_met"] is (row["overlap"] and row["fp32_accumulation"])
    assert row["goal_met"] is not bool(row["goal_missed"])
    assert f"goal met: {row['goal_met']}" in printed
