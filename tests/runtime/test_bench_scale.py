"""``python -m experiments.bench_scale --quick``, run in the test process: per-device state
bytes at the expected (whole / fsdp for the sharded parts), fsdp collective bytes within
10% of the ideal, the rebalanced encoder's image imbalance <= 1.1 on 0-6 images per
sample, and the frozen bf16 encoder holding half its float32 bytes (the benchmark itself
exits non-zero unless its goals hold)."""

import pytest

from experiments.bench_scale import backward_reads, fsdp_supported
from tests.runtime.benchmarks import quick_rows

KEYS = {"layout", "adds", "state_bytes_per_device", "state_bytes_expected"}
KEYS |= {"peak_bytes_per_stage", "step_time_s"}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return quick_rows("bench_scale", tmp_path_factory.mktemp("bench_scale"))


@pytest.mark.slow
def test_scale_rows(rows):
    for row in rows:
        assert KEYS <= row.keys(), KEYS - row.keys()
        assert abs(row["state_bytes_per_device"] / row["state_bytes_expected"] - 1) <= 0.05
    layouts = [r for r in rows if r["adds"] == "rebalance vision"]
    for row in layouts:
        assert row["imbalance_after"] <= 1.1 < row["imbalance_before"], row
        assert row["rebalance_bytes_per_step"] > 0
    fsdp = [r for r in rows if "fsdp_collective_bytes" in r]
    assert len(fsdp) == (1 if fsdp_supported() else 0)
    for row in fsdp:
        assert "fsdp=4" in row["layout"] and row["step_time_ratio_vs_no_fsdp"] > 0
        assert abs(row["fsdp_collective_bytes"] / row["fsdp_collective_bytes_ideal"] - 1) <= 0.1
        # Closer than the goal: all the ideal leaves out is the norm scales' backward gathers
        # (the backward keeps a product of the scale instead: 0.2% of the bytes).
        assert row["fsdp_collective_bytes"] <= row["fsdp_collective_bytes_ideal"]
        assert row["fsdp_collective_bytes"] >= 0.98 * row["fsdp_collective_bytes_ideal"]
        # The LLM's state is split over its 4 fsdp ranks: well under the dp=4 layout's.
        assert row["state_bytes_per_device"] < 0.75 * layouts[0]["state_bytes_per_device"]
    (frozen,) = [r for r in rows if r["adds"] == "freeze vision bf16"]
    assert frozen["frozen_bytes_per_device"] < 0.75 * frozen["frozen_bytes_per_device_f32"]
    assert frozen["state_bytes_per_device"] < layouts[0]["state_bytes_per_device"]


def test_the_ideal_gathers_for_the_backward_only_what_it_reads():
    """An embedding table (its gradient scatter-adds the cotangents), an added bias,
    position or class embedding, and a patch embedding whose input needs no gradient
    are not gathered again for the backward; kernels and norm scales are."""
    for path in (("pre", "table"), ("pre", "pos"), ("pre", "cls"), ("blocks", "up", "bias")):
        assert not backward_reads(path, input_grad=True)
    assert backward_reads(("blocks", "qkv", "kernel"), input_grad=False)
    assert backward_reads(("post", "norm", "scale"), input_grad=False)
    assert not backward_reads(("pre", "proj", "kernel"), input_grad=False)
    assert backward_reads(("pre", "proj", "kernel"), input_grad=True)
