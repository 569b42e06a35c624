"""Programs one process compiles to train a layout: ``python -m experiments.compile_counts``.

    python -m experiments.compile_counts --devices 8              # one process, 8 devices
    python -m hetjax.launch --processes 2 --devices-per-process 4 -- \\
        experiments.compile_counts                               # the same layout, 2 x 4

Builds the trainer (:func:`experiments.runner.trainer`) of the ``tiny`` preset (default
layout: non-colocated vision ``dp=4`` | LLM ``dp=2,pp=2`` on islands 4 + 4, so with 2 x 4
devices the vision encoder is process 0's and the LLM process 1's), trains ``--steps``
FP32 steps and prints one line per process: ``compile-counts {json}`` with

- ``compiles``: backend compiles (:class:`hetjax.inspect.CompileCounter`) from the start
  of the trainer's construction (its executor's) to the end of the last step: stage programs, the
  optimizer-state initialisation, transfers and every small eager op;
- ``stage_programs``: of those, the stage programs (``<module>_s<i>_<kind>`` and the
  optimizer-state initialisation), the programs of :class:`hetjax.runtime.StageProgram`;
- ``names``: what compiled, in order; ``losses``: every step's loss;
- ``meetings``: barriers this process waited at before a first call of a program whose
  collectives span processes (:mod:`hetjax.distributed.rendezvous`; 0 in one process).

A process compiles only the stages whose devices include one of its own (the others'
outputs are stand-ins, ``StageProgram.stand_in``), so under 2 x 4 each process's counts
are about half the single process's. ``experiments.bench_engine`` runs both and reports
them; ``tests/distributed/own_compiles.py`` checks them and the losses (on
bench_engine's row and in ``tests/distributed/test_own_compiles.py``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

LAYOUTS = ("vision:dp=4", "llm:dp=2,pp=2")
STAGE_PROGRAM = re.compile(r"jit\((\w+_s\d+_(fwd|bwd|zeros|reduce|update)|_opt_init)\)")
PREFIX = "compile-counts "
MODULE = "experiments.compile_counts"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="compile_counts", description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=None, help="one process: devices (8)")
    p.add_argument("--layout", action="append", default=None, help="MODULE:LAYOUT (repeatable)")
    p.add_argument("--placement", default="non-colocated", help="colocated or non-colocated")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    from experiments.cli import setup_devices
    from hetjax import distributed

    info = distributed.initialize(local_device_count=args.devices, cpu=True)
    devices = setup_devices(args.devices, multiprocess=info.is_multiprocess)
    import jax

    from experiments import runner
    from hetjax.distributed import rendezvous
    from hetjax.inspect import CompileCounter

    texts = dict(t.split(":", 1) for t in (args.layout or LAYOUTS))
    config = runner.bench_config(
        steps=args.steps,
        data={"global_batch": args.global_batch},
        parallel={"microbatches": args.microbatches, **runner.layout_fields(texts, args.placement)},
    )
    params = runner.init_params(config)
    with CompileCounter() as counter:
        tr = runner.trainer(config, devices=devices, params=params)
        ex = tr.engine
        losses = [float(ex.step(b)["loss"]) for b in runner.batches(tr, args.steps)]
        jax.block_until_ready(ex.state)
    result = {
        "process": jax.process_index(),
        "processes": jax.process_count(),
        "compiles": counter.count,
        "stage_programs": sum(1 for n in counter.names if STAGE_PROGRAM.fullmatch(n)),
        "local_stages": sorted(f"{k[0]}/{k[1]}" for k, p in ex.programs.items() if p.local),
        "names": counter.names,
        "meetings": rendezvous.meetings(),
        "losses": losses,
    }
    print(PREFIX + json.dumps(result), flush=True)
    return result


def measure(
    args: list[str] = (), *, processes: int = 2, devices: int = 8, timeout_s: float = 600
) -> dict:
    """Runs ``args`` in one process on ``devices`` devices and, at the same time, under
    ``python -m hetjax.launch`` as ``processes`` x ``devices / processes``; returns
    ``{"single": result, "multi": [result per process]}`` (each :func:`main`'s).

    Raises:
        RuntimeError: a run failed or ran past ``timeout_s`` (its stderr's tail).
    """
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith(("HETJAX_", "SLURM_"))}
    # The children set their own device counts; keep XLA's other flags.
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags)
    env.setdefault("JAX_PLATFORMS", "cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    per = str(devices // processes)
    launch = ["hetjax.launch", "--processes", str(processes), "--devices-per-process", per]
    commands = {
        "single": [MODULE, "--devices", str(devices), *args],
        "multi": [*launch, "--timeout", str(int(timeout_s)), "--", MODULE, *args],
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", *cmd],
            cwd=root,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for name, cmd in commands.items()
    }
    out = {}
    try:
        for name, proc in procs.items():
            try:
                stdout, stderr = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                what = f"compile_counts: the {name}-process run passed {timeout_s} s"
                raise RuntimeError(what) from None
            rows = read(stdout)
            if proc.returncode != 0 or len(rows) != (1 if name == "single" else processes):
                raise RuntimeError(
                    f"compile_counts: the {name}-process run failed ({proc.returncode}):\n"
                    + stderr[-3000:]
                )
            out[name] = rows[0] if name == "single" else rows
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return out


def read(stdout: str) -> list[dict]:
    """The result lines of a run's output (a launcher's ``[pI] `` prefixes allowed), by
    process."""
    rows = [json.loads(line.split(PREFIX, 1)[1]) for line in stdout.splitlines() if PREFIX in line]
    return sorted(rows, key=lambda r: r["process"])


if __name__ == "__main__":
    main(sys.argv[1:])
