"""Checkpoint cost per layout: how long a save stops training, its size, restore time.

    python -m experiments.bench_checkpoint --json out.json [--quick] [--dir DIR]

Each row is a :class:`hetjax.config.TrainConfig` variant (its layouts) run by
:mod:`experiments.runner`'s trainer of the ``small`` preset (``--quick``, for the
test: ``tiny``) on 8 simulated CPU devices, global batch 16 in 2 microbatches, in one
of three layouts:

- ``colocated``: the default, vision ``dp=8`` and the LLM ``dp=2,tp=2,pp=2`` on all 8;
- ``non-colocated``: vision ``dp=4`` | LLM ``dp=1,tp=2,pp=2`` on islands 4 + 4;
- ``pp2``: vision ``dp=8`` and the LLM ``dp=4,pp=2`` (pipeline and data parallel only).

It trains ``--steps`` steps, then saves twice with a :class:`hetjax.checkpoint.Checkpointer`
into ``--dir`` (default: a temporary directory, deleted at the end) and restores the
second save into a fresh executor of the same layout. Keys:

- ``step_time_s``: median wall time of steps 2..``--steps``, each waited for in full
  (loss and updated state).
- ``save_blocking_s``: how long ``Checkpointer.save`` takes to return, the time a
  training loop is stopped by a save (the copy of the arrays to host memory; the files
  are written in the background). Measured on the second save, with the state already
  computed, so no step's compute is billed to it; ``first_save_blocking_s`` is the first
  save's (orbax sets up its threads and the directory then).
- ``save_total_s``: from the first save's start until ``wait()`` returns (every file
  written), with nothing else running.
- ``step_time_during_save_s``: the step run while the second save writes in the
  background (on a machine with few cores the writer and the step compete).
- ``restore_s``: ``Checkpointer.restore`` into a new executor until its whole state is
  on its devices.
- ``bytes_on_disk``: the sum of the file sizes in the restored step's directory (arrays
  and metadata).
- ``param_and_opt_bytes``: raw bytes of the parameters and the optimizer state in the
  checkpoint's logical form (every array once, however many devices hold a replica).

Exits non-zero unless, in every row, ``save_blocking_s`` is below ``step_time_s`` (the
save is asynchronous), ``bytes_on_disk`` is at most 1.1 x ``param_and_opt_bytes`` (no
replicas, no per-stage copies, little metadata), and the restored parameters equal the
saved ones bit for bit. ``--quick`` holds the last two only: a ``tiny`` step (~0.2 s on
CPU) is as short as orbax's fixed cost of starting a save, so there the blocking time is
reported, not judged.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

DEVICES = 8
GLOBAL_BATCH = 16
MICROBATCHES = 2
SIZE_SLACK = 1.1  # bytes on disk over raw parameter + optimizer bytes


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One layout of the model's modules."""

    name: str
    layouts: dict[str, str]  # module -> layout text
    mode: str = "colocated"  # non-colocated: islands of the layouts' device counts


SCENARIOS = (
    Scenario("colocated", {"vision": "dp=8", "llm": "dp=2,tp=2,pp=2"}),
    Scenario("non-colocated", {"vision": "dp=4", "llm": "dp=1,tp=2,pp=2"}, "non-colocated"),
    Scenario("pp2", {"vision": "dp=8", "llm": "dp=4,pp=2"}),
)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What to run; flags map one-to-one onto these fields."""

    json: str | None = None  # where to write the rows (a JSON list); None: print only
    quick: bool = False  # the tiny preset instead of small (for the test)
    steps: int = 4  # training steps before the saves (the first compiles)
    dir: str | None = None  # where checkpoints go; None: a temporary directory


def build(scenario: Scenario, work: dict):
    """The trainer of ``scenario`` (from the shared initial parameters)."""
    from experiments import runner

    layouts = runner.layout_fields(scenario.layouts, scenario.mode)
    row = runner.variant(work["base"], parallel={"microbatches": MICROBATCHES, **layouts})
    return runner.trainer(row, devices=work["devices"], params=work["params"])


def raw_bytes(ex) -> int:
    """Bytes of the executor's parameters and optimizer state, each logical array once."""
    import jax
    import numpy as np

    from hetjax.checkpoint.logical import executor_logical

    return sum(
        int(np.dtype(x.dtype).itemsize * x.size) for x in jax.tree.leaves(executor_logical(ex))
    )


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run(scenario: Scenario, work: dict, steps: int, directory: Path) -> dict:
    """One row: train, save twice, restore the second save into a fresh executor."""
    import jax
    import numpy as np

    from experiments import runner
    from hetjax.checkpoint import Checkpointer
    from hetjax.inspect import Timer

    tr = build(scenario, work)
    ex, batches = tr.engine, runner.batches(tr, steps + 2)

    def step(ex, i: int) -> None:
        jax.block_until_ready((ex.step(batches[i % len(batches)]), ex.state))

    timer = Timer()
    for i in range(steps):
        with timer:
            step(ex, i)
    ckpt = Checkpointer(directory, keep=2)
    t0 = time.perf_counter()
    ckpt.save(steps, ex)
    first_blocking = time.perf_counter() - t0
    ckpt.wait()
    total = time.perf_counter() - t0
    step(ex, steps)
    saved = ex.full_params()  # what the second save holds (the next step changes it)
    t0 = time.perf_counter()
    ckpt.save(steps + 1, ex)
    blocking = time.perf_counter() - t0
    t0 = time.perf_counter()
    step(ex, steps + 1)
    during = time.perf_counter() - t0
    ckpt.wait()
    fresh = build(scenario, work).engine  # its initial state: the restore replaces it
    t0 = time.perf_counter()
    meta = ckpt.restore(fresh, step=steps + 1)
    jax.block_until_ready(fresh.state)
    restore = time.perf_counter() - t0
    ckpt.close()
    got = fresh.full_params()
    equal = meta["step"] == steps + 1 and all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(got), strict=True)
    )
    row = dict(
        layout=scenario.name,
        layouts="; ".join(f"{k} {v}" for k, v in scenario.layouts.items()),
        preset=work["base"].model.preset,
        step_time_s=statistics.median(timer.samples[1:] or timer.samples),
        save_blocking_s=blocking,
        first_save_blocking_s=first_blocking,
        save_total_s=total,
        step_time_during_save_s=during,
        restore_s=restore,
        bytes_on_disk=disk_bytes(ckpt.path(steps + 1)),
        param_and_opt_bytes=raw_bytes(ex),
        restored_equal=equal,
    )
    shutil.rmtree(directory, ignore_errors=True)
    return row


def goals(*, blocking: bool = True) -> list:
    """The goals: saves asynchronous (unless ``blocking=False``), no replicas on disk,
    exact restore."""
    from experiments.runner import Goal

    asynchronous = Goal(
        lambda r: r["save_blocking_s"] < r["step_time_s"],
        lambda r: (
            f"{r['layout']}: a save stops training {r['save_blocking_s']:.3f} s, longer "
            f"than a step ({r['step_time_s']:.3f} s)"
        ),
    )
    return [asynchronous] * blocking + [
        Goal(
            lambda r: r["bytes_on_disk"] <= SIZE_SLACK * r["param_and_opt_bytes"],
            lambda r: (
                f"{r['layout']}: {r['bytes_on_disk']} bytes on disk, over {SIZE_SLACK} x "
                f"the {r['param_and_opt_bytes']} raw parameter and optimizer bytes"
            ),
        ),
        Goal(
            lambda r: r["restored_equal"],
            lambda r: f"{r['layout']}: the restored parameters differ from the saved ones",
        ),
    ]


def _mib(key: str):
    return lambda r: f"{r[key] / 2**20:.1f}"


COLUMNS = (
    ("layout", "14s", "layout"),
    ("preset", "6s", "preset"),
    ("step s", "7.3f", "step_time_s"),
    ("blocking s", "10.3f", "save_blocking_s"),
    ("first s", "8.3f", "first_save_blocking_s"),
    ("total s", "8.3f", "save_total_s"),
    ("step+save s", "11.3f", "step_time_during_save_s"),
    ("restore s", "9.3f", "restore_s"),
    ("disk MiB", ">9s", _mib("bytes_on_disk")),
    ("raw MiB", ">8s", _mib("param_and_opt_bytes")),
    ("disk/raw", "8.3f", lambda r: r["bytes_on_disk"] / r["param_and_opt_bytes"]),
)


def main(config: BenchConfig) -> list[dict]:
    """Runs every layout, prints a table, writes JSON, checks the goals."""
    from experiments import runner
    from experiments.cli import ConfigError

    if config.dir and os.path.exists(config.dir) and os.listdir(config.dir):
        raise ConfigError(f"--dir {config.dir} is not empty; give an empty or new directory")
    devices = runner.start(DEVICES, steps=config.steps)
    base = runner.bench_config(
        steps=100,
        optimizer={"warmup_steps": 0},
        model={"preset": "tiny" if config.quick else "small"},
        data={"global_batch": GLOBAL_BATCH},
    )
    work = {"devices": devices, "base": base, "params": runner.init_params(base)}
    temporary = None if config.dir else tempfile.TemporaryDirectory(prefix="bench_checkpoint_")
    root = Path(config.dir or temporary.name)
    t0 = time.perf_counter()
    rows = runner.measured(
        SCENARIOS, lambda s: run(s, work, config.steps, root / s.name), lambda s: s.name
    )
    if temporary is not None:
        temporary.cleanup()
    runner.print_table(rows, COLUMNS)
    print(f"{len(rows)} rows in {time.perf_counter() - t0:.0f} s")
    missed = runner.missed(rows, goals(blocking=not config.quick))
    runner.finish_rows(rows, config.json, missed, "goal missed")
    return rows


def flags(p: Any, d: BenchConfig) -> None:
    p.add_argument("--dir", default=d.dir, help="where checkpoints go (default: a temp dir)")


if __name__ == "__main__":
    from experiments.runner import run_bench

    quick = "the tiny preset (for the test)"
    run_bench(main, BenchConfig, prog="bench_checkpoint", doc=__doc__, quick=quick, flags=flags)
