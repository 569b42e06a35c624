"""``python -m experiments.bench_engine --quick`` in a subprocess: the JSON rows' keys,
and that ``full`` runs more FLOPs than ``none`` against the same fused reference (the
subprocess itself exits non-zero unless ``none`` is within 2% of the reference), that
the cp row reduces parameter gradients over cp once per step, and the negligible-compute
dispatch-overhead row of the same run."""

import pytest

from tests.runtime.benchmarks import quick_rows

KEYS = {
    "recompute",
    "placement",
    "flops_per_step",
    "reference_flops_per_step",
    "flops_ratio",
    "peak_stash_bytes_per_stage",
}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return quick_rows("bench_engine", tmp_path_factory.mktemp("bench_engine"))


def policy_rows(rows):
    return [r for r in rows if "dispatch_overhead_ratio" not in r]


@pytest.mark.slow
def test_recompute_policies_cost_what_they_replay(rows):
    rows = policy_rows(rows)
    cp_rows = [r for r in rows if "cp_grad_reductions_per_step" in r]
    assert [r["cp_grad_reductions_per_step"] for r in cp_rows] == [1]  # once per step
    by = {r["recompute"]: r for r in rows if r not in cp_rows}
    assert set(by) == {"none", "selective", "full"}
    for row in rows:
        assert KEYS <= row.keys(), KEYS - row.keys()
    assert by["full"]["flops_ratio"] > by["selective"]["flops_ratio"] > by["none"]["flops_ratio"]
    assert by["none"]["flops_ratio"] <= 1.02
    # Every trained stage but the loss stage keeps something for its backward.
    assert set(by["none"]["peak_stash_bytes_per_stage"]) == set(
        by["full"]["peak_stash_bytes_per_stage"]
    )


@pytest.mark.slow
def test_dispatch_overhead_row(rows):
    (row,) = [r for r in rows if "dispatch_overhead_ratio" in r]
    assert row["layouts"] == {"vision": "dp=4", "llm": "pp=4"} and row["microbatches"] == 8
    assert row["inflight_guard"]  # XLA:CPU in one process: the guard is on
    step, fused = row["dispatch_step_time_s"], row["fused_step_time_s"]
    assert row["dispatch_overhead_ratio"] == pytest.approx(step / fused)
    assert 0 < row["dispatch_host_time_s"] <= step
    assert row["dispatch_overhead_ratio_1device"] == pytest.approx(
        step / row["fused_1device_step_time_s"]
    )
