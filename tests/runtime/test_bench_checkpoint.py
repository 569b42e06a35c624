"""``python -m experiments.bench_checkpoint --quick`` in a subprocess: the JSON rows and
their goals (the checkpoint on disk no bigger than 1.1 x the raw parameter and optimizer
bytes, the restore exact; the blocking-time goal is the full run's, on ``small``)."""

import pytest

from tests.runtime.benchmarks import quick_rows

KEYS = {
    "layout",
    "save_blocking_s",
    "step_time_s",
    "save_total_s",
    "restore_s",
    "bytes_on_disk",
    "param_and_opt_bytes",
}
TIMES = ("save_blocking_s", "step_time_s", "save_total_s", "restore_s")


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    # Its own process: no faster in the test process (12.2 s against 12.1 s, medians).
    return quick_rows(
        "bench_checkpoint", tmp_path_factory.mktemp("bench_checkpoint"), own_process=True
    )


@pytest.mark.slow
def test_rows_have_the_keys(rows):
    assert [r["layout"] for r in rows] == ["colocated", "non-colocated", "pp2"]
    for row in rows:
        assert KEYS <= row.keys(), KEYS - row.keys()
        assert row["preset"] == "tiny"
        assert all(isinstance(row[k], float) and row[k] > 0 for k in TIMES), row


@pytest.mark.slow
def test_the_checkpoint_is_logical_and_exact(rows):
    raw = {r["param_and_opt_bytes"] for r in rows}
    assert len(raw) == 1  # the same model in every layout: the same logical arrays
    for row in rows:
        assert 0 < row["bytes_on_disk"] <= 1.1 * row["param_and_opt_bytes"], row
        assert row["restored_equal"] is True
