"""Checkpoints end to end: ``python -m experiments.llava_train --checkpoint-dir`` runs
that are killed, stopped, resumed, resumed in another layout, or given bad input. The
runs that are killed, and the one given a truncated checkpoint (which must be one line
however the process ends), are processes; the others run in the test process
(:func:`tests.launch.run_main`).

Every run is ``tiny`` with ``--global-batch 16 --microbatches 2`` for ``--steps 8`` on 8
simulated CPU devices. One uninterrupted run is the reference, and runs first; the runs
that a resume continues (killed after step 5 was logged, killed while a save was being
written, ended by ``--stop-after 5``) and the diverging ones come after it (the ones in
the test process while the killed ones' processes run), the resumes (one in another
layout) and the bad checkpoints after them. A resumed run in the same layout must give
the reference's losses bit for bit (FP32); in another layout at rtol 1e-5.

The metrics JSONL of a resumed run is appended to, numbered by global step: rows that
the killed run logged after its last complete checkpoint are written again by the
resumed run (with the same values), so a step number may appear twice in the file; the
last row of each step is the resumed run's.

Bad input must be one line with exit code 2 and leave the checkpoint directory as it
was; the ones that need no checkpoint must fail before anything compiles.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests import launch
from tests._xla import FUSION_EMITTERS
from tests.launch import check_ok as _check_ok
from tests.launch import finish as _finish
from tests.launch import rows as _rows
from tests.launch import start_train as _start

STEPS = 8
RUN = ["--steps", str(STEPS), "--global-batch", "16", "--microbatches", "2"]
# A learning rate that makes tiny's step 2 (the first after the 1-step warm-up from 0)
# produce NaN gradients in every module, at every later step too.
DIVERGE = ["--lr", "1e3", "--clip-norm", "0", "--save-every", "1"]
OTHER_LAYOUT = [
    "--placement",
    "non-colocated",
    "--island",
    "vision:4",
    "--island",
    "llm:4",
    "--layout",
    "vision:dp=4",
    "--layout",
    "llm:dp=1,tp=2,pp=2",
]
RESUMED = re.compile(r"resumed from step (\d+) \((.+)\)")
ERROR = "llava_train: error: "


def _logged(path: Path) -> list[int]:
    """The steps of the complete rows in a metrics file being written."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line)["step"] for line in text.splitlines(keepends=True) if line[-1] == "\n"]


def _complete(directory: Path) -> list[int]:
    """The steps of the finalised checkpoints in ``directory`` (orbax renames a step's
    temporary directory to the bare step number when its save is complete)."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def _unfinished(directory: Path) -> list[str]:
    try:
        return [n for n in os.listdir(directory) if "orbax-checkpoint-tmp" in n]
    except FileNotFoundError:
        return []


def _snapshot(directory: Path) -> dict[str, tuple[int, str]]:
    """Every file and folder under ``directory``: its size and content hash."""
    out = {}
    for p in sorted(directory.rglob("*")):
        rel = str(p.relative_to(directory))
        out[rel] = (-1, "") if p.is_dir() else (p.stat().st_size, _sha(p))
    return out


def _sha(p: Path) -> str:
    return hashlib.sha1(p.read_bytes()).hexdigest()


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in "tT"


def _kill_mid_save(proc, directory: Path) -> dict | None:
    """If a save into ``directory`` is under way (orbax's temporary directory is there)
    and an earlier one is complete: freezes the process (SIGSTOP; every thread, the
    background writer included, stops), and if the save is still unfinished, kills it
    (SIGKILL). Returns what the directory held at the kill; None if it let it go on."""
    unfinished = _unfinished(directory)
    if not unfinished or not _complete(directory):
        return None
    os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while not _stopped(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.001)
    unfinished, complete = _unfinished(directory), _complete(directory)
    if unfinished and complete:
        proc.kill()
        return {"unfinished": unfinished, "complete": complete}
    os.kill(proc.pid, signal.SIGCONT)
    return None


def _error_line(result) -> str:
    """The run's one error line (progress lines and library warnings may precede it)."""
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [l for l in result.stderr.splitlines() if l.startswith(ERROR)]
    assert len(errors) == 1, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1] == errors[0], result.stderr[-3000:]
    return errors[0]


def _resumed_from(result, directory: Path) -> int:
    found = RESUMED.findall(result.stdout)
    assert len(found) == 1, result.stdout[-3000:]
    step, path = found[0]
    assert Path(path) == directory.absolute() / step
    return int(step)


def _train(*args: str, log_compiles: bool = False) -> launch.Result:
    return launch.run_main(launch.TRAIN, *args, log_compiles=log_compiles)


def _kill_when_due(procs: dict, d: dict[str, Path], m: dict[str, Path], killed: dict) -> None:
    """Kills ``crash`` once it logged step 5, and ``midsave`` during a save (see
    :func:`_kill_mid_save`); what each left goes into ``killed``."""
    while len(killed) < 2 and any(procs[n].poll() is None for n in ("crash", "midsave")):
        crash = procs["crash"]
        if "crash" not in killed and any(s >= 5 for s in _logged(m["crash"])):
            crash.kill()  # SIGKILL
            crash.wait()
            killed["crash"] = {"rows": m["crash"].read_text(), "complete": _complete(d["crash"])}
        if "midsave" not in killed and procs["midsave"].poll() is None:
            got = _kill_mid_save(procs["midsave"], d["midsave"])
            if got is not None:
                procs["midsave"].wait()
                killed["midsave"] = got | {"rows": m["midsave"].read_text()}
        time.sleep(0.002)


def _losses(rows: list[dict]) -> dict[int, float]:
    """Step -> loss, the last row of each step winning (a resumed run's)."""
    return {r["step"]: r["loss"] for r in rows}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The reference, then two rounds: the runs that a resume continues (two of them
    processes that this fixture kills), then the resumes and the bad checkpoints."""
    tmp = tmp_path_factory.mktemp("ckpt_cli")
    d = {name: tmp / name for name in ("whole", "crash", "midsave", "stop5", "nonfinite", "skip")}
    m = {name: tmp / f"{name}.jsonl" for name in (*d, "relayout")}
    first = {
        "whole": [*RUN, "--metrics", str(m["whole"])],
        "crash": [*RUN, "--save-every", "2", "--checkpoint-dir", str(d["crash"])],
        "midsave": [*RUN, "--save-every", "1", "--checkpoint-dir", str(d["midsave"])],
        "stop5": [*RUN, "--stop-after", "5", "--checkpoint-dir", str(d["stop5"])],
        "nonfinite": [*RUN, *DIVERGE, "--checkpoint-dir", str(d["nonfinite"])],
        "skip": [*RUN, *DIVERGE, "--skip-nonfinite-steps", "2", "--keep", str(STEPS)],
    }
    first["skip"] += ["--checkpoint-dir", str(d["skip"])]
    for name, args in first.items():
        if name != "whole":
            args += ["--metrics", str(m[name])]
    # The reference runs alone first: it fills the shared compilation cache (see
    # tests/conftest.py), so the runs after it load its executables instead of all
    # compiling the same programs at once on a 2-core machine.
    results = {"whole": _train(*first.pop("whole"))}
    procs = {name: _start(first[name]) for name in ("crash", "midsave")}
    # The skipping run's update program selects between the new and the kept state, the
    # non-finite run's does not; the test compares their step-2 states bit for bit, which
    # holds with XLA:CPU's default fusion emitters (tests/_xla.py), so these two run as
    # processes with them.
    fusion = {"XLA_FLAGS": f"{os.environ['XLA_FLAGS']} {FUSION_EMITTERS}"}
    exact = {name: _start(first.pop(name), env=fusion) for name in ("nonfinite", "skip")}
    killed: dict[str, dict] = {}
    killer = threading.Thread(target=_kill_when_due, args=(procs, d, m, killed), daemon=True)
    killer.start()
    results |= {name: _train(*args) for name, args in first.items() if name not in procs}
    killer.join()
    results |= _finish(procs) | _finish(exact)
    saved = {name: _complete(path) for name, path in d.items()}

    # Copies of the step-5 checkpoint: one to resume in another layout, two damaged.
    d["relayout"] = tmp / "relayout"
    shutil.copytree(d["stop5"], d["relayout"])
    shutil.copyfile(m["stop5"], m["relayout"])
    bad = {name: tmp / name for name in ("other_model", "truncated")}
    for path in bad.values():
        shutil.copytree(d["stop5"], path)
    state = [p for p in (bad["truncated"] / "5" / "state").rglob("*") if p.is_file()]
    biggest = max(state, key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 3])
    before = {name: _snapshot(path) for name, path in bad.items()}
    second = {
        "crash_resume": first["crash"],
        "midsave_resume": first["midsave"],
        "stop5_resume": [*RUN, "--checkpoint-dir", str(d["stop5"]), "--metrics", str(m["stop5"])],
        "relayout": [*RUN, *OTHER_LAYOUT, "--checkpoint-dir", str(d["relayout"])],
        "other_model": ["--model", "tiny-av", *RUN, "--checkpoint-dir", str(bad["other_model"])],
        "truncated": [*RUN, "--checkpoint-dir", str(bad["truncated"])],
    }
    second["relayout"] += ["--metrics", str(m["relayout"])]
    truncated = _start(second.pop("truncated"))
    results |= {name: _train(*args) for name, args in second.items()}
    results |= _finish({"truncated": truncated})
    after = {name: _snapshot(path) for name, path in bad.items()}
    rows = {name: _rows(path) for name, path in m.items()}
    return dict(
        results=results, rows=rows, dirs=d | bad, killed=killed, saved=saved, bad=(before, after)
    )


# -- crash and resume, same layout -----------------------------------------------------------


@pytest.mark.slow
def test_uninterrupted_reference_run(runs):
    _check_ok(runs["results"]["whole"])
    rows = runs["rows"]["whole"]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert len({r["loss"] for r in rows}) == STEPS  # it trains: every loss differs


@pytest.mark.slow
def test_kill_9_after_step_5_resumes_from_the_newest_complete_checkpoint(runs):
    killed, results, d = runs["killed"]["crash"], runs["results"], runs["dirs"]["crash"]
    assert results["crash"].returncode == -signal.SIGKILL
    logged = [json.loads(line)["step"] for line in killed["rows"].splitlines()]
    assert logged == list(range(len(logged))) and logged[-1] >= 5
    # Saves every 2 steps, asynchronous: 6 may or may not have been finalised by then.
    assert killed["complete"] and killed["complete"][-1] in (4, 6)
    _check_ok(results["crash_resume"])
    start = _resumed_from(results["crash_resume"], d)
    assert start == killed["complete"][-1] <= logged[-1] + 1
    assert _complete(d)[-1] == STEPS  # the resumed run saved at its end


@pytest.mark.slow
def test_resumed_losses_equal_the_uninterrupted_run_bit_for_bit(runs):
    killed = runs["killed"]["crash"]
    start = _resumed_from(runs["results"]["crash_resume"], runs["dirs"]["crash"])
    whole = _losses(runs["rows"]["whole"])
    rows = runs["rows"]["crash"]
    before = [json.loads(line) for line in killed["rows"].splitlines()]
    # The file is the killed run's rows, then the resumed run's from its checkpoint on,
    # appended and numbered by global step.
    assert rows[: len(before)] == before
    resumed = rows[len(before) :]
    assert [r["step"] for r in resumed] == list(range(start, STEPS))
    assert {r["step"]: r["loss"] for r in resumed} == {s: whole[s] for s in range(start, STEPS)}
    assert _losses(rows) == whole  # the killed run's rows were exact too


# -- kill during a save -------------------------------------------------------------------


@pytest.mark.slow
def test_kill_during_a_save_resumes_from_the_previous_complete_one(runs):
    assert "midsave" in runs["killed"], "never saw a save under way"
    killed, results = runs["killed"]["midsave"], runs["results"]
    d = runs["dirs"]["midsave"]
    assert results["midsave"].returncode == -signal.SIGKILL
    (unfinished,) = killed["unfinished"]
    in_progress = int(unfinished.split(".")[0])
    assert in_progress > killed["complete"][-1]
    _check_ok(results["midsave_resume"])
    start = _resumed_from(results["midsave_resume"], d)
    assert start == killed["complete"][-1]
    before = [json.loads(line) for line in killed["rows"].splitlines()]
    rows = runs["rows"]["midsave"]
    assert rows[: len(before)] == before
    whole = _losses(runs["rows"]["whole"])
    resumed = [(r["step"], r["loss"]) for r in rows[len(before) :]]
    assert resumed == [(s, whole[s]) for s in range(start, STEPS)]
    assert _complete(d)[-1] == STEPS and not _unfinished(d)


# -- --stop-after --------------------------------------------------------------------------


@pytest.mark.slow
def test_stop_after_ends_cleanly_with_a_checkpoint(runs):
    _check_ok(runs["results"]["stop5"])
    from hetjax.checkpoint import Checkpointer

    assert runs["saved"]["stop5"] == [5]  # before the next run resumed it
    ckpt = Checkpointer(runs["dirs"]["stop5"])
    try:
        meta = ckpt.metadata(5)
    finally:
        ckpt.close()
    assert meta["step"] == 5 and meta["data"]["next_step"] == 5
    assert meta["config"]["steps"] == STEPS and meta["model"]["preset"] == "tiny"
    assert "hetjax run summary" in runs["results"]["stop5"].stdout


@pytest.mark.slow
def test_the_next_run_continues_the_full_runs_schedule(runs):
    result, d = runs["results"]["stop5_resume"], runs["dirs"]["stop5"]
    _check_ok(result)
    assert _resumed_from(result, d) == 5
    rows = runs["rows"]["stop5"]
    assert [r["step"] for r in rows] == list(range(STEPS))  # no step twice
    # Bit for bit, both halves: the learning rate follows --steps, not --stop-after.
    assert _losses(rows) == _losses(runs["rows"]["whole"])
    assert _complete(d)[-1] == STEPS


# -- resume into another layout -------------------------------------------------------------


@pytest.mark.slow
def test_resumes_colocated_checkpoint_under_non_colocated_islands(runs):
    """The ``--stop-after 5`` checkpoint (colocated vision ``dp=8``, LLM
    ``dp=2,tp=2,pp=2``) resumed on islands 4 + 4 with the LLM ``dp=1,tp=2,pp=2``."""
    result = runs["results"]["relayout"]
    _check_ok(result)
    assert _resumed_from(result, runs["dirs"]["relayout"]) == 5
    assert "non-colocated: vision dp=4" in result.stdout
    rows = runs["rows"]["relayout"]
    assert [r["step"] for r in rows] == list(range(STEPS))
    whole = _losses(runs["rows"]["whole"])
    got = _losses(rows)
    assert [got[s] for s in range(5)] == [whole[s] for s in range(5)]  # the first run's
    np.testing.assert_allclose(
        [got[s] for s in range(5, STEPS)], [whole[s] for s in range(5, STEPS)], rtol=1e-5
    )


# -- bad checkpoints ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "patterns"),
    [
        (
            "other_model",
            [r"of another model: (it has no parameter|its parameter|parameter) \S+ "],
        ),
        ("truncated", [r"damaged or incomplete", r"delete it to resume from an earlier one"]),
    ],
)
def test_a_bad_checkpoint_is_one_line_and_left_untouched(runs, case, patterns):
    result = runs["results"][case]
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(ERROR), result.stderr[-3000:]
    for pattern in patterns:
        assert re.search(pattern, lines[0]), (pattern, lines[0])
    assert str(runs["dirs"][case] / "5") in lines[0]
    before, after = runs["bad"]
    assert after[case] == before[case]
    assert "hetjax run summary" not in result.stdout


# -- non-finite steps -----------------------------------------------------------------------


def _restore(directory: Path, step: int):
    """Checkpoint ``step`` of a DIVERGE run, restored into a 1-device reference trainer:
    (params, optimizer state) as numpy trees."""
    import jax

    import hetjax
    from hetjax.checkpoint import restore
    from models.config import get_preset
    from models.mllm import MLLM

    model = MLLM(get_preset("tiny"))
    axes = {name: mod.logical_axes() for name, mod in model.modules.items()}
    config = hetjax.AdamWConfig(lr=1e3, clip_norm=0, total_steps=STEPS, warmup_steps=1)
    tx = hetjax.make_optimizer(config, logical_axes=axes)
    params = model.init(jax.random.key(0))
    ref = hetjax.ReferenceTrainer(model.loss_sum, params, tx, devices=jax.devices()[:1])
    restore(directory, ref, step=step)
    return jax.tree.map(np.asarray, (ref.params, ref.opt_state))


NONFINITE = re.compile(
    r"step \d+ \(metrics step (\d+)\): .*grad_norm/\w+=nan.*the gradient of [\w, ]*llm[\w, ]* "
    r"went non-finite; the checkpoint after step \d+ \((\S+)\) is intact"
)


@pytest.mark.slow
def test_a_nonfinite_step_stops_with_one_line_and_keeps_the_last_checkpoint(runs):
    result, d = runs["results"]["nonfinite"], runs["dirs"]["nonfinite"]
    assert result.returncode == 2, result.stderr[-3000:]
    line = _error_line(result)
    found = NONFINITE.search(line)
    assert found, line
    failed, kept = int(found[1]), Path(found[2])
    rows = runs["rows"]["nonfinite"]
    assert math.isnan(rows[-1]["loss"]) and rows[-1]["step"] == failed
    assert all(math.isfinite(r["loss"]) for r in rows[:-1])
    # Checkpoint S holds the state after S steps: the failing step (index) never saved.
    assert kept == d / str(failed) and _complete(d)[-1] == failed and not _unfinished(d)
    params, _ = _restore(d, failed)
    assert all(np.isfinite(x).all() for x in _leaves(params))


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


@pytest.mark.slow
def test_skipping_keeps_the_state_and_stops_after_n_nonfinite_steps_in_a_row(runs):
    """``--skip-nonfinite-steps 2``: steps 2 and 3 are skipped, step 4 is the third in a
    row and stops the run. Every step from 2 on is non-finite (the parameters that step
    1 left stay), so this is deterministic."""
    result, d = runs["results"]["skip"], runs["dirs"]["skip"]
    assert result.returncode == 2, result.stderr[-3000:]
    line = _error_line(result)
    assert re.search(r"\(metrics step 4\): .*\(3 in a row\); the gradient of .*llm", line), line
    rows = runs["rows"]["skip"]
    assert [r["step"] for r in rows] == list(range(5))
    assert [math.isfinite(r["loss"]) for r in rows] == [True, True, False, False, False]
    # A skipped step keeps the state, so its checkpoint is written. The last one is
    # saved by step 5, dispatched before step 4's metrics were read.
    kept = Path(NONFINITE.search(line)[2])
    assert _complete(d) == list(range(1, 7)) and not _unfinished(d)
    assert kept == d / "6"
    before = _restore(d, 2)
    for a, b in zip(_leaves(before), _leaves(_restore(d, 6)), strict=True):
        np.testing.assert_array_equal(a, b)  # four skipped updates: not a bit moved
    # The state the run without skipping kept at its first non-finite step.
    nonfinite = _restore(runs["dirs"]["nonfinite"], 2)
    for a, b in zip(_leaves(before), _leaves(nonfinite), strict=True):
        np.testing.assert_array_equal(a, b)


# -- bad input before training --------------------------------------------------------------


@pytest.fixture(scope="module")
def early_errors(tmp_path_factory):
    """Runs that must fail before anything compiles, with JAX's compilations logged
    (``JAX_LOG_COMPILES=1``): one would show in stderr."""
    tmp = tmp_path_factory.mktemp("ckpt_cli_bad")
    (tmp / "file").write_text("not a directory\n")
    (tmp / "foreign").mkdir()
    (tmp / "foreign" / "notes.txt").write_text("hello\n")
    args = {
        "save_every_0": ["--save-every", "0", "--checkpoint-dir", str(tmp / "new")],
        "not_writable": ["--checkpoint-dir", str(tmp / "file" / "ckpt")],
        "foreign": ["--checkpoint-dir", str(tmp / "foreign")],
    }
    before = _snapshot(tmp)
    results = {name: _train(*RUN, *a, log_compiles=True) for name, a in args.items()}
    return results, before, _snapshot(tmp)


EARLY = {
    "save_every_0": [r"--save-every", r"positive integer, got 0"],
    "not_writable": [r"checkpoint dir \S+/file/ckpt is not writable", r"give a directory"],
    "foreign": [r"\S+/foreign is not a hetjax checkpoint directory", r"empty or new directory"],
}


@pytest.mark.parametrize("case", sorted(EARLY))
def test_bad_checkpoint_flags_fail_before_training(early_errors, case):
    results, before, after = early_errors
    result = results[case]
    assert result.returncode == 2, result.stderr[-3000:]
    # Abstract shapes trace (logged as "Finished tracing"); nothing may compile.
    lines = [l for l in result.stderr.splitlines() if "Finished tracing" not in l]
    assert not any(re.search(r"[Cc]ompil|MLIR", l) for l in lines), result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(ERROR), result.stderr[-3000:]
    for pattern in EARLY[case]:
        assert re.search(pattern, lines[0]), (pattern, lines[0])
    assert after == before  # nothing created, nothing changed
