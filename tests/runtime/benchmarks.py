"""Running a benchmark the way a user does, for the benchmark tests."""

import json
from pathlib import Path

from tests import launch

TIMEOUT_S = 600


def quick_rows(module: str, out_dir: Path) -> list[dict]:
    """``python -m experiments.<module> --quick --json``: the rows it writes. Fails with
    the end of its output unless it exits 0 (its own conditions hold)."""
    out = out_dir / "rows.json"
    proc = launch.run(f"experiments.{module}", "--quick", "--json", str(out), timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())
