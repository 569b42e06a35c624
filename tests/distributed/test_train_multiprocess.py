"""``experiments.llava_train`` as a multi-process job (``python -m hetjax.launch``).

Each layout trains 10 FP32 steps as 2 processes x 4 devices or 4 x 2 (simulated CPU
devices, gloo collectives) and must give the losses of the single-process 8-device run
of the same layout: the processes split every module, or hold different modules, or
different pipeline stages of the LLM. Only process 0 prints and writes the metrics.
A process killed mid-training takes the others down within the bound, naming it; a
launch whose processes disagree on their settings is refused on every process.

Compilation dominates (each process compiles the stages with a device of its own;
``test_own_compiles`` counts them), so a module
fixture starts all training runs at once, letting one run's compilation overlap another's
host syncs, and the tests read their results; the fault tests run on their own, where
their time bound means something. Every subprocess has a timeout, and the launcher's
children die with it (the launcher's own --timeout too).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from tests import launch
from tests.launch import process_lines as _lines
from tests.launch import rows as _rows

TIMEOUT_S = 600  # per subprocess: all runs share a loaded 2-core CI machine
STOP_BOUND_S = 60  # a process killed -> every process gone (the bound)
TRAIN = ["--steps", "10", "--global-batch", "16", "--microbatches", "2"]

LAYOUTS = {
    # The vision encoder over all 8 devices; the LLM's two stages on devices 0-3 and 4-7.
    "colocated": ["--layout", "vision:dp=8", "--layout", "llm:dp=2,tp=2,pp=2"],
    # Vision on devices 0-3, the LLM on 4-7 with context parallelism: its image tokens
    # cross islands split over the cp ranks, then move to their owners (all-to-all).
    "non-colocated": [
        *("--placement", "non-colocated", "--island", "vision:4", "--island", "llm:4"),
        *("--layout", "vision:dp=4", "--layout", "llm:cp=2,tp=2"),
    ],
    # Vision on devices 0-3; LLM stage 0 on devices 4-5, stage 1 on 6-7.
    "non-colocated-pp": [
        *("--placement", "non-colocated", "--island", "vision:4", "--island", "llm:4"),
        *("--layout", "vision:dp=4", "--layout", "llm:dp=1,tp=2,pp=2"),
    ],
}
# (layout, processes, devices per process); with 4 x 2, "non-colocated-pp" puts vision on
# processes 0-1 and the LLM's stages on processes 2 and 3.
MULTI = [
    ("colocated", 2, 4),
    ("non-colocated", 2, 4),
    ("non-colocated-pp", 4, 2),
    ("colocated", 4, 2),
]


def _popen(args: list[str], **env: str) -> subprocess.Popen:
    """``python -m *args``, a process that sets its own device count (``--devices``)."""
    return launch.start(*args, env=env, own_devices=True)


def _launcher(processes: int, devices: int, module: str, args: list[str], **env: str):
    flags = ["--processes", str(processes), "--devices-per-process", str(devices)]
    return _popen(
        ["hetjax.launch", *flags, "--timeout", str(TIMEOUT_S), "--", module, *args], **env
    )


def _finish(proc: subprocess.Popen, what: str) -> subprocess.CompletedProcess:
    return launch.wait(proc, what, TIMEOUT_S)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every training run, started together: name -> (completed process, metrics rows)."""
    tmp = tmp_path_factory.mktemp("train")
    procs = {}
    for layout, flags in LAYOUTS.items():  # one single-process reference per layout
        metrics = tmp / f"single-{layout}.jsonl"
        args = ["experiments.llava_train", "--devices", "8", *TRAIN, *flags]
        procs[("single", layout)] = (_popen([*args, "--metrics", str(metrics)]), metrics)
    for layout, n, k in MULTI:
        metrics = tmp / f"{n}x{k}-{layout}.jsonl"
        args = [*TRAIN, *LAYOUTS[layout], "--metrics", str(metrics)]
        procs[(n, k, layout)] = (_launcher(n, k, "experiments.llava_train", args), metrics)
    try:
        return {
            name: (_finish(proc, str(name)), _rows(metrics))
            for name, (proc, metrics) in procs.items()
        }
    finally:  # after a failed run, the ones not waited for yet
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()


def _losses(result: subprocess.CompletedProcess, rows: list[dict]) -> list[float]:
    assert result.returncode == 0, result.stderr[-4000:]
    assert [r["step"] for r in rows] == list(range(10)), rows  # one writer, every step once
    return [r["loss"] for r in rows]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout,processes,devices", MULTI, ids=[f"{n}x{k}-{l}" for l, n, k in MULTI]
)
def test_multiprocess_losses_match_single_process(runs, layout, processes, devices):
    single = _losses(*runs[("single", layout)])
    result, rows = runs[(processes, devices, layout)]
    multi = _losses(result, rows)
    np.testing.assert_allclose(multi, single, rtol=1e-5)
    assert len(set(multi)) == 10  # it does train

    # Only process 0 prints the progress and the summary; it counts every process's devices.
    out, err = result.stdout, result.stderr
    summary = [line.split() for line in _lines(out, 0)]
    assert ["devices", "8", "x", "cpu", "over", str(processes), "processes"] in summary, out[-3000:]
    for p in range(1, processes):
        assert not any("hetjax run summary" in line for line in _lines(out, p)), out[-3000:]
        assert not any(re.match(r"step +\d+/10", line) for line in _lines(err, p)), err[-3000:]
    assert any(re.match(r"step +10/10  loss", line) for line in _lines(err, 0)), err[-3000:]
    assert "Traceback" not in err


@pytest.mark.multiprocess
def test_killed_process_stops_every_process_and_is_named(tmp_path):
    metrics = tmp_path / "m.jsonl"
    args = [*TRAIN, *LAYOUTS["non-colocated"], "--metrics", str(metrics)]
    launcher = _launcher(2, 4, "tests.distributed._train_kill", args, HETJAX_TEST_KILL_AT="1:3")
    done = _finish(launcher, "the killed run")
    end = time.time()
    match = re.search(r"killing itself at ([0-9.]+)", done.stdout)
    assert match, done.stdout[-3000:] + done.stderr[-3000:]
    assert end - float(match.group(1)) < STOP_BOUND_S
    assert done.returncode != 0
    last = done.stderr.splitlines()[-1]
    assert last == "hetjax.launch: process 1 was killed by signal 9 (SIGKILL)", last
    # Process 0 was stopped by its watchdog, which names process 1, not by the launcher.
    p0 = "\n".join(_lines(done.stderr, 0))
    assert re.search(r"hetjax: process 1 (failed first \()?died \(OS process \d+ ended\)", p0), p0
    assert len(_rows(metrics)) < 10
    assert "hetjax run summary" not in done.stdout


@pytest.mark.multiprocess
def test_llava_processes_decode_only_the_images_their_devices_hold(llava_dir, tmp_path):
    """LLaVA-format data (0, 1 and 2 images per row) on islands, 2 processes x 4 devices:
    process 0 holds the vision encoder and decodes every image of each step, process 1
    holds only the LLM and decodes none; the losses are the single-process run's."""
    data = [
        *("--data", llava_dir["train"], "--image-folder", llava_dir["images"]),
        *("--tokenizer", llava_dir["tokenizer"], "--seq-len", "96"),
        *("--steps", "4", "--global-batch", "16", "--microbatches", "2"),
        *LAYOUTS["non-colocated"],
    ]
    single_metrics, multi_metrics = tmp_path / "single.jsonl", tmp_path / "multi.jsonl"
    single = _popen(
        [
            "tests.distributed._train_decoded",
            "--devices",
            "8",
            *data,
            "--metrics",
            str(single_metrics),
        ]
    )
    multi = _launcher(
        2, 4, "tests.distributed._train_decoded", [*data, "--metrics", str(multi_metrics)]
    )
    done = {"single": _finish(single, "the single-process run"), "multi": _finish(multi, "the run")}
    for name, result in done.items():
        assert result.returncode == 0, (name, result.stderr[-4000:])
    want = [r["loss"] for r in _rows(single_metrics)]
    rows = _rows(multi_metrics)
    assert [r["step"] for r in rows] == list(range(4)) and len(want) == 4
    np.testing.assert_allclose([r["loss"] for r in rows], want, rtol=1e-5)

    def decoded(lines: list[str]) -> tuple[list[int], list[int]]:
        (line,) = [l for l in lines if l.startswith("images decoded ")]
        got, images = line.removeprefix("images decoded ").split(" of ")
        return json.loads(got), json.loads(images)

    one, images = decoded(done["single"].stdout.splitlines())
    assert one == images and min(images) > 0, (one, images)  # one process: every image
    vision, images0 = decoded(_lines(done["multi"].stdout, 0))
    llm, images1 = decoded(_lines(done["multi"].stdout, 1))
    assert images0 == images1 == images  # the same steps' rows on both processes
    assert vision == images, vision
    assert llm == [0] * 4, llm


@pytest.mark.multiprocess
def test_mismatched_launch_is_refused_on_every_process():
    """Two processes started by hand with the trainer's own flags, seeds 0 and 1."""
    start = time.monotonic()
    procs = launch.start_job(
        2,
        lambda i, coordinator: [
            *("experiments.llava_train", "--devices", "2", *TRAIN, "--seed", str(i)),
            *("--coordinator", coordinator, "--num-processes", "2", "--process-id", str(i)),
        ],
    )
    try:
        results = [_finish(p, f"process {i}") for i, p in enumerate(procs)]
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
    assert time.monotonic() - start < 120
    want = (
        "llava_train: error: training config differs between processes: process 1 has seed=1 "
        "(process 0: 0); launch every process with the same flags"
    )
    for i, result in enumerate(results):
        assert result.returncode == 2, (i, result.stderr[-3000:])
        lines = [l for l in result.stderr.splitlines() if l.startswith("llava_train")]
        assert lines == [want], (i, result.stderr[-3000:])
        assert "Traceback" not in result.stderr


def test_partial_multiprocess_flags_give_one_line():
    done = _finish(
        _popen(["experiments.llava_train", "--coordinator", "127.0.0.1:1", "--steps", "1"]),
        "the refused run",
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "llava_train: error: --coordinator given but --num-processes and --process-id "
        "missing: pass all three (or start the processes with python -m hetjax.launch)"
    ], done.stderr


# Checkpoints across process counts: a layout whose stages span both processes (every
# array is orbax's).
SPANNING = ["--layout", "vision:dp=8", "--layout", "llm:dp=4,tp=2"]
CKPT_RUN = ["--steps", "6", "--global-batch", "16", "--microbatches", "2", *SPANNING]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_checkpoints_move_between_process_counts(tmp_path):
    """Saved by 2 processes x 4 devices at step 3, resumed by one process with 8; and the
    other way round. Steps 4-6 match the uninterrupted single-process run."""
    whole = tmp_path / "whole.jsonl"
    ref = _popen(["experiments.llava_train", "--devices", "8", *CKPT_RUN, "--metrics", str(whole)])
    saves = {
        "multi": _launcher(
            2, 4, "experiments.llava_train",
            [*CKPT_RUN, "--stop-after", "3", "--checkpoint-dir", str(tmp_path / "multi")],
        ),
        "single": _popen(
            ["experiments.llava_train", "--devices", "8", *CKPT_RUN, "--stop-after", "3",
             "--checkpoint-dir", str(tmp_path / "single")]
        ),
    }  # fmt: skip
    for name, proc in saves.items():
        done = _finish(proc, f"the {name}-process save")
        assert done.returncode == 0, done.stderr[-3000:]
    resumes = {  # each resumes the other's checkpoint
        "single": _popen(
            ["experiments.llava_train", "--devices", "8", *CKPT_RUN,
             "--checkpoint-dir", str(tmp_path / "multi"), "--metrics", str(tmp_path / "s.jsonl")]
        ),
        "multi": _launcher(
            2, 4, "experiments.llava_train",
            [*CKPT_RUN, "--checkpoint-dir", str(tmp_path / "single"),
             "--metrics", str(tmp_path / "m.jsonl")],
        ),
    }  # fmt: skip
    done = _finish(ref, "the uninterrupted run")
    assert done.returncode == 0, done.stderr[-3000:]
    want = [r["loss"] for r in _rows(whole)]
    assert len(want) == 6
    for name, proc in resumes.items():
        done = _finish(proc, f"the {name}-process resume")
        assert done.returncode == 0, done.stderr[-3000:]
        assert "resumed from step 3" in done.stdout, done.stdout[-2000:]
        rows = _rows(tmp_path / ("s.jsonl" if name == "single" else "m.jsonl"))
        assert [r["step"] for r in rows] == [3, 4, 5]
        np.testing.assert_allclose([r["loss"] for r in rows], want[3:], rtol=1e-5)


# Preemption and checkpoints of stages held by one process, from one job: the "colocated"
# 2 x 4 job of the `runs` fixture (the same flags, so every run here loads that job's
# programs, or the single-process "non-colocated-pp" run's, from the compilation cache),
# sent SIGTERM as a batch system sends it. Its LLM's stage 0 is on process 0's devices and
# stage 1 on process 1's, so the pre and post parts and their optimizer state are written
# by their owners alone (the "owned" item); the vision encoder and the LLM's block stack
# span both processes (orbax's arrays). The same command resumes it (the same layout, bit
# for bit); copies of its checkpoint are resumed in another layout and, damaged, refused.
# (A save by ``--stop-after`` in 2 processes is `test_checkpoints_move_between_process_counts`.)


@pytest.fixture(scope="module")
def preempted(runs, tmp_path_factory):
    """``hetjax.launch`` gets SIGTERM after step 2 is logged: (checkpoint directory, the
    job's flags, the finished launcher, the saved step, copies of the checkpoint made
    before anything resumes from it: "other" and "damaged")."""
    tmp = tmp_path_factory.mktemp("preempted")
    ckpt, cut = tmp / "ckpt", tmp / "cut.jsonl"
    args = [*TRAIN, *LAYOUTS["colocated"], "--checkpoint-dir", str(ckpt), "--metrics", str(cut)]
    launcher = _launcher(2, 4, "experiments.llava_train", args)
    deadline = time.monotonic() + TIMEOUT_S
    while len(_rows(cut)) < 2 and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    done = _finish(launcher, "the preempted job")
    found = re.findall(
        r"preempted: saved the state after step (\d+)", "\n".join(_lines(done.stdout, 0))
    )
    saved = int(found[0]) if len(found) == 1 else None
    copies = {name: tmp / name for name in ("other", "damaged")}
    for copy in copies.values():
        if ckpt.is_dir():
            shutil.copytree(ckpt, copy)
    return {"ckpt": ckpt, "args": args, "cut": cut, "done": done, "saved": saved, **copies}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sigterm_saves_on_every_process_at_one_step_and_the_resume_is_bit_exact(runs, preempted):
    """Both processes agree on a step through JAX's preemption sync point, save it and
    exit 0, and so does the launcher; the same command resumes to the uninterrupted job's
    losses bit for bit (FP32)."""
    done, saved, ckpt = preempted["done"], preempted["saved"], preempted["ckpt"]
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hetjax.launch: preempted: every process saved and exited 0" in done.stderr
    assert saved is not None, done.stdout[-3000:]  # exactly one "saved the state" line
    assert 2 <= saved < 10 and (ckpt / str(saved)).is_dir()
    args = preempted["args"]
    resumed = _finish(_launcher(2, 4, "experiments.llava_train", args), "the resumed job")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step {saved} " in resumed.stdout
    losses = {r["step"]: r["loss"] for r in _rows(preempted["cut"])}  # the resumed job's rows win
    want = [r["loss"] for r in runs[(2, 4, "colocated")][1]]
    assert [losses[step] for step in sorted(losses)] == want, (losses, want)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_checkpoints_of_stages_held_by_one_process(runs, preempted, tmp_path):
    """The preempted job's checkpoint has the owned item; resumed by one process in another
    layout (islands, 8 devices), steps after the saved one equal the uninterrupted 2-process
    run at rtol 1e-5. A truncated chunk of the owned item stops both processes with the
    one-line error (exit 2) and leaves the checkpoint as it was. (The same layout's resume,
    bit for bit, is the SIGTERM test's.)"""
    saved = preempted["saved"]
    assert saved is not None, preempted["done"].stdout[-3000:]
    want = _losses(*runs[(2, 4, "colocated")])
    meta = json.loads((preempted["ckpt"] / str(saved) / "meta" / "metadata").read_text())
    assert "params/llm/pre/table" in meta["owned"], meta.get("owned")
    assert not any(n.startswith("params/vision") for n in meta["owned"]), meta["owned"]

    other, damaged = preempted["other"], preempted["damaged"]
    chunks = [
        p for p in (damaged / str(saved) / "owned").rglob("*") if p.is_file() and p.name[0] != "."
    ]
    biggest = max(chunks, key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 3])
    before = sorted((str(p), p.stat().st_size) for p in damaged.rglob("*"))
    second = {
        "other-layout": _popen(
            ["experiments.llava_train", "--devices", "8", *TRAIN,
             *LAYOUTS["non-colocated-pp"], "--checkpoint-dir", str(other),
             "--metrics", str(tmp_path / "other.jsonl")]
        ),
        "damaged": _launcher(
            2, 4, "experiments.llava_train",
            [*TRAIN, *LAYOUTS["colocated"], "--checkpoint-dir", str(damaged)],
        ),
    }  # fmt: skip
    done = {name: _finish(proc, f"the {name} resume") for name, proc in second.items()}
    assert done["other-layout"].returncode == 0, done["other-layout"].stderr[-3000:]
    assert f"resumed from step {saved}" in done["other-layout"].stdout
    moved = _rows(tmp_path / "other.jsonl")
    assert [r["step"] for r in moved] == list(range(saved, 10))
    np.testing.assert_allclose([r["loss"] for r in moved], want[saved:], rtol=1e-5)

    bad = done["damaged"]
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert "Traceback" not in bad.stderr
    for p in range(2):
        errors = [l for l in _lines(bad.stderr, p) if l.startswith("llava_train: error: ")]
        assert len(errors) == 1, bad.stderr[-3000:]
        assert f"checkpoint {damaged / str(saved)} is damaged or incomplete" in errors[0], errors
        assert errors[0].endswith("delete it to resume from an earlier one"), errors
    assert sorted((str(p), p.stat().st_size) for p in damaged.rglob("*")) == before
