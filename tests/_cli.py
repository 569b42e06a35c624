"""Running ``python -m experiments.llava_train`` in subprocesses, for the CLI tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300


def start(args, env_extra=None) -> subprocess.Popen:
    """Starts the main job with ``args`` (the test process's environment plus ``env_extra``)."""
    return subprocess.Popen(
        [sys.executable, "-m", "experiments.llava_train", *args],
        cwd=ROOT,
        env={**os.environ, **(env_extra or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(procs: dict[str, subprocess.Popen]) -> dict[str, subprocess.CompletedProcess]:
    """Waits for each started run (killed after ``TIMEOUT_S``); name -> its result."""
    out = {}
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        out[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return out


def check_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def rows(path: Path) -> list[dict]:
    """The rows of a metrics JSONL file (none if it was never written)."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines()]
