"""``python -m experiments.bench_executor --quick`` in a subprocess: JSON rows of every
placement and schedule the full run has, and the issue's three "done when" conditions
(no recompiles after step 1, one DP reduction per parameter per step, 1F1B's activation
bytes within (P - s) / M of GPipe's)."""

import pytest

from tests.runtime.benchmarks import quick_rows

KEYS = {
    "layout",
    "placement",
    "schedule",
    "microbatches",
    "step_time_s",
    "compiles_after_step1",
    "compiles_after_step5",
    "dp_reductions_per_param_per_step",
    "peak_activation_bytes_per_stage",
    "bubble_measured",
    "bubble_simulated",
    "dispatch_overhead_ratio",
}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    # Its own process: in the test process it was slower (28.2 s against 26.2 s) and once
    # failed (the bubble probe's wait_alive met a donated buffer: hetjax.inspect.probes).
    return quick_rows("bench_executor", tmp_path_factory.mktemp("bench_executor"), own_process=True)


@pytest.mark.slow
def test_rows_have_the_issue_keys(rows):
    assert len(rows) >= 4
    for row in rows:
        assert KEYS <= row.keys(), KEYS - row.keys()
        stages = len(row["stages"])
        for key in ("peak_activation_bytes_per_stage", "bubble_measured", "bubble_simulated"):
            assert len(row[key]) == stages, key
        assert row["step_time_s"] > 0 and row["dispatch_overhead_ratio"] > 0
        assert all(0.0 <= b <= 1.0 for b in row["bubble_simulated"])


@pytest.mark.slow
def test_every_placement_and_schedule_runs(rows):
    """The full run's row kinds, each measured (issue 34: the colocated rows crashed in
    the bubble measurement while the quick run had none of them)."""
    assert {(r["placement"], r["schedule"]) for r in rows} == {
        ("colocated", "1f1b"),
        ("non-colocated", "1f1b"),
        ("non-colocated", "gpipe"),
        ("homogeneous", "1f1b"),
        ("homogeneous", "gpipe"),
    }
    (colocated,) = [r for r in rows if r["placement"] == "colocated"]
    assert len(colocated["stages"]) == 3  # vision, llm stage 0, llm stage 1
    for row in rows:
        assert all(0.0 <= b <= 1.0 for b in row["bubble_measured"]), row
        assert all(b > 0 for b in row["peak_activation_bytes_per_stage"]), row


@pytest.mark.slow
def test_no_recompiles_after_step1(rows):
    for row in rows:
        assert row["compiles_after_step1"] > 0
        assert row["compiles_after_step5"] == row["compiles_after_step1"], row


@pytest.mark.slow
def test_one_dp_reduction_per_parameter_per_step(rows):
    assert {r["microbatches"] for r in rows} >= {2, 4}
    for row in rows:
        assert row["dp_reductions_per_param_per_step"] == 1, row
        assert row["dp_reductions_min"] == 1, row


@pytest.mark.slow
def test_1f1b_activation_bytes_within_bound(rows):
    gpipe = {
        (r["layout"], r["placement"], r["microbatches"]): r
        for r in rows
        if r["schedule"] == "gpipe"
    }
    checked = 0
    for row in rows:
        ref = gpipe.get((row["layout"], row["placement"], row["microbatches"]))
        if row["schedule"] != "1f1b" or ref is None:
            continue
        p, m = row["pipeline_depth"], row["microbatches"]
        pairs = zip(
            row["peak_activation_bytes_per_stage"],
            ref["peak_activation_bytes_per_stage"],
            row["stage_depths"],
            strict=True,
        )
        for mine, theirs, s in pairs:
            assert theirs > 0
            assert mine * m <= (p - s) * theirs, (row["stages"], mine, theirs, s)
        assert row["activation_bound"] == "PASS"
        checked += 1
    assert checked >= 2
