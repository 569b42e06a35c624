"""``python -m experiments.bench_freeze --quick``, run in the test process: the JSON
rows, their FLOP ratios within 5% of the 3x / 2x / 1x rule with recompute, and no
optimizer state for frozen parts (the benchmark itself exits non-zero otherwise)."""

import pytest

from tests.runtime.benchmarks import quick_rows

KEYS = {
    "freeze",
    "compiled_flops_per_step",
    "flops_ratio_vs_full",
    "expected_ratio",
    "opt_state_bytes",
    "peak_bytes_per_stage",
    "step_time_s",
}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return quick_rows("bench_freeze", tmp_path_factory.mktemp("bench_freeze"))


@pytest.mark.slow
def test_freezing_saves_flops_and_optimizer_state(rows):
    assert [r["freeze"] for r in rows] == ["none", "vision", "vision,llm"]
    for row in rows:
        assert KEYS <= row.keys(), KEYS - row.keys()
        assert abs(row["flops_ratio_vs_full"] / row["expected_ratio"] - 1) <= 0.05, row
    full, stage2, stage1 = rows
    assert full["opt_state_bytes"] > stage2["opt_state_bytes"] > stage1["opt_state_bytes"]
    assert full["compiled_flops_per_step"] > stage2["compiled_flops_per_step"]
    assert stage2["compiled_flops_per_step"] > stage1["compiled_flops_per_step"]
    # The frozen encoder's first stage runs forward only.
    assert "vision/0" in full["backward_stages"] and "vision/0" not in stage1["backward_stages"]
