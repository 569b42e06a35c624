"""Starting the project's entry points and multi-process jobs from the tests.

Every test that needs a process of its own (an exit code, a one-line error on stderr, a
signal, several JAX processes) starts it here: ``python -m MODULE`` with the test
process's interpreter, in the repository root, in the suite's environment, with a
timeout. That environment is the test process's own, which conftest fills before JAX
starts: CPU devices, XLA flags (:mod:`tests._xla`) and the shared compilation cache, so
a subprocess compiles like the tests around it and reuses their programs. The processes
of a multi-process job set their own device count instead (``own_devices``).

A test that only needs what an entry point prints, writes and returns runs it in the
test process instead (:func:`run_main`): no interpreter start, no JAX import, and the
programs the test process already traced or loaded stay there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
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


@dataclasses.dataclass(frozen=True)
class Result:
    """What an entry point run in the test process returned and printed."""

    returncode: int
    stdout: str
    stderr: str


def run_main(module: str, *argv: str, log_compiles: bool = False) -> Result:
    """Runs ``python -m module *argv`` in the test process, as a fresh process would run
    it: the module's ``__main__`` block with ``sys.argv`` set, its exit code (``sys.exit``,
    2 for :func:`experiments.cli.run_cli`'s one-line errors; 1 and the traceback on
    stderr for an uncaught exception), and what it printed on stdout and stderr
    (warnings and errors logged included, as bare messages).

    The entry point finds JAX running with the test process's 8 CPU devices; a run that
    asks for fewer (``--devices 2``) gets the first ones (:func:`experiments.cli.
    setup_devices`). It joins no job: the test process is one single-process job.
    What the run changes in the process (environment, ``sys`` hooks, signal handlers,
    logging, JAX's config) is put back afterwards.

    Args:
      log_compiles: JAX logs every trace and compile on stderr (``JAX_LOG_COMPILES=1``).
    """
    import jax

    from hetjax import distributed

    out, err = io.StringIO(), io.StringIO()
    with _isolated(err):
        jax.devices()  # the backend starts here, with the suite's devices, if not yet
        distributed.initialize()  # once per test process; a run's own call returns its info
        if log_compiles:
            jax.config.update("jax_log_compiles", True)
        sys.argv = [module, *argv]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = _exit_code(module)
    return Result(code, out.getvalue(), err.getvalue())


def _exit_code(module: str) -> int:
    """Runs ``module`` as ``__main__``; its exit status, reported as Python would."""
    try:
        with warnings.catch_warnings():
            # Already imported by a test: running it as __main__ again is what we want.
            warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except Exception:
        traceback.print_exc()
        return 1
    return 0


@contextlib.contextmanager
def _isolated(err: io.StringIO) -> Iterator[None]:
    """Puts back what a run may change in the process; meanwhile, log records of
    warnings and errors are written to ``err`` as bare messages (a fresh process's
    last-resort handler, whatever handlers earlier imports installed)."""
    import jax

    environ, argv, hook = dict(os.environ), sys.argv, sys.unraisablehook
    thread_hook = threading.excepthook
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    config = dict(jax.config.values)
    root = logging.getLogger()
    root_handlers, root_level = root.handlers[:], root.level
    capture = logging.StreamHandler(err)
    capture.setLevel(logging.WARNING)
    for key in [k for k in os.environ if k.startswith(_JOB_VARIABLES)]:
        del os.environ[key]
    root.handlers = [capture]
    root.setLevel(logging.WARNING)
    try:
        yield
    finally:
        root.handlers = root_handlers
        root.setLevel(root_level)
        for key, value in config.items():
            if jax.config.values.get(key) != value:
                jax.config.update(key, value)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        sys.argv, sys.unraisablehook = argv, hook
        threading.excepthook = thread_hook
        os.environ.clear()
        os.environ.update(environ)


def check_ok(result: subprocess.CompletedProcess | Result) -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def rows(path: Path) -> list[dict]:
    """The rows of a metrics JSONL file (none if it was never written)."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines()]
