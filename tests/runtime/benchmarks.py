"""Running a benchmark the way a user does, for the benchmark tests."""

import json
from pathlib import Path

from tests import launch

TIMEOUT_S = 600


def quick_rows(module: str, out_dir: Path, *, own_process: bool = False) -> list[dict]:
    """``python -m experiments.<module> --quick --json``: the rows it writes. Fails with
    the end of its output unless it exits 0 (its own conditions hold).

    Runs in the test process (:func:`tests.launch.run_main`), or, with ``own_process``,
    in a subprocess (for a benchmark that is slower or flaky in the test process)."""
    out = out_dir / "rows.json"
    argv = ("--quick", "--json", str(out))
    if own_process:
        result = launch.run(f"experiments.{module}", *argv, timeout=TIMEOUT_S)
    else:
        result = launch.run_main(f"experiments.{module}", *argv)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text())
