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
import tempfile
import threading
import time
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


def share_compiles(prefix: str) -> tempfile.TemporaryDirectory:
    """Points JAX's persistent compilation cache at a fresh temporary directory, so that
    the executors of one benchmark that compile the same programs (e.g. two modes of one
    layout, or two seeds) compile them once; keep the returned directory alive while
    they run. A cache already configured (``JAX_COMPILATION_CACHE_DIR``, as the tests
    set) is kept: it serves repeated runs too."""
    import jax

    cache = tempfile.TemporaryDirectory(prefix=prefix)
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache.name)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return cache


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


def synthetic_work(num_devices: int, *, quick: bool, steps: int, global_batch: int) -> dict:
    """A FLOPs benchmark's workload on ``num_devices`` (simulated on CPU; call before
    anything starts a JAX backend): the ``tiny`` (``quick``) or ``small`` MLLM, its
    parameters from key 0 and ``steps`` synthetic batches of ``global_batch`` (keys
    ``devices``, ``model``, ``seq_len``, ``batches``, ``params``).

    Raises:
        ConfigError: fewer than 2 steps (the first one compiles).
    """
    if steps < 2:
        raise ConfigError("--steps must be at least 2 (the first step compiles)")
    devices = setup_devices(num_devices)
    import jax

    from models.config import get_preset
    from models.data import DataConfig, SyntheticLlava
    from models.mllm import MLLM

    cfg = get_preset("tiny" if quick else "small")
    model = MLLM(cfg)
    data = SyntheticLlava(DataConfig.for_model(cfg, seq_len=cfg.seq_len, seed=0))
    return {
        "devices": devices,
        "model": model,
        "seq_len": cfg.seq_len,
        "batches": [data.batch(i, global_batch) for i in range(steps)],
        "params": model.init(jax.random.key(0)),
    }


def timed_steps(ex: Any, batches: list, recorder: Any) -> list[float]:
    """Steps ``ex`` through ``batches``: the first compiles; ``recorder`` (a
    :class:`hetjax.inspect.Recorder` observing ``ex``) counts exactly the second step's
    calls. Returns the wall time of every step after the first, each waited for."""
    import jax

    jax.block_until_ready(ex.step(batches[0]))
    recorder.calls.clear()
    times = []
    for batch in batches[1:]:
        t0 = time.perf_counter()
        jax.block_until_ready((ex.step(batch), ex.state))
        times.append(time.perf_counter() - t0)
        recorder.pause()
    return times


def write_json(path: str | None, obj: Any) -> None:
    """Writes ``obj`` as indented JSON to ``path``; nothing when ``path`` is empty (the
    ``--json`` flag of every entry point)."""
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)


def finish_rows(rows: list[dict], json_path: str | None, violations: list[str], what: str) -> None:
    """A benchmark's ending: writes ``rows`` as a JSON list to ``json_path`` (if given),
    then exits non-zero with ``what`` and one line per violated condition (if any)."""
    write_json(json_path, rows)
    if violations:
        raise SystemExit(f"{what}:\n" + "\n".join(violations))


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


def bench_args(argv: list[str], config: type, *, prog: str, description: str, quick: str) -> Any:
    """A FLOPs benchmark's flags (``--json``, ``--quick``, ``--steps``) parsed into its
    ``config`` dataclass (whose defaults they take); ``quick``: the help of ``--quick``."""
    p = OneLineParser(prog=prog, description=description)
    d = config()
    p.add_argument("--json", default=d.json, help="write the rows as a JSON list")
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--steps", type=positive_int, default=d.steps, help="steps per row")
    return config(**vars(p.parse_args(argv)))


def run_bench(
    main: Callable[[Any], Any], config: type, *, prog: str, doc: str, quick: str
) -> NoReturn:
    """Runs a benchmark's ``main`` on its flags (:func:`bench_args`) as a command
    (:func:`run_cli`); ``doc``: its module docstring, whose first line describes it."""

    def _run(argv: list[str]) -> int:
        main(bench_args(argv, config, prog=prog, description=doc.splitlines()[0], quick=quick))
        return 0

    run_cli(_run, prog)
