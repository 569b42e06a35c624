"""``python -m hetjax.launch`` and :mod:`hetjax.distributed` with real local processes.

Every process runs ``tests.distributed._worker`` on simulated CPU devices with gloo
collectives. Each subprocess has a timeout, and the launcher's children die with it, so
a regression fails the test instead of hanging CI.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import time

import pytest

from hetjax import distributed, launch
from hetjax.distributed import consistency
from tests import launch as job
from tests.launch import process_lines as _lines

WORKER = "tests.distributed._worker"
TIMEOUT_S = 150  # per subprocess: generous for a loaded 2-core CI machine
STOP_BOUND_S = 30  # failure to every process gone (start-up excluded); watchdog polls 0.5 s


def _launch(flags: list[str], worker: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    return _run_launcher(*flags, "--", WORKER, *worker), time.time()


def _run_launcher(*args: str) -> subprocess.CompletedProcess:
    """``python -m hetjax.launch *args``; its processes set their device counts."""
    return job.run("hetjax.launch", *args, timeout=TIMEOUT_S, own_devices=True)


def _failed_at(out: str) -> float:
    match = re.search(r"failing at ([0-9.]+)", out)
    assert match, out[-3000:]
    return float(match.group(1))


@pytest.mark.multiprocess
@pytest.mark.parametrize("processes,devices", [(2, 4), (4, 2)])
def test_all_processes_run_and_agree(processes, devices):
    done, _ = _launch(
        ["--processes", str(processes), "--devices-per-process", str(devices)],
        ["--steps", "2", "--watchdog", "30"],
    )
    assert done.returncode == 0, done.stderr[-4000:]
    n = processes * devices
    for line in done.stdout.splitlines():
        assert re.match(r"\[p\d\] ", line), line
    for i in range(processes):
        out = _lines(done.stdout, i)
        assert f"process {i} of {processes} sees {n} devices" in out, out
        # Device d holds d + step, summed across every process's devices.
        for step in range(2):
            assert f"step {step} sum {sum(range(n)) + n * step:.1f}" in out, out


@pytest.mark.multiprocess
def test_raise_stops_every_process_and_names_it():
    done, end = _launch(
        ["--processes", "2", "--devices-per-process", "4", "--grace", "20"],
        ["--steps", "3", "--fail", "raise", "--watchdog", "4"],
    )
    assert done.returncode == 1, done.stderr[-4000:]
    assert done.stderr.splitlines()[-1] == "hetjax.launch: process 1 exited with code 1"
    # Process 0 was waiting in the step-1 collective; its watchdog stopped it, not the
    # launcher (grace 20 s), within about one poll.
    p0 = "\n".join(_lines(done.stderr, 0))
    want = r"hetjax: process 1 failed (first )?\(RuntimeError: injected failure at step 1\)"
    assert re.search(want, p0), p0
    assert end - _failed_at(done.stdout) < STOP_BOUND_S


@pytest.mark.multiprocess
def test_launcher_kills_the_rest_after_the_grace_period():
    # No watchdog: process 0 would wait in its collective until JAX's 60 s heartbeat.
    done, end = _launch(
        ["--processes", "2", "--devices-per-process", "4", "--grace", "1"],
        ["--steps", "3", "--fail", "kill"],
    )
    assert done.returncode == 1, done.stderr[-4000:]
    last = done.stderr.splitlines()[-1]
    assert last.startswith("hetjax.launch: process 1 was killed by signal 9 (SIGKILL)"), last
    assert end - _failed_at(done.stdout) < STOP_BOUND_S


@pytest.mark.multiprocess
@pytest.mark.parametrize("fail", ["raise", "kill", "stop"])
def test_watchdog_stops_a_process_blocked_in_a_collective(fail):
    """No launcher: only the watchdog can end process 0, which waits for process 1."""
    procs = job.start_job(
        2,
        lambda i, coordinator: [WORKER, "--steps", "3", "--fail", fail, "--watchdog", "4"],
        env=lambda i, coordinator: dict(
            HETJAX_COORDINATOR=coordinator,
            HETJAX_NUM_PROCESSES="2",
            HETJAX_PROCESS_ID=str(i),
            HETJAX_LOCAL_DEVICES="4",
            JAX_PLATFORMS="cpu",
        ),
    )
    try:
        err0 = job.wait(procs[0], "process 0 (its watchdog should stop it)", TIMEOUT_S).stderr
        end = time.time()
        if fail == "stop":  # a stopped process never ends by itself
            procs[1].kill()
        out1 = job.wait(procs[1], "process 1", TIMEOUT_S).stdout
    finally:
        for proc in procs:
            proc.kill()
    assert procs[1].returncode == (1 if fail == "raise" else -9)
    assert procs[0].returncode == distributed.PEER_FAILED_EXIT_CODE, err0[-4000:]
    # A killed process on this machine is seen gone at once; a silent one (a hung or
    # lost machine) once its heartbeat is 4 s old.
    reason = {
        "raise": r"failed (first )?\(RuntimeError: injected failure at step 1\)",
        "kill": rf"(failed first \()?died \(OS process {procs[1].pid} ended\)",
        "stop": r"died or hung: no heartbeat for \d+ s",
    }[fail]
    assert re.search(f"hetjax: process 1 {reason}", err0), err0[-4000:]
    assert end - _failed_at(out1) < STOP_BOUND_S


@pytest.mark.multiprocess
def test_mismatched_launch_is_refused_on_every_process():
    done, _ = _launch(
        ["--processes", "2", "--devices-per-process", "2"],
        ["--steps", "1", "--seed", "7", "--mismatch"],
    )
    assert done.returncode == 2, done.stderr[-4000:]
    want = (
        "error: worker config differs between processes: process 1 has seed=8 "
        "(process 0: 7); launch every process with the same flags"
    )
    for i in range(2):
        assert want in _lines(done.stderr, i), done.stderr[-4000:]
        assert not any("Traceback" in line for line in _lines(done.stderr, i))


@pytest.mark.multiprocess
def test_timeout_stops_everything():
    start = time.monotonic()
    done = _run_launcher(
        "--processes", "2", "--devices-per-process", "1", "--timeout", "2",
        "--", "tests.distributed._sleeper",
    )  # fmt: skip
    assert done.returncode == 124, done.stderr
    assert done.stderr.splitlines()[-1] == (
        "hetjax.launch: timed out after 2 s; stopped all processes"
    )
    assert time.monotonic() - start < 60
    for pid in re.findall(r"sleeping as (\d+)", done.stdout):
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)


@pytest.mark.multiprocess
@pytest.mark.parametrize("program", [[], ["-m"]], ids=["module", "dash-m"])
def test_sigterm_stops_the_launcher_and_its_processes(program):
    launcher = job.start(
        "hetjax.launch", "--processes", "2", "--devices-per-process", "1",
        "--", *program, "tests.distributed._sleeper", own_devices=True,
    )  # fmt: skip
    try:
        assert launcher.stdout is not None
        pids = [int(launcher.stdout.readline().split()[-1]) for _ in range(2)]
        launcher.terminate()
        _, err = launcher.communicate(timeout=TIMEOUT_S)
    finally:
        launcher.kill()
    assert launcher.returncode == 143
    assert err.splitlines()[-1] == "hetjax.launch: interrupted; stopped all processes"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize(
    "argv,message",
    [
        ([], "the following arguments are required: --processes, --devices-per-process"),
        (["--processes", "2", "--devices-per-process", "4"], "missing the program"),
        (["--processes", "0", "--devices-per-process", "4", "--", "m"], "positive"),
        (["--processes", "x", "--devices-per-process", "4", "--", "m"], "positive"),
        (["--processes", "2", "--devices-per-process", "4", "--bogus", "--", "m"], "--bogus"),
        (["--processes", "2", "--devices-per-process", "4", "--port", "70000", "--", "m"], "port"),
        (["--processes", "2", "--devices-per-process", "4", "--", "-c"], "not a Python module"),
        (["--processes", "2", "--devices-per-process", "4", "--", "-m"], "module after '-m'"),
        (["--processes", "2", "--devices-per-process", "4", "--", "a/b.py"], "module name"),
    ],
)
def test_bad_flags_give_one_line(argv, message, capsys):
    assert launch.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hetjax.launch: error: "), err
    assert message in err and err.rstrip().endswith("(see --help)"), err


def test_dash_m_before_the_module_means_the_same_as_without():
    flags = ["--processes", "2", "--devices-per-process", "1", "--"]
    program = ["experiments.llava_train", "--steps", "3"]
    assert launch.parse_args([*flags, "-m", *program]) == launch.parse_args([*flags, *program])
    assert launch.parse_args([*flags, "-m", *program])[1] == program


def test_bad_flags_from_the_command_line_exit_2_without_traceback():
    done = _run_launcher("--processes", "2", "--", WORKER)
    assert done.returncode == 2
    assert done.stderr == (
        "hetjax.launch: error: the following arguments are required: --devices-per-process "
        "(see --help)\n"
    )


def test_resolve_prefers_flags_then_launcher_env_then_cluster():
    env = {
        "HETJAX_COORDINATOR": "127.0.0.1:1234",
        "HETJAX_NUM_PROCESSES": "4",
        "HETJAX_PROCESS_ID": "3",
        "HETJAX_LOCAL_DEVICES": "2",
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_NODELIST": "node1",
        "SLURM_NTASKS": "8",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
    }
    flags = distributed.resolve(
        coordinator="10.0.0.1:99", num_processes=2, process_id=1, environ=env
    )
    assert flags == distributed.DistributedInfo(1, 2, "10.0.0.1:99", 2, "flags")
    from_env = distributed.resolve(environ=env)
    assert from_env == distributed.DistributedInfo(3, 4, "127.0.0.1:1234", 2, "env")
    slurm = {k: v for k, v in env.items() if not k.startswith("HETJAX_")}
    assert distributed.resolve(environ=slurm) == distributed.DistributedInfo(
        5, 8, None, None, "cluster"
    )
    assert distributed.resolve(environ={**slurm, "SLURM_NTASKS": "1"}).source == "single"
    single = distributed.resolve(environ={}, local_device_count=8)
    assert single == distributed.DistributedInfo(0, 1, None, 8, "single")
    assert not single.is_multiprocess


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(coordinator="h:1"), "coordinator given but num_processes and process_id"),
        (dict(coordinator="h:1", num_processes=2, process_id=2), "must be in 0..1"),
        (dict(coordinator="host", num_processes=2, process_id=0), "HOST:PORT"),
        (dict(environ={"HETJAX_NUM_PROCESSES": "two"}), "HETJAX_NUM_PROCESSES='two'"),
        (dict(local_device_count=0, environ={}), "at least 1"),
    ],
)
def test_resolve_rejects_partial_or_bad_settings(kwargs, message):
    kwargs.setdefault("environ", {})
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        distributed.resolve(**kwargs)
    assert "\n" not in str(info.value)


def test_payloads_compare_by_value():
    @dataclasses.dataclass(frozen=True)
    class Config:
        layout: str
        stages: frozenset

    a = consistency._canonical({"config": Config("dp=2", frozenset({"enc", "llm"})), "lr": 1e-3})
    b = consistency._canonical({"lr": 0.001, "config": Config("dp=2", frozenset({"llm", "enc"}))})
    assert a == b
    assert a["config"] == '{"layout": "dp=2", "stages": ["\'enc\'", "\'llm\'"]}'
    long = consistency._canonical({"x": list(range(1000))})["x"]
    assert len(long) < 100 and "sha256" in long


def test_mismatch_message_names_keys_and_processes():
    same = {"seed": "0", "steps": "10", "layout": '"dp=2"'}
    assert consistency._mismatch("config", [same, dict(same)]) is None
    other = {**same, "seed": "1"}
    del other["layout"]
    message = consistency._mismatch("config", [same, dict(same), other])
    assert message == (
        'config differs between processes: process 2 has layout=<missing> (process 0: "dp=2"), '
        "seed=1 (process 0: 0); launch every process with the same flags"
    )


@pytest.mark.multiprocess
def test_sigterm_gives_the_processes_time_to_save_and_exit_0():
    """A preempted job: the launcher passes SIGTERM on and waits (longer than the 5 s an
    interrupt gets) for processes that save before exiting 0; then it exits 0 too."""
    launcher = job.start(
        "hetjax.launch", "--processes", "2", "--devices-per-process", "1", "--",
        "tests.distributed._sleeper", "--save-on-sigterm", "7", own_devices=True,
    )  # fmt: skip
    try:
        assert launcher.stdout is not None
        for _ in range(2):
            launcher.stdout.readline()
        launcher.terminate()
        out, err = launcher.communicate(timeout=TIMEOUT_S)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, err
    assert out.count("saved after 7.0 s") == 2, out
    assert err.splitlines()[-1] == "hetjax.launch: preempted: every process saved and exited 0"
