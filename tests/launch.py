"""Starting the project's entry points and multi-process jobs from the tests.

Every test that needs a process of its own (an exit code, a one-line error on stderr, a
signal, several JAX processes) starts it here: ``python -m MODULE`` with the test
process's interpreter, in the repository root, in the suite's environment, with a
timeout. That environment is the test process's own, which conftest fills before JAX
starts: CPU devices, XLA flags (:mod:`tests._xla`) and the shared compilation cache, so
a subprocess compiles like the tests around it and reuses their programs. The processes
of a multi-process job set their own device count instead (``own_devices``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import pytest

from tests._xla import subprocess_flags

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300  # per process, unless a test says otherwise
TRAIN = "experiments.llava_train"  # the main job
# Settings of an outer launcher or cluster that would make a started process join a job.
_JOB_VARIABLES = ("HETJAX_", "SLURM_", "OMPI_")
K = TypeVar("K")


def environment(*, own_devices: bool = False, **extra: str) -> dict[str, str]:
    """The suite's environment for a subprocess, plus ``extra``.

    Args:
      own_devices: the process sets its own device count (a process of a multi-process
        job, whose launcher or ``--devices`` flag sets it): XLA_FLAGS without the test
        process's 8 devices.
      **extra: variables to set (they win).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(_JOB_VARIABLES)}
    if own_devices:
        env["XLA_FLAGS"] = subprocess_flags()
    # ``tests`` is not installed with the project; the workers a launcher starts import it.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env | extra


def start(
    module: str, *args: str, env: Mapping[str, str] | None = None, own_devices: bool = False
) -> subprocess.Popen:
    """Starts ``python -m module *args`` with text pipes; ``env``: extra variables."""
    return _start(["-m", module, *args], env, own_devices)


def start_train(args: Sequence[str], env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """Starts the main job (``python -m experiments.llava_train``) with ``args``."""
    return start(TRAIN, *args, env=env)


def run(
    module: str,
    *args: str,
    timeout: float = TIMEOUT_S,
    env: Mapping[str, str] | None = None,
    own_devices: bool = False,
) -> subprocess.CompletedProcess:
    """Runs ``python -m module *args`` to its end; fails the test if it runs past ``timeout``."""
    return wait(start(module, *args, env=env, own_devices=own_devices), module, timeout)


def run_code(
    code: str, *, timeout: float = TIMEOUT_S, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Runs ``python -c code`` to its end, like :func:`run`."""
    return wait(_start(["-c", code], env, False), "python -c", timeout)


def _start(argv: list[str], env: Mapping[str, str] | None, own_devices: bool):
    return subprocess.Popen(
        [sys.executable, *argv],
        cwd=ROOT,
        env=environment(own_devices=own_devices, **(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _collect(proc: subprocess.Popen, timeout: float) -> tuple[subprocess.CompletedProcess, bool]:
    """The process's result once it ends, and whether it had to be killed at ``timeout``."""
    try:
        out, err = proc.communicate(timeout=timeout)
        late = False
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        late = True
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), late


def wait(
    proc: subprocess.Popen, what: str, timeout: float = TIMEOUT_S
) -> subprocess.CompletedProcess:
    """``proc``'s result; fails the test, naming ``what``, if it runs past ``timeout``."""
    return finish({what: proc}, timeout)[what]


def finish(
    procs: Mapping[K, subprocess.Popen], timeout: float = TIMEOUT_S
) -> dict[K, subprocess.CompletedProcess]:
    """Waits for every started process (each killed after ``timeout``); name -> its result.
    Fails the test, once all have ended, if any ran past the timeout."""
    done = {name: _collect(proc, timeout) for name, proc in procs.items()}
    late = [
        f"{name} ran past {timeout} s:\n{r.stderr[-3000:]}" for name, (r, l) in done.items() if l
    ]
    if late:
        pytest.fail("\n".join(late))
    return {name: result for name, (result, _) in done.items()}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_job(
    processes: int,
    argv: Callable[[int, str], Sequence[str]],
    env: Callable[[int, str], Mapping[str, str]] = lambda process, coordinator: {},
) -> list[subprocess.Popen]:
    """Starts the processes of one multi-process job by hand (no launcher), meeting at a
    free local coordinator address; each sets its own device count.

    Args:
      processes: how many.
      argv: (process id, coordinator ``host:port``) -> that process's module and arguments.
      env: (process id, coordinator) -> its extra environment variables.
    """
    coordinator = f"127.0.0.1:{free_port()}"
    return [
        start(*argv(i, coordinator), env=env(i, coordinator), own_devices=True)
        for i in range(processes)
    ]


def process_lines(text: str, process: int) -> list[str]:
    """The lines ``python -m hetjax.launch`` passed on from ``process``, prefix ``[pN]`` off."""
    prefix = f"[p{process}] "
    return [line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix)]


def check_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def rows(path: Path) -> list[dict]:
    """The rows of a metrics JSONL file (none if it was never written)."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines()]
