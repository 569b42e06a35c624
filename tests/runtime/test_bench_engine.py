"""``python -m experiments.bench_engine --quick`` in a subprocess: a row of every kind
the full run has (each placement and policy, both cp rows, the dispatch row, the
2-process row), the JSON rows' keys, and that ``full`` runs more FLOPs than ``none``
against the same fused reference (the subprocess itself exits non-zero unless ``none``
is within 2% of the reference), that the cp rows reduce parameter gradients over cp once
per step, the negligible-compute dispatch-overhead row and the 2-process compile counts
of the same run."""

import pytest

from tests.distributed.own_compiles import check_each_process_compiles_only_its_own_stages
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
    # Its own process: slower in the test process (36.9 s against 35.6 s, medians).
    return quick_rows("bench_engine", tmp_path_factory.mktemp("bench_engine"), own_process=True)


def policy_rows(rows):
    return [r for r in rows if "flops_ratio" in r]


@pytest.mark.slow
def test_every_placement_and_policy_runs(rows):
    rows = [r for r in policy_rows(rows) if "cp_grad_reductions_per_step" not in r]
    assert {r["placement"] for r in rows} == {"colocated", "non-colocated", "homogeneous"}
    assert {r["recompute"] for r in rows} == {"none", "selective", "full"}
    for row in rows:
        assert KEYS <= row.keys(), KEYS - row.keys()
        assert row["flops_ratio"] > 0 and row["peak_stash_bytes_per_stage"], row


@pytest.mark.slow
def test_recompute_policies_cost_what_they_replay(rows):
    rows = policy_rows(rows)
    cp_rows = [r for r in rows if "cp_grad_reductions_per_step" in r]
    assert [r["layouts"]["llm"] for r in cp_rows] == ["dp=2,cp=2,pp=2", "cp=2,tp=2,pp=2"]
    assert [r["cp_grad_reductions_per_step"] for r in cp_rows] == [1, 1]  # once per step
    by = {r["recompute"]: r for r in rows if r["placement"] == "non-colocated"}
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


@pytest.mark.slow
def test_two_process_row(rows):
    (row,) = [r for r in rows if "programs_compiled_per_process" in r]
    assert row["processes"] == 2 and row["stages_per_process"] == [["vision/0"], ["llm/0", "llm/1"]]
    per, one = row["programs_compiled_per_process"], row["programs_compiled_single_process"]
    assert max(per) < one and sum(per) == one
    assert row["loss_max_rel_diff"] < 1e-5
    # The layout's own-stage compiles, as tests/distributed/test_own_compiles.py checks its
    # other layouts (this measurement runs once in the suite: here).
    check_each_process_compiles_only_its_own_stages(row["compile_counts"])
