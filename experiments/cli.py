"""Command-line plumbing shared by the experiment entry points.

``argparse`` prints a usage block and exits 2 on a bad flag; users asked for one line
that names the fix, so :class:`OneLineParser` raises :class:`ConfigError` instead and
:func:`run_cli` prints it as a single line with a non-zero exit, never a traceback.

:func:`setup_devices` picks the devices of a single- or multi-process run; a
multi-process run joins its job first with :func:`hetjax.distributed.initialize`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pkgutil
import sys
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any, NoReturn

from hetjax.argtypes import non_negative_int as non_negative_int
from hetjax.argtypes import positive_float as positive_float
from hetjax.argtypes import positive_int as positive_int


class ConfigError(ValueError):
    """A user's flag or configuration is invalid; the message names the fix."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see --help)")


def accelerator_installed() -> bool:
    """Whether JAX may find a GPU or TPU here: ``JAX_PLATFORMS`` names one, or (unset) a
    CUDA / ROCm plugin or libtpu is installed. Looks at packages only, so it can run
    before :func:`hetjax.distributed.initialize`, which must come before any backend."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    if platforms:
        return any(p.strip() not in ("", "cpu") for p in platforms.split(","))
    try:
        import jax_plugins  # the namespace package of JAX's PJRT plugins
    except ImportError:
        plugins: list[str] = []
    else:
        plugins = [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
    return any("cuda" in n or "rocm" in n for n in plugins) or (
        importlib.util.find_spec("libtpu") is not None
    )


def allow_slow_collectives(seconds: int = 600) -> None:
    """XLA:CPU aborts the process when a collective waits 40 s for a participant. Many
    simulated devices on few cores (or a loaded laptop) can starve a device thread that
    long; wait longer instead. Must run before the backend starts; no effect on GPU."""
    flag = "--xla_cpu_collective_call_terminate_timeout_seconds"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}={seconds}".strip()


def setup_devices(
    requested: int | None, *, multiprocess: bool = False, default_cpu: int = 8
) -> list:
    """Returns the devices to train on: in a multi-process run, every process's.

    Single process: ``requested`` devices, simulated on CPU when there is no GPU
    (``default_cpu`` if None); run it before anything touches a JAX backend, or (JAX
    already running: a notebook, the tests) it takes the first of the devices there are.
    Multi-process (after :func:`hetjax.distributed.initialize`, which already fixed the
    CPU device count per process): all global devices, in ``jax.devices()`` order; on
    GPU, ``requested`` keeps the first ``requested`` devices of each process.

    Raises:
        ConfigError: more devices requested than there are (on GPU).
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    allow_slow_collectives()
    import jax

    if multiprocess:
        devices = jax.devices()
        local = jax.local_device_count()
        if requested is None or devices[0].platform == "cpu" or requested == local:
            return devices
        if requested > local:
            raise ConfigError(
                f"--devices {requested} (per process) but process {jax.process_index()} sees "
                f"only {local} {devices[0].platform} devices; use --devices {local} or fewer"
            )
        by_process = defaultdict(list)
        for d in devices:
            by_process[d.process_index].append(d)
        return [d for p in sorted(by_process) for d in by_process[p][:requested]]
    try:
        jax.config.update("jax_num_cpu_devices", requested or default_cpu)
    except RuntimeError:
        # JAX already runs in this process (a notebook; the tests, which run entry
        # points in the test process): its devices are fixed, so take the first ones.
        pass
    devices = jax.devices()
    if requested is not None and requested > len(devices):
        raise ConfigError(
            f"--devices {requested} but only {len(devices)} {devices[0].platform} devices are "
            f"visible; use --devices {len(devices)} or fewer"
        )
    if devices[0].platform == "cpu":
        return devices[: requested or default_cpu]
    return devices[: requested or len(devices)]


def write_json(path: str | None, obj: Any) -> None:
    """Writes ``obj`` as indented JSON to ``path``; nothing when ``path`` is empty (the
    ``--json`` flag of every entry point)."""
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)


def run_cli(main: Callable[[list[str]], int], prog: str) -> NoReturn:
    """Runs ``main(argv)`` and turns :class:`ConfigError` / ``ValueError`` into one line."""
    try:
        code = main(sys.argv[1:])
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.stderr.flush()
        # The line is the whole report. A failed library call may leave background work
        # behind (a damaged checkpoint: orbax's pending tensorstore reads, whose
        # coroutines are collected after their event loop closed); at interpreter exit
        # Python would print each as "Exception ignored in ..." - thousands of lines,
        # timing-dependent. Nothing is left to report after the one line.
        sys.unraisablehook = lambda _: None
        threading.excepthook = lambda _: None  # (a background reader's late failure too)
        _silence_stderr()
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code)


def _silence_stderr() -> None:
    """Points file descriptor 2 at /dev/null: what native code (XLA, tensorstore) or a
    thread would print after the one error line, at any timing, goes nowhere. Only for
    the process's own stderr (not when a caller or a test captures it)."""
    if sys.stderr is not sys.__stderr__:
        return
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
    except OSError:
        pass
