"""The one runner of every benchmark: flags, devices, compile cache, rows, tables, goals.

A benchmark row is a :class:`~hetjax.config.TrainConfig` variant of the LLaVA model
(:func:`variant`: layouts, placement, microbatches, recompute, freeze, preset, dtype,
batch ...) built into a :class:`hetjax.train.Trainer` by :func:`trainer`, the same
trainer ``llava_train`` runs; a benchmark times ``trainer.engine.step`` itself and reads
what it measures through observers (:mod:`hetjax.inspect`). No benchmark builds an
executor by hand. What differs between benchmarks is only what they measure: their rows,
a table as columns over the row fields (:func:`print_table`), and their goals (a
:class:`Goal` per row where a condition is one row's, :func:`finish_rows` for the exit
status and the ``--json`` list).
"""

from __future__ import annotations

import dataclasses
import re
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from experiments.cli import (
    ConfigError,
    OneLineParser,
    positive_int,
    run_cli,
    setup_devices,
    write_json,
)

# -- rows as configs --------------------------------------------------------------------------


def variant(base: Any, **changes: Any) -> Any:
    """``base`` (a :class:`~hetjax.config.TrainConfig`) with ``changes``: a field's new
    value, or for a section (``model``, ``data``, ``parallel``, ``optimizer``, ...) a dict
    of its fields' new values.

    Example:
        >>> row = variant(base, parallel={"placement": "non-colocated"}, model={"freeze": "vision"})
    """
    fields = {}
    for name, value in changes.items():
        section = getattr(base, name)
        if dataclasses.is_dataclass(section) and isinstance(value, Mapping):
            value = dataclasses.replace(section, **value)
        fields[name] = value
    return dataclasses.replace(base, **fields)


def bench_config(**changes: Any) -> Any:
    """The stock :class:`~hetjax.config.TrainConfig` with ``changes`` (:func:`variant`)."""
    from hetjax.config import TrainConfig

    return variant(TrainConfig(), **changes)


def layout_fields(layouts: Mapping[str, str], mode: str = "colocated") -> dict[str, Any]:
    """``parallel``'s fields for ``layouts`` (module -> layout text) in an executor mode:
    ``colocated``, ``non-colocated`` (islands of the layouts' device counts, in module
    order) or ``homogeneous`` (colocated, the encoders inheriting the LLM's layout)."""
    from hetjax import Layout

    fields: dict[str, Any] = {"layouts": dict(layouts), "placement": mode, "islands": {}}
    fields["homogeneous"] = mode == "homogeneous"
    if mode == "homogeneous":
        fields["placement"] = "colocated"
    if mode == "non-colocated":
        fields["islands"] = {k: Layout.parse(v).num_devices for k, v in layouts.items()}
    return fields


def init_params(config: Any, preset: Any = None) -> Any:
    """The initial parameters of ``config``'s model (``preset``: instead of
    ``model.preset``'s) from ``seed``: what rows that share them pass to :func:`trainer`."""
    import jax

    from models.llava.task import LlavaTask

    return LlavaTask(config, preset=preset).init(jax.random.key(config.seed))


def trainer(
    config: Any,
    *,
    devices: Sequence[Any],
    observers: Sequence[Any] = (),
    optimizer: Any = None,
    preset: Any = None,
    params: Any = None,
) -> Any:
    """The :class:`hetjax.train.Trainer` of one row: the LLaVA model of ``config`` with
    synthetic data, planned and built (its executor is ``.engine``; not trained yet).

    Args:
        config: the row (a :class:`~hetjax.config.TrainConfig`).
        devices: the row's devices.
        observers: executor observers (:mod:`hetjax.inspect`).
        optimizer: an optax transformation instead of ``config.optimizer``'s AdamW.
        preset: a :class:`models.config.MLLMConfig` instead of ``model.preset`` (a shrunk
            model).
        params: the initial parameters instead of those of ``seed`` (rows sharing one
            initialisation; another initialisation seed than the data's).
    """
    from hetjax.train import Trainer
    from models.llava.task import LlavaBatches, LlavaTask

    task = LlavaTask(config, preset=preset, params=params)
    return Trainer(
        config,
        task,
        LlavaBatches(task),
        devices=devices,
        observers=observers,
        optimizer=optimizer,
    )


def batches(tr: Any, count: int) -> list[dict]:
    """The batches of ``tr``'s first ``count`` steps (made before any is timed)."""
    return [tr.data.batch(i) for i in range(count)]


def timed_steps(ex: Any, batches: list, recorder: Any = None) -> tuple[list[float], list[float]]:
    """Steps ``ex`` (an executor or the reference trainer) through ``batches``; the first
    compiles. Returns per later step the host time until ``step`` returns and the wall
    time until its loss and parameters are ready. ``recorder`` (a
    :class:`hetjax.inspect.Recorder` observing ``ex``) counts exactly the second step's
    calls."""
    import jax

    def wait(metrics: Any) -> None:
        float(metrics["loss"])
        jax.block_until_ready(ex.params)

    wait(ex.step(batches[0]))
    if recorder is not None:
        recorder.calls.clear()
    host, total = [], []
    for batch in batches[1:]:
        t0 = time.perf_counter()
        metrics = ex.step(batch)
        host.append(time.perf_counter() - t0)
        wait(metrics)
        total.append(time.perf_counter() - t0)
        if recorder is not None:
            recorder.pause()
    return host, total


def start(count: int, *, steps: int | None = None, cache: str | None = None) -> list:
    """A benchmark's ``count`` devices (simulated on CPU: call it before anything starts a
    JAX backend), once ``steps`` (if given) is checked, with a compile cache shared by the
    rows (:func:`share_compiles`, its directory ``cache``-prefixed) if ``cache`` is given.

    Raises:
        ConfigError: fewer than 2 steps (the first one compiles).
    """
    if steps is not None and steps < 2:
        raise ConfigError("--steps must be at least 2 (the first step compiles)")
    devices = setup_devices(count)
    if cache:
        _CACHES.append(share_compiles(cache))
    return devices


_CACHES: list[tempfile.TemporaryDirectory] = []  # alive while the benchmark runs


def measured(items: Sequence[Any], run: Callable[[Any], Any], name: Callable[[Any], str]) -> list:
    """``run(item)`` of every item, each followed by a progress line (stderr)."""
    t0, out = time.perf_counter(), []
    for item in items:
        out.append(run(item))
        print(f"  measured {name(item)} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return out


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


# -- tables and goals -------------------------------------------------------------------------

# A table column: (header, format spec of its cells, row key or function of the row).
Column = tuple[str, str, "str | Callable[[dict], Any]"]
_ALIGN = re.compile(r"^([<>^]?)(\d*)")


def print_table(rows: Sequence[dict], columns: Sequence[Column]) -> None:
    """Prints ``rows`` as a table of ``columns``; a header takes its cells' width and
    alignment (left where the spec says ``<``, else right)."""

    def head(header: str, spec: str) -> str:
        align, width = _ALIGN.match(spec).groups()
        return format(header, f"{align or '>'}{width}")

    def cell(row: dict, spec: str, get: Any) -> str:
        return format(get(row) if callable(get) else row[get], spec)

    print(" ".join(head(h, spec) for h, spec, _ in columns).rstrip())
    for row in rows:
        print(" ".join(cell(row, spec, get) for _, spec, get in columns).rstrip())


@dataclasses.dataclass(frozen=True)
class Goal:
    """A condition every row must meet: ``holds(row)``, else ``says(row)`` (one line)."""

    holds: Callable[[dict], bool]
    says: Callable[[dict], str]


def missed(rows: Sequence[dict], goals: Sequence[Goal]) -> list[str]:
    """One line per (row, goal) that does not hold, rows in order."""
    return [g.says(r) for r in rows for g in goals if not g.holds(r)]


def finish_rows(rows: list[dict], json_path: str | None, violations: list[str], what: str) -> None:
    """A benchmark's ending: writes ``rows`` as a JSON list to ``json_path`` (if given),
    then exits non-zero with ``what`` and one line per violated condition (if any)."""
    write_json(json_path, rows)
    if violations:
        raise SystemExit(f"{what}:\n" + "\n".join(violations))


# -- the command line -------------------------------------------------------------------------


def run_bench(
    main: Callable[[Any], Any],
    config: type,
    *,
    prog: str,
    doc: str,
    quick: str,
    flags: Callable[[OneLineParser, Any], None] | None = None,
) -> NoReturn:
    """Runs a benchmark's ``main`` as a command (:func:`experiments.cli.run_cli`) on its
    flags parsed into its ``config`` dataclass (whose defaults they take): ``--json``,
    ``--quick`` (``quick``: its help), ``--steps``, and what ``flags(parser, defaults)``
    adds, one flag per further field. ``doc``: the module docstring (its first line
    describes the benchmark)."""

    def _run(argv: list[str]) -> int:
        p = OneLineParser(prog=prog, description=doc.splitlines()[0])
        d = config()
        p.add_argument("--json", default=d.json, help="write the rows as a JSON list")
        p.add_argument("--quick", action="store_true", help=quick)
        p.add_argument("--steps", type=positive_int, default=d.steps, help="steps per row")
        if flags is not None:
            flags(p, d)
        main(config(**vars(p.parse_args(argv))))
        return 0

    run_cli(_run, prog)
