"""``python -m experiments.bench_bf16 --quick`` in a subprocess: the row's keys and
types, and float32 gradient accumulation and reduction (the subprocess exits non-zero
otherwise). The overlap of the 200-step curves is a benchmark figure (README), not a
test: it needs minutes."""

import pytest

from experiments.bench_bf16 import ma_diff, moving_average
from tests.runtime.benchmarks import quick_rows


def test_moving_average_difference():
    assert moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.5, 2.5, 3.5]
    assert ma_diff([1.0] * 12, [1.5] * 12) == 0.5


@pytest.mark.slow  # three executors compile: minutes on 2 loaded cores
def test_quick_run_reports_curves_and_fp32_reduction(tmp_path):
    (row,) = quick_rows("bench_bf16", tmp_path)
    assert set(row["losses"]) == {"hetero", "homo", "homo_seed1"}
    assert all(len(v) == row["steps"] for v in row["losses"].values())
    for key in ("ma_diff_hetero_vs_homo", "ma_diff_seed0_vs_seed1"):
        assert isinstance(row[key], float) and row[key] >= 0
    assert isinstance(row["overlap"], bool)
    assert row["fp32_accumulation"] is True
    assert row["grad_dtypes"]["bwd_accumulators"] == ["float32"]
    assert row["grad_dtypes"]["reduce_dp_collectives"] == ["f32"]
