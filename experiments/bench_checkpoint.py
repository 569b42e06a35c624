"""Checkpoint cost per layout: how long a save stops training, its size, restore time.

    python -m experiments.bench_checkpoint --json out.json [--quick] [--dir DIR]

Each row is one :class:`hetjax.Executor` of the ``small`` preset (``--quick``, for the
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
import sys
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
    mode: str = "colocated"
    islands: dict[str, int] | None = None


SCENARIOS = (
    Scenario("colocated", {"vision": "dp=8", "llm": "dp=2,tp=2,pp=2"}),
    Scenario(
        "non-colocated",
        {"vision": "dp=4", "llm": "dp=1,tp=2,pp=2"},
        "non-colocated",
        {"vision": 4, "llm": 4},
    ),
    Scenario("pp2", {"vision": "dp=8", "llm": "dp=4,pp=2"}),
)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What to run; flags map one-to-one onto these fields."""

    json: str | None = None  # where to write the rows (a JSON list); None: print only
    quick: bool = False  # the tiny preset instead of small (for the test)
    steps: int = 4  # training steps before the saves (the first compiles)
    dir: str | None = None  # where checkpoints go; None: a temporary directory


def build(scenario: Scenario, work: dict, params: Any = None):
    """An executor of ``scenario`` (with ``params``, or empty for a restore)."""
    import hetjax

    model = work["model"]
    layouts = {k: hetjax.Layout.parse(v, module=k) for k, v in scenario.layouts.items()}
    model.validate_layouts(layouts)
    plan = hetjax.plan_run(
        model.train_graph(layouts),
        num_devices=DEVICES,
        mode=scenario.mode,
        islands=scenario.islands,
        microbatches=MICROBATCHES,
        global_batch=GLOBAL_BATCH,
    )
    return hetjax.Executor(
        plan,
        params,
        devices=work["devices"],
        optimizer=hetjax.OptimizerConfig(total_steps=100, warmup_steps=0),
    )


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

    from hetjax.checkpoint import Checkpointer
    from hetjax.inspect import Timer

    batches = work["batches"]

    def step(ex, i: int) -> None:
        jax.block_until_ready((ex.step(batches[i % len(batches)]), ex.state))

    ex = build(scenario, work, work["params"])
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
    fresh = build(scenario, work)
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
        preset=work["model"].config.name,
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


def check(rows: list[dict], *, blocking: bool = True) -> list[str]:
    """The goals: saves asynchronous (unless ``blocking=False``), no replicas on disk,
    exact restore. Returns the violations."""
    bad = []
    for r in rows:
        if blocking and not r["save_blocking_s"] < r["step_time_s"]:
            bad.append(
                f"{r['layout']}: a save stops training {r['save_blocking_s']:.3f} s, longer "
                f"than a step ({r['step_time_s']:.3f} s)"
            )
        if r["bytes_on_disk"] > SIZE_SLACK * r["param_and_opt_bytes"]:
            bad.append(
                f"{r['layout']}: {r['bytes_on_disk']} bytes on disk, over {SIZE_SLACK} x the "
                f"{r['param_and_opt_bytes']} raw parameter and optimizer bytes"
            )
        if not r["restored_equal"]:
            bad.append(f"{r['layout']}: the restored parameters differ from the saved ones")
    return bad


def print_table(rows: list[dict]) -> None:
    def mib(n: int) -> str:
        return f"{n / 2**20:.1f}"

    print(
        f"{'layout':14s} {'preset':6s} {'step s':>7s} {'blocking s':>10s} {'first s':>8s}"
        f" {'total s':>8s} {'step+save s':>11s} {'restore s':>9s} {'disk MiB':>9s}"
        f" {'raw MiB':>8s} {'disk/raw':>8s}"
    )
    for r in rows:
        print(
            f"{r['layout']:14s} {r['preset']:6s} {r['step_time_s']:7.3f}"
            f" {r['save_blocking_s']:10.3f} {r['first_save_blocking_s']:8.3f}"
            f" {r['save_total_s']:8.3f} {r['step_time_during_save_s']:11.3f}"
            f" {r['restore_s']:9.3f} {mib(r['bytes_on_disk']):>9s}"
            f" {mib(r['param_and_opt_bytes']):>8s}"
            f" {r['bytes_on_disk'] / r['param_and_opt_bytes']:8.3f}"
        )


def main(config: BenchConfig) -> list[dict]:
    """Runs every layout, prints a table, writes JSON, checks the goals."""
    from experiments.cli import ConfigError, finish_rows, setup_devices

    if config.steps < 2:
        raise ConfigError("--steps must be at least 2 (the first step compiles)")
    if config.dir and os.path.exists(config.dir) and os.listdir(config.dir):
        raise ConfigError(f"--dir {config.dir} is not empty; give an empty or new directory")
    devices = setup_devices(DEVICES)  # before anything starts a JAX backend
    import jax

    from models.config import get_preset
    from models.data import DataConfig, SyntheticLlava
    from models.mllm import MLLM

    cfg = get_preset("tiny" if config.quick else "small")
    model = MLLM(cfg)
    data = SyntheticLlava(DataConfig.for_model(cfg, seq_len=cfg.seq_len, seed=0))
    batches = [data.batch(i, GLOBAL_BATCH) for i in range(config.steps + 2)]
    work = {"devices": devices, "model": model, "batches": batches}
    work["params"] = model.init(jax.random.key(0))
    temporary = None if config.dir else tempfile.TemporaryDirectory(prefix="bench_checkpoint_")
    root = Path(config.dir or temporary.name)
    t0 = time.perf_counter()
    rows = []
    for scenario in SCENARIOS:
        rows.append(run(scenario, work, config.steps, root / scenario.name))
        print(
            f"  measured {scenario.name} ({time.perf_counter() - t0:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
    if temporary is not None:
        temporary.cleanup()
    print_table(rows)
    print(f"{len(rows)} rows in {time.perf_counter() - t0:.0f} s")
    finish_rows(rows, config.json, check(rows, blocking=not config.quick), "goal missed")
    return rows


def parse_args(argv: list[str]) -> BenchConfig:
    from experiments.cli import OneLineParser, positive_int

    p = OneLineParser(prog="bench_checkpoint", description=__doc__.splitlines()[0])
    d = BenchConfig()
    p.add_argument("--json", default=d.json, help="write the rows as a JSON list")
    p.add_argument("--quick", action="store_true", help="the tiny preset (for the test)")
    p.add_argument("--steps", type=positive_int, default=d.steps, help="steps before saving")
    p.add_argument("--dir", default=d.dir, help="where checkpoints go (default: a temp dir)")
    return BenchConfig(**vars(p.parse_args(argv)))


if __name__ == "__main__":
    from experiments.cli import run_cli

    def _run(argv: list[str]) -> int:
        main(parse_args(argv))
        return 0

    run_cli(_run, "bench_checkpoint")
