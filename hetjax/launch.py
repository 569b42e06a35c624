"""Local multi-process launcher: ``python -m hetjax.launch --processes N ... -- MODULE ARGS``.

Starts N copies of ``python -m MODULE ARGS`` on this machine (``-- -m MODULE ARGS``, as
``torchrun`` users type it, means the same), each told its place in the job through
``HETJAX_COORDINATOR`` / ``HETJAX_NUM_PROCESSES`` / ``HETJAX_PROCESS_ID`` /
``HETJAX_LOCAL_DEVICES`` (read by :func:`hetjax.distributed.initialize`), and streams
their output line by line with a ``[p0] `` prefix. If a process fails, the others get
``--grace`` seconds to stop on their own (their watchdog names the failure), then are
killed; the launcher prints one line naming the first process that failed and exits
non-zero. It exits 0 only if every process did. On SIGTERM (a batch system preempting
the job) it passes the signal on and gives the processes ``--preempt-grace`` seconds to
save and exit (the trainer saves at its next step boundary): all exiting 0 is a
preempted job that ended well (exit 0), else 143. Unlike ``torchrun`` it does not restart
anything, and unlike ``mpirun`` it needs nothing installed: it is for one machine.

Example (2 processes x 4 simulated CPU devices)::

    python -m hetjax.launch --processes 2 --devices-per-process 4 -- \\
        experiments.llava_train --steps 10

Several machines with SLURM need no launcher: the trainer's
:func:`hetjax.distributed.initialize` sees the SLURM job and lets
``jax.distributed.initialize()`` read everything from SLURM's variables, so start one
task per process (one per GPU here)::

    srun --nodes 2 --ntasks-per-node 8 --gpus-per-node 8 \\
        python -m experiments.llava_train --steps 10

Elsewhere, start one process per machine by hand with the trainer's flags
``--coordinator HOST0:PORT --num-processes N --process-id I``.

With ``--gpu`` each local process gets its own ``--devices-per-process`` GPUs through
``CUDA_VISIBLE_DEVICES``; without it the processes run on CPU with gloo collectives.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, NoReturn

from hetjax.argtypes import non_negative_float, positive_float, positive_int
from hetjax.distributed import (
    ENV_COORDINATOR,
    ENV_LOCAL_DEVICES,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    PEER_FAILED_EXIT_CODE,
)

PROG = "hetjax.launch"
_TERM_WAIT_S = 5.0  # on an interrupt: after SIGTERM, before SIGKILL
_POLL_S = 0.05


class _UsageError(Exception):
    pass


class _Terminated(Exception):
    """The launcher got SIGTERM (e.g. from a batch system or a CI timeout)."""


def _on_sigterm(signum, frame) -> NoReturn:
    raise _Terminated


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _parser() -> _Parser:
    p = _Parser(
        prog=f"python -m {PROG}",
        description="Start N local JAX processes of one Python module.",
        usage=f"python -m {PROG} --processes N --devices-per-process K [options] "
        "-- [-m] MODULE [ARGS ...]",
    )
    p.add_argument(
        "--processes", type=positive_int, required=True, metavar="N", help="processes to start"
    )
    p.add_argument(
        "--devices-per-process",
        type=positive_int,
        required=True,
        metavar="K",
        help="devices each process uses (simulated CPU devices, or GPUs with --gpu)",
    )
    p.add_argument(
        "--port", type=positive_int, metavar="P", help="coordinator port (default: a free one)"
    )
    p.add_argument(
        "--timeout", type=positive_float, metavar="S", help="stop everything after S seconds"
    )
    p.add_argument(
        "--grace",
        type=non_negative_float,
        default=10.0,
        metavar="S",
        help="seconds the others get to stop on their own after a failure (default 10)",
    )
    p.add_argument(
        "--preempt-grace",
        type=non_negative_float,
        default=120.0,
        metavar="S",
        help="on SIGTERM: seconds the processes get to save and exit on their own (a "
        "trainer saves at its next step boundary) before they are killed (default 120)",
    )
    p.add_argument("--gpu", action="store_true", help="give each process its own GPUs")
    return p


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Splits ``FLAGS -- [-m] MODULE ARGS``; raises ``_UsageError`` with one line."""
    if "--" in argv:
        cut = argv.index("--")
        flags, command = argv[:cut], argv[cut + 1 :]
    else:
        flags, command = argv, []
    args = _parser().parse_args(flags)
    if command[:1] == ["-m"]:  # torchrun's and python's spelling of the same thing
        command = command[1:]
        if not command:
            raise _UsageError(
                "missing the module after '-m': give e.g. '-- -m experiments.llava_train'"
            )
    if not command:
        raise _UsageError("missing the program: add '-- MODULE [ARGS ...]' after the flags")
    if command[0].startswith("-") or not re.fullmatch(r"[A-Za-z_][\w.]*", command[0]):
        raise _UsageError(
            f"{command[0]!r} is not a Python module name: give e.g. '-- experiments.llava_train'"
        )
    if args.port is not None and args.port > 65535:
        raise _UsageError(f"argument --port: {args.port} is not a port (1..65535)")
    return args, command


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _environment(args: argparse.Namespace, port: int, process: int) -> dict[str, str]:
    env = dict(os.environ)
    k = args.devices_per_process
    env.update(
        {
            ENV_COORDINATOR: f"127.0.0.1:{port}",
            ENV_NUM_PROCESSES: str(args.processes),
            ENV_PROCESS_ID: str(process),
            ENV_LOCAL_DEVICES: str(k),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if args.gpu:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(process * k + i) for i in range(k))
    else:
        env["JAX_PLATFORMS"] = "cpu"
        # Also for programs that never call hetjax.distributed.initialize.
        flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
        env["XLA_FLAGS"] = f"{flags.strip()} --xla_force_host_platform_device_count={k}".strip()
    return env


def _die_with_parent() -> None:
    # Linux: a child gets SIGKILL if the launcher itself is killed, so nothing is orphaned.
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort on other systems
        pass


class _Prefixer:
    """Copies a child's stream to ours line by line, each line prefixed."""

    lock = threading.Lock()

    def __init__(self, source: IO[bytes], sink: IO[str], prefix: str):
        self.source, self.sink, self.prefix = source, sink, prefix.encode()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        out = getattr(self.sink, "buffer", None)
        for line in iter(self.source.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            with self.lock:
                if out is not None:
                    self.sink.flush()
                    out.write(self.prefix + line)
                    out.flush()
                else:  # a text-only sink (e.g. captured in tests)
                    self.sink.write((self.prefix + line).decode(errors="replace"))
                    self.sink.flush()
        self.source.close()


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _stop(procs: list[subprocess.Popen], *, patience_s: float = 0.0) -> None:
    """Ends the processes still running: SIGTERM first if ``patience_s`` > 0, then SIGKILL.

    JAX catches SIGTERM (its preemption notifier), so a process that ignored its grace
    period is killed outright; SIGTERM only serves an interrupted launch.
    """
    alive = [p for p in procs if p.poll() is None]
    if patience_s > 0:
        for p in alive:
            p.terminate()
        deadline = time.monotonic() + patience_s
        for p in alive:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for p in alive:
        if p.poll() is None:
            p.kill()
            p.wait()


def _spawn(args: argparse.Namespace, command: list[str], port: int, i: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", *command],
        env=_environment(args, port, i),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
    )


def _wait(
    procs: list[subprocess.Popen], grace: float, timeout: float | None
) -> tuple[dict[int, tuple[float, int]], bool]:
    """Exit (time, code) per process that ended; stops waiting ``grace`` s after a failure."""
    start = time.monotonic()
    exits: dict[int, tuple[float, int]] = {}
    stop_at: float | None = None
    while len(exits) < len(procs):
        now = time.monotonic()
        for i, proc in enumerate(procs):
            if i not in exits and (code := proc.poll()) is not None:
                exits[i] = (now, code)
                if code != 0 and stop_at is None:
                    stop_at = now + grace
        if stop_at is not None and now >= stop_at:
            break
        if timeout is not None and now - start > timeout:
            return exits, True
        time.sleep(_POLL_S)
    return exits, False


def run(args: argparse.Namespace, command: list[str]) -> int:
    """Starts the processes, waits for them; returns the launcher's exit status."""
    port = args.port or _free_port()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    procs: list[subprocess.Popen] = []
    streams: list[_Prefixer] = []
    try:
        for i in range(args.processes):
            procs.append(proc := _spawn(args, command, port, i))
            assert proc.stdout is not None and proc.stderr is not None
            streams.append(_Prefixer(proc.stdout, sys.stdout, f"[p{i}] "))
            streams.append(_Prefixer(proc.stderr, sys.stderr, f"[p{i}] "))
        exits, timed_out = _wait(procs, args.grace, args.timeout)
    except _Terminated:
        # Preemption (a batch system's SIGTERM): every process gets it and the trainer's
        # own time to save at its next step boundary; a job whose processes all exit 0
        # that way ended well.
        _stop(procs, patience_s=args.preempt_grace)
        if procs and all(p.returncode == 0 for p in procs):
            print(f"{PROG}: preempted: every process saved and exited 0", file=sys.stderr)
            return 0
        print(f"{PROG}: interrupted; stopped all processes", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        _stop(procs, patience_s=_TERM_WAIT_S)
        print(f"{PROG}: interrupted; stopped all processes", file=sys.stderr)
        return 130
    finally:
        _stop(procs)
        for s in streams:
            s.thread.join(timeout=5.0)
    # The cause, not an echo: a process that stopped because of a peer exits with
    # PEER_FAILED_EXIT_CODE, so prefer any other failure, then the earliest.
    failures = sorted(
        (code == PEER_FAILED_EXIT_CODE, when, i, code)
        for i, (when, code) in exits.items()
        if code != 0
    )
    if failures:
        _, _, i, code = failures[0]
        others = len(procs) - len(exits)
        tail = f"; stopped {others} other process{'es' if others != 1 else ''}" if others else ""
        print(f"{PROG}: process {i} {_describe(code)}{tail}", file=sys.stderr)
        return code if 0 < code < 128 else 1
    if timed_out:
        print(f"{PROG}: timed out after {args.timeout:g} s; stopped all processes", file=sys.stderr)
        return 124
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args, command = parse_args(sys.argv[1:] if argv is None else argv)
    except _UsageError as e:
        print(f"{PROG}: error: {e} (see --help)", file=sys.stderr)
        return 2
    return run(args, command)


if __name__ == "__main__":
    sys.exit(main())
