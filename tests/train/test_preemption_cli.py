"""Preemption end to end: ``llava_train`` sent SIGTERM mid-run (as SLURM, Kubernetes or
a spot instance would) saves at the next step boundary, exits 0, and the same command
resumes to the uninterrupted run's losses bit for bit (FP32).

The runs are the checkpoint CLI tests' (``tiny``, ``--global-batch 16 --microbatches 2``,
8 steps on 8 simulated CPU devices), so their programs come from the shared cache.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

from tests.launch import check_ok, finish, rows, start_train

RUN = ["--steps", "8", "--global-batch", "16", "--microbatches", "2"]


def _logged(path: Path) -> int:
    text = path.read_text() if path.exists() else ""
    return sum(1 for line in text.splitlines(keepends=True) if line.endswith("\n"))


def test_sigterm_saves_exits_0_and_the_same_command_resumes_bit_exactly(tmp_path):
    ckpt, cut, whole = tmp_path / "ckpt", tmp_path / "cut.jsonl", tmp_path / "whole.jsonl"
    reference = start_train([*RUN, "--metrics", str(whole)])
    run = [*RUN, "--checkpoint-dir", str(ckpt), "--metrics", str(cut)]
    proc = start_train(run)
    deadline = time.monotonic() + 600
    while _logged(cut) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # after step 2 is logged: mid-run
    stopped = finish({"cut": proc, "reference": reference})
    result = stopped["cut"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    found = re.findall(r"preempted: saved the state after step (\d+)", result.stdout)
    assert len(found) == 1, result.stdout[-3000:]
    saved = int(found[0])
    assert 2 <= saved < 8 and (ckpt / str(saved)).is_dir()
    assert max(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == saved

    resumed = finish({"resumed": start_train(run)})["resumed"]
    check_ok(resumed)
    assert f"resumed from step {saved} " in resumed.stdout
    losses = {r["step"]: r["loss"] for r in rows(cut)}  # the resumed run's rows win
    check_ok(stopped["reference"])
    want = {r["step"]: r["loss"] for r in rows(whole)}
    assert sorted(losses) == list(range(8))
    assert losses == want, json.dumps({"resumed": losses, "reference": want})
