"""End-to-end: ``python -m experiments.llava_train``, run in the test process
(:func:`tests.launch.run_main`) except for one bad input, which a real process must also
report in one line.

Successful runs run one after the other in a module fixture, then the bad-input runs
(which never reach a device); then each is checked by its own test. Bad input must fail
before JAX compiles anything: the error runs log JAX's compilations
(``JAX_LOG_COMPILES=1``), so a compilation would show up in stderr; apart from those log
lines, stderr must be exactly the one error line.
"""

import json
import re

import pytest

from tests import launch
from tests.launch import ROOT
from tests.launch import check_ok as _check_ok

METRIC_KEYS = {
    "step",
    "loss",
    "grad_norm",
    "grad_norm/vision",
    "grad_norm/projector",
    "grad_norm/llm",
    "param_norm/vision",
    "param_norm/projector",
    "param_norm/llm",
    "tokens",
    "step_time_s",
    "tokens_per_s",
}


RUNS = {
    "tiny_a": ["--steps", "3", "--devices", "2", "--global-batch", "8"],
    "tiny_b": ["--steps", "3", "--devices", "2", "--global-batch", "8"],
    "tiny_av": ["--model", "tiny-av", "--steps", "2", "--devices", "2", "--global-batch", "8"],
    # LLaVA stage 1: only the projector trains; a peak makes the run report MFU.
    "stage1": [
        *("--steps", "3", "--devices", "2", "--global-batch", "8"),
        *("--freeze", "vision,llm", "--peak-tflops", "0.5"),
    ],
}
FLOP_KEYS = {"model_tflops_per_step", "hardware_tflops_per_step", "tflops_per_s"}


def _train(*args: str, log_compiles: bool = False) -> launch.Result:
    return launch.run_main(launch.TRAIN, *args, log_compiles=log_compiles)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    # tiny_b (and from_config) reuse tiny_a's executables from the suite's persistent
    # compilation cache (tests/conftest.py; other modules' runs of the same programs load
    # them too); their losses must still match: same data, init and dispatch.
    results, rows = {}, {}
    # tiny_a's run again, from the file --print-config writes (with a different --steps,
    # which the command line then overrides): the same resolved config must give the
    # same losses.
    results["print"] = _train("--print-config", *RUNS["tiny_a"], "--steps", "7")
    (tmp / "run.yaml").write_text(results["print"].stdout)
    runs = {**RUNS, "from_config": ["--config", str(tmp / "run.yaml"), "--steps", "3"]}
    for name, args in runs.items():
        path = tmp / f"{name}.jsonl"
        results[name] = _train(*args, "--metrics", str(path))
        text = path.read_text() if path.exists() else ""
        rows[name] = [json.loads(line) for line in text.splitlines()]
    return results, rows


def test_tiny_run_writes_metrics_and_summary(runs):
    results, rows = runs
    _check_ok(results["tiny_a"])
    assert len(rows["tiny_a"]) == 3
    for i, row in enumerate(rows["tiny_a"]):
        assert METRIC_KEYS <= row.keys(), METRIC_KEYS - row.keys()
        assert row["step"] == i
        assert row["tokens"] == 8 * 64
        assert all(isinstance(row[k], (int, float)) for k in METRIC_KEYS)
        assert 0 < row["loss"] < 10 and row["grad_norm"] > 0 and row["tokens_per_s"] > 0
    stdout = results["tiny_a"].stdout
    assert "hetjax run summary" in stdout
    assert "tiny" in stdout and "2 x cpu" in stdout
    # No --seq-len: the summary says the length is the model's own.
    assert "8 samples x 64 tokens (the model's; model.seq_len sets it)" in stdout
    assert "loss (first -> last)" in stdout and "throughput" in stdout
    # FLOPs always; no MFU on CPU without a peak (the table knows accelerators only).
    assert all(FLOP_KEYS <= row.keys() and "mfu" not in row for row in rows["tiny_a"])
    assert "device peak unknown (--peak-tflops gives it)" in stdout


def test_freeze_stage1_trains_the_projector_only_and_reports_mfu(runs):
    results, rows = runs
    _check_ok(results["stage1"])
    assert len(rows["stage1"]) == 3
    for row in rows["stage1"]:
        assert "grad_norm/projector" in row
        assert "grad_norm/vision" not in row and "grad_norm/llm" not in row
        assert {"mfu", "mfu/vision", "mfu/llm"} | FLOP_KEYS <= row.keys()
        assert 0 < row["mfu"] < 1 and row["hardware_tflops_per_step"] > row["model_tflops_per_step"]
    for part in ("vision", "llm"):  # frozen: the norm never moves
        assert len({r[f"param_norm/{part}"] for r in rows["stage1"]}) == 1
    assert len({r["param_norm/projector"] for r in rows["stage1"]}) > 1  # it trains
    assert re.search(r"MFU\s+\d+\.\d+% \(llm \d+\.\d+%, vision", results["stage1"].stdout)


def test_tiny_av_run_has_audio_metrics(runs):
    results, rows = runs
    _check_ok(results["tiny_av"])
    assert len(rows["tiny_av"]) == 2
    keys = METRIC_KEYS | {"grad_norm/audio", "param_norm/audio"}
    for row in rows["tiny_av"]:
        assert keys <= row.keys(), keys - row.keys()
        assert row["tokens"] == 8 * 96
    assert "tiny-av" in results["tiny_av"].stdout


def test_same_seed_same_losses(runs):
    results, rows = runs
    _check_ok(results["tiny_b"])
    losses_a = [r["loss"] for r in rows["tiny_a"]]
    assert losses_a == [r["loss"] for r in rows["tiny_b"]]
    assert len(set(losses_a)) == 3  # the model does train


def test_print_config_then_config_repeats_the_run(runs):
    results, rows = runs
    printed = results["print"]
    assert printed.returncode == 0 and printed.stderr == "", printed.stderr[-3000:]
    assert "steps: 7" in printed.stdout and "hetjax run summary" not in printed.stdout
    _check_ok(results["from_config"])
    assert [r["loss"] for r in rows["from_config"]] == [r["loss"] for r in rows["tiny_a"]]


# (flags, regular expressions the one-line error must match: what is wrong and the fix)
BAD_INPUT = {
    "unknown-preset": (["--model", "nope"], [r"unknown model preset 'nope'", r"tiny-av"]),
    "rebalance-unknown": (["--rebalance", "visoin"], [r"--rebalance names 'visoin'", r"vision"]),
    "rebalance-llm": (
        ["--rebalance", "llm"],
        [r"--rebalance llm: 'llm' is no encoder", r"use one of vision"],
    ),
    "batch-vs-microbatches": (
        ["--global-batch", "10", "--microbatches", "4", "--devices", "2"],
        [r"10 is not divisible", r"microbatches", r"multiple of \d+"],
    ),
    "batch-vs-devices": (
        ["--global-batch", "6", "--microbatches", "1", "--devices", "4"],
        [r"not divisible", r"multiple of 4"],
    ),
    "seq-len-too-short": (
        ["--seq-len", "8"],
        [r"--seq-len 8 is too short", r"need up to 49 tokens", r"48 inputs", r"--seq-len 48 "],
    ),
    # Island errors come from the run plan, before any parameter (whose initialisation
    # would compile): the suggested islands fit the 8 devices.
    "non-colocated-without-islands": (
        ["--placement", "non-colocated"],
        [r"needs an island per module", r"e\.g\. --island vision:4 --island llm:4 "],
    ),
    "islands-too-big": (
        ["--placement", "non-colocated", "--island", "vision:8", "--island", "llm:4"],
        [r"vision: island of 8 devices", r"needs 4", r"--island vision:4 match"],
    ),
    "zero-steps": (["--steps", "0"], [r"--steps", r"positive integer, got 0"]),
    "negative-steps": (["--steps", "-3"], [r"--steps", r"positive integer, got -3"]),
    "malformed-lr": (["--lr", "abc"], [r"--lr", r"positive number, got 'abc'"]),
    "malformed-steps": (["--steps", "two"], [r"--steps", r"positive integer, got 'two'"]),
    "unknown-flag": (["--bogus"], [r"unrecognized arguments: --bogus", r"--help"]),
    "freeze-unknown": (
        ["--freeze", "vsion"],
        [r"error: --freeze names unknown part 'vsion'", r"vision"],
    ),
    "freeze-everything": (
        ["--freeze", "vision,projector,llm"],
        [r"error: --freeze names every part", r"leave at least one part out of --freeze"],
    ),
    "negative-seed": (["--seed", "-1"], [r"--seed -1", r"non-negative"]),
    "metrics-dir-missing": (
        ["--metrics", "/nonexistent-hetjax-dir/m.jsonl"],
        [r"--metrics", r"/nonexistent-hetjax-dir", r"create"],
    ),
    # A directory below a plain file cannot be made (also for root, unlike chmod).
    "tensorboard-unwritable": (
        ["--tensorboard", str(ROOT / "README.md" / "tb")],
        [r"--tensorboard .*README\.md/tb: directory is not writable \(Not a directory\)", r"give"],
    ),
    "profile-outside-run": (
        ["--steps", "5", "--profile-steps", "4:5", "--profile-dir", str(ROOT / "README.md")],
        [r"--profile-steps 4:5 is outside the run \(metrics steps 0\.\.4\)", r"4:4"],
    ),
    "plot-not-png": (["--plot", "curves.svg"], [r"--plot curves\.svg must be a \.png path"]),
}


# The case that a real ``python -m`` process reports: one line, exit code 2.
IN_A_PROCESS = "islands-too-big"


@pytest.fixture(scope="module")
def bad_runs():
    # "--steps 2" first: a later flag of the case overrides it, and a run that wrongly
    # starts training stays short.
    args = {name: ["--steps", "2", *a] for name, (a, _) in BAD_INPUT.items()}
    proc = launch.start_train(args.pop(IN_A_PROCESS), {"JAX_LOG_COMPILES": "1"})
    results = {name: _train(*a, log_compiles=True) for name, a in args.items()}
    return results | launch.finish({IN_A_PROCESS: proc})


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_is_one_line_before_compiling(bad_runs, case):
    _, patterns = BAD_INPUT[case]
    result = bad_runs[case]
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    # Building abstract parameter shapes traces (jax.eval_shape), which is allowed and
    # logged as "Finished tracing"; anything compiled would be logged as compilation.
    lines = [l for l in result.stderr.splitlines() if not l.startswith("Finished tracing")]
    assert not any(re.search(r"[Cc]ompil|MLIR", l) for l in lines), result.stderr[-3000:]
    assert len(lines) == 1, result.stderr[-3000:]
    (line,) = lines
    assert line.startswith("llava_train: error: ") and len(line) > len("llava_train: error: ")
    for pattern in patterns:
        assert re.search(pattern, line), (pattern, line)
    assert "hetjax run summary" not in result.stdout


def test_a_process_exits_2_on_bad_input(bad_runs):
    assert bad_runs[IN_A_PROCESS].returncode == 2
