"""bf16 parity: heterogeneous vs homogeneous loss curves, and the gradient reduction dtype.

    python -m experiments.bench_bf16 --json out.json [--steps 200] [--quick]

Trains the ``tiny`` preset in bfloat16 compute (parameters, gradients' accumulators and
optimizer state float32: ``MLLM(dtype=jnp.bfloat16)``, what ``llava_train --dtype
bfloat16`` builds) on 8 simulated CPU devices, three runs over the same data:

- ``hetero``: colocated, vision ``dp=8``, LLM ``dp=2,tp=2,pp=2`` (the CLI's default);
- ``homo``: the same graph with ``mode="homogeneous"`` (the encoder inherits the LLM's
  layout on its first pipeline stage);
- ``homo_seed1``: ``homo`` with seed 1 instead of 0, the yardstick of run-to-run
  variation. By default (``--seed-kind run``) the seed is the run's, as ``llava_train
  --seed`` defines it (the config tree's ``seed``: "initialisation and data seed"): the
  initial parameters and the data both change. ``--seed-kind init``: only the
  parameter-initialisation seed (the data are the same); ``--seed-kind data``: only the
  data seed (the same initial parameters).

``--seeds N`` trains both layouts at every seed 0 .. N-1 (``hetero_seed<s>``,
``homo_seed<s>``; seed 0's are ``hetero`` and ``homo``): one seed pair is a noisy
yardstick, and so is one layout pair. ``ma_diff_layout_by_seed`` is the layout's
difference at each seed, ``ma_diff_seed_pairs`` every pair of homogeneous seeds, and
``overlap_over_seeds`` whether the first's mean is at most the second's.
``--dtype float32`` runs the same comparison in float32 (how much of the layout's
difference is bf16's and how much 200 steps of float reordering amplify).

bf16 rounds differently under different layouts (tensor-parallel partial sums, other
fusion), so the curves cannot match bit for bit; the claim is that the layout changes
the curve less than a seed does. Keys of the one JSON row:

- ``losses``: per run, the loss of every step;
- ``ma_diff_hetero_vs_homo``, ``ma_diff_seed0_vs_seed1``: mean absolute difference of the
  two runs' ``MA_WINDOW``-step moving averages (``overlap``: the first <= the second);
- ``grad_dtypes``: from the compiled HLO of the LLM's first stage of the ``hetero`` run:
  the element types of the ``bwd`` program's accumulator outputs (``bwd_accumulators``),
  of its matmul outputs (``bwd_dots``), of its collectives (``bwd_collectives``: the
  tensor-parallel ones, bf16 activations), and of the ``reduce`` program's collectives
  that cross data-parallel replicas (``reduce_dp_collectives``: the once-per-step
  gradient reduction, Megatron's ``accumulate_allreduce_grads_in_fp32``);
  ``fp32_accumulation``: the accumulators and the reduction are all ``f32``.
- ``step_time_s``: median wall time of a step, per run.

``--quick`` (for the test): the smallest run that reads every key and keeps the full
run's kinds of program (both modes, a pipelined LLM under the three-phase schedule, a
data-parallel gradient reduction): ``tiny`` cut to one vision and two LLM layers at
sequence 48, 4 devices (vision ``dp=4``, LLM ``dp=2,pp=2``), batch 8, a 2-step moving
average and ``--steps`` 4 by default (the overlap is then not a finding).

``goal_met``: the curves overlap and the accumulation is f32 (``goal_missed``: why not);
a benchmark reports it, printed and in the row, and exits 0 either way. Bad flags are
one-line errors (exit 2).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

DEVICES = 8
GLOBAL_BATCH = 16
MICROBATCHES = 2
MA_WINDOW = 10
LAYOUTS = {"vision": "dp=8", "llm": "dp=2,tp=2,pp=2"}
# --quick: fewer devices, no tp, a layer per stage: fewer and smaller programs to compile
QUICK_DEVICES, QUICK_LAYOUTS = 4, {"vision": "dp=4", "llm": "dp=2,pp=2"}
QUICK_LAYERS = {"vision": 1, "llm": 2}
QUICK_SEQ, QUICK_BATCH, QUICK_MA_WINDOW, QUICK_STEPS = 48, 8, 2, 4
RUNS = (("hetero", "colocated", 0), ("homo", "homogeneous", 0), ("homo_seed1", "homogeneous", 1))
PROBE = ("llm", 0)  # the stage whose programs' dtypes are read


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    json: str | None = None  # where to write the row (a JSON list of one); None: print only
    quick: bool = False  # 4 devices, a layer per stage, few steps (for the test)
    steps: int | None = None  # steps per run; None: 200 (QUICK_STEPS with --quick)
    dtype: str = "bfloat16"  # compute dtype: bfloat16 or float32
    seed_kind: str = "run"  # what homo_seed1 varies: run (both, llava_train's --seed), init, data
    seeds: int = 2  # homogeneous runs with seeds 0 .. seeds-1 (above 2: more seed pairs)


def moving_average(xs: list[float], window: int) -> list[float]:
    """Trailing means over ``window`` values (the first ``window - 1`` points left out)."""
    return [sum(xs[i - window : i]) / window for i in range(window, len(xs) + 1)]


def ma_diff(a: list[float], b: list[float], window: int = MA_WINDOW) -> float:
    """Mean absolute difference of the two curves' moving averages."""
    ma, mb = moving_average(a, window), moving_average(b, window)
    return sum(abs(x - y) for x, y in zip(ma, mb, strict=True)) / len(ma)


def grad_dtypes(ex: Any, rec: Any) -> dict[str, list[str]]:
    """Element types of the probe stage's gradient path, from its compiled programs."""
    import jax

    from hetjax.inspect import collectives, varied_axes
    from hetjax.inspect.hlo import dot_output_dtypes

    mesh = ex.programs[PROBE].mesh
    bwd, reduce = rec.compiled[(PROBE, "bwd")], rec.compiled[(PROBE, "reduce")]
    acc = jax.tree.leaves(bwd.out_info[0])

    def dtypes(compiled, dp_only=False) -> list[str]:
        found = set()
        for c in collectives(compiled.as_text(), mesh.size):
            if not dp_only or "dp" in varied_axes(c, mesh):
                found.update(c.dtypes)
        return sorted(found)

    return {
        "bwd_accumulators": sorted({str(a.dtype) for a in acc}),
        "bwd_dots": sorted(dot_output_dtypes(bwd.as_text())),
        "bwd_collectives": dtypes(bwd),
        "reduce_dp_collectives": dtypes(reduce, dp_only=True),
    }


def train(mode: str, seed: int, work: dict, steps: int, rec: Any = None) -> tuple[list, list, Any]:
    """Losses, step times and the executor of one run (``seed`` goes to what
    ``work["seed_kind"]`` names - both for ``run`` -, the other seed is 0)."""
    from experiments import runner

    kind = work["seed_kind"]
    row = runner.variant(
        work["base"],
        seed=seed if kind in ("run", "data") else 0,  # the data's
        parallel=runner.layout_fields(work["layouts"], mode),
    )
    init = runner.variant(row, seed=seed if kind in ("run", "init") else 0)
    tr = runner.trainer(
        row,
        devices=work["devices"],
        observers=[rec] if rec is not None else [],
        preset=work["preset"],
        params=runner.init_params(init, work["preset"]),
    )
    ex = tr.engine
    losses, times, previous = [], [], None
    for s in range(steps):
        t0 = time.perf_counter()
        metrics = ex.step(tr.data.batch(s))
        if previous is not None:  # read step s-1's metrics after dispatching step s
            losses.append(previous["loss"])
        previous = metrics
        times.append(time.perf_counter() - t0)
    losses.append(previous["loss"])
    return losses, times, ex


def main(config: BenchConfig, devices: list | None = None) -> list[dict]:
    """Runs the three trainings, prints a summary and whether the goal is met, writes
    JSON. ``devices``: the ones to use when a JAX backend already runs (a test calling
    it in-process; the first 4 with ``--quick``); None: set up here."""
    from experiments.cli import ConfigError, setup_devices

    window = QUICK_MA_WINDOW if config.quick else MA_WINDOW
    steps = config.steps or (QUICK_STEPS if config.quick else 200)
    if steps <= window:
        raise ConfigError(f"--steps must exceed the moving-average window {window}")
    if config.seeds < 2:
        raise ConfigError("--seeds must be at least 2 (two seeds to compare)")
    count = QUICK_DEVICES if config.quick else DEVICES
    if devices is None:
        devices = setup_devices(count)  # before anything else starts a JAX backend
    devices = devices[:count]
    from experiments import runner
    from hetjax.inspect import Recorder
    from models.config import get_preset

    cfg = get_preset("tiny")
    if config.quick:
        cfg = dataclasses.replace(
            cfg,
            llm=dataclasses.replace(cfg.llm, depth=QUICK_LAYERS["llm"]),
            vision=dataclasses.replace(cfg.vision, depth=QUICK_LAYERS["vision"]),
            seq_len=QUICK_SEQ,
        )
    cache = runner.share_compiles("bench_bf16_")  # the second homogeneous run loads the first's
    work = {
        "devices": devices,
        "layouts": QUICK_LAYOUTS if config.quick else LAYOUTS,
        "preset": cfg,
        "base": runner.bench_config(
            steps=steps,
            model={"dtype": config.dtype},
            data={"global_batch": QUICK_BATCH if config.quick else GLOBAL_BATCH},
            parallel={"microbatches": MICROBATCHES},
        ),
        "seed_kind": config.seed_kind,
    }
    layouts = work["layouts"]
    losses, times, dtypes = {}, {}, {}
    t0 = time.perf_counter()
    extra = tuple(
        (f"{name}_seed{s}", mode, s)
        for s in range(1, config.seeds)
        for name, mode in (("hetero", "colocated"), ("homo", "homogeneous"))
        if (name, s) != ("homo", 1)
    )
    for name, mode, seed in RUNS + extra:
        rec = Recorder() if name == "hetero" else None
        losses[name], ts, ex = train(mode, seed, work, steps, rec)
        times[name] = statistics.median(ts[1:])
        if rec is not None:
            dtypes = grad_dtypes(ex, rec)
        print(f"  trained {name} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    cache.cleanup()
    layout_diff = ma_diff(losses["hetero"], losses["homo"], window)
    seed_diff = ma_diff(losses["homo"], losses["homo_seed1"], window)

    def run(name: str, seed: int) -> list[float]:
        return losses[name if seed == 0 else f"{name}_seed{seed}"]

    seeds = range(config.seeds)
    by_seed = [ma_diff(run("hetero", s), run("homo", s), window) for s in seeds]
    pairs = {
        f"{a}-{b}": ma_diff(run("homo", a), run("homo", b), window)
        for a in seeds
        for b in seeds
        if a < b
    }
    mean_layout = statistics.mean(by_seed)
    mean_seeds = statistics.mean(pairs.values())
    fp32 = dtypes["bwd_accumulators"] == ["float32"] and dtypes["reduce_dp_collectives"] == ["f32"]
    missed = []
    if layout_diff > seed_diff:
        missed.append(
            f"hetero vs homo differ by {layout_diff:.5f}, more than two seeds ({seed_diff:.5f})"
        )
    if not fp32:
        missed.append(f"gradient accumulation or reduction is not float32: {dtypes}")
    row = {
        "preset": "tiny" if not config.quick else f"tiny, layers {QUICK_LAYERS}",
        "quick": config.quick,
        "dtype": config.dtype,
        "steps": steps,
        "layouts": layouts,
        "seed_varied": {
            "run": "the run's seed: parameter initialisation and data (llava_train --seed)",
            "init": "parameter initialisation (data identical)",
            "data": "data (initial parameters identical)",
        }[config.seed_kind],
        "ma_window": window,
        "ma_diff_hetero_vs_homo": layout_diff,
        "ma_diff_seed0_vs_seed1": seed_diff,
        "overlap": layout_diff <= seed_diff,
        "ma_diff_layout_by_seed": by_seed,  # hetero vs homo at seed 0, 1, ... (--seeds)
        "ma_diff_seed_pairs": pairs,  # homo seed a vs seed b, every pair
        "mean_ma_diff_layout": mean_layout,
        "mean_ma_diff_seed_pairs": mean_seeds,
        "overlap_over_seeds": mean_layout <= mean_seeds,
        "final_loss": {k: v[-1] for k, v in losses.items()},
        "grad_dtypes": dtypes,
        "fp32_accumulation": fp32,
        "goal_met": not missed,
        "goal_missed": missed,
        "step_time_s": times,
        "losses": losses,
    }
    print(f"{'curves':<28} {f'MA-{window} mean |diff|':>18}")
    print(f"{'hetero vs homo':<28} {layout_diff:18.5f}")
    print(f"{'homo seed 0 vs seed 1':<28} {seed_diff:18.5f}")
    if config.seeds > 2:
        for s, d in enumerate(by_seed):
            print(f"{f'hetero vs homo, seed {s}':<28} {d:18.5f}")
        for pair, d in pairs.items():
            print(f"{f'homo seeds {pair}':<28} {d:18.5f}")
        print(f"{'mean, layout / seed pairs':<28} {mean_layout:8.5f} / {mean_seeds:.5f}")
    print(f"overlap (layout <= seed): {row['overlap']}")
    print("final loss: " + ", ".join(f"{k} {v:.4f}" for k, v in row["final_loss"].items()))
    for k, v in dtypes.items():
        print(f"{k:<24} {', '.join(v) or '-'}")
    print(f"goal met: {row['goal_met']}" + "".join(f"\n  missed: {m}" for m in missed))
    runner.finish_rows([row], config.json, [], "goal missed")  # a benchmark reports; it exits 0
    return [row]


def flags(p: Any, d: BenchConfig) -> None:
    from experiments.cli import positive_int

    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=d.dtype)
    p.add_argument("--seeds", type=positive_int, default=d.seeds, help="homogeneous seeds (>= 2)")
    p.add_argument(
        "--seed-kind",
        choices=("run", "init", "data"),
        default=d.seed_kind,
        help="what the 2nd seed varies (run: both, as llava_train --seed)",
    )


if __name__ == "__main__":
    from experiments.runner import run_bench

    quick = "tiniest run, few steps (for the test)"
    run_bench(main, BenchConfig, prog="bench_bf16", doc=__doc__, quick=quick, flags=flags)
