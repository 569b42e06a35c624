"""What freezing saves: compiled FLOPs, optimizer state, memory and time per step.

    python -m experiments.bench_freeze --json out.json [--quick] [--steps N]

Three rows, each a :class:`hetjax.config.TrainConfig` variant (``model.freeze``) run by
:mod:`experiments.runner`'s trainer of the ``small`` preset (``--quick``, for
the test: ``tiny``) on 8 simulated CPU devices, non-colocated (vision ``dp=2,pp=2`` |
LLM ``dp=2,pp=2`` on islands 4 + 4; the pipelined encoder shows a forward-only stage),
global batch 8 in 2 microbatches: ``full`` (everything trains), ``vision`` (LLaVA stage
2: the encoder is frozen) and ``vision,llm`` (stage 1: only the projector trains).
Keys:

- ``compiled_flops_per_step``: the matmul FLOPs of the compiled HLO of every program one
  step calls (:func:`hetjax.inspect.hlo.matmul_flops`, per device, times the stage's
  devices), summed over the calls (a :class:`hetjax.inspect.Recorder` counts them).
  ``xla_cost_analysis_flops_per_step`` is the same sum of ``compiled.cost_analysis()``,
  which counts elementwise work too but a while body once, so the layer scan's blocks
  count as one layer.
- ``flops_ratio_vs_full``: that over the ``full`` row's.
- ``expected_ratio``: the same ratio from the 3x / 2x / 1x rule with the forward the
  backward recomputes (``expected_flops_per_step``:
  :func:`hetjax.runtime.flops.hardware_flops` over the forward FLOPs per part that the
  kernels compute: causal attention in full, the LM head over every token);
  ``model_tflops_per_step`` is the rule without recompute; ``compiled_vs_expected``
  is ``compiled_flops_per_step / expected_flops_per_step``.
- ``opt_state_bytes``: bytes of the optimizer state of all stages (every array once);
  AdamW keeps two moments per trained parameter, so it is at most ``2 x
  trainable_param_bytes`` plus step counters unless frozen parts have state.
- ``peak_bytes_per_stage``: per stage, the largest footprint of its programs
  (:func:`hetjax.inspect.memory.peak_bytes`).
- ``step_time_s``: median wall time of steps 2..``--steps``, each waited for in full.

Exits non-zero unless in every row the compiled FLOPs are within 5% of the expected
ones, absolute and as a ratio to ``full``, and no frozen part has optimizer state.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

DEVICES = 8
GLOBAL_BATCH = 8
MICROBATCHES = 2
LAYOUTS = {"vision": "dp=2,pp=2", "llm": "dp=2,pp=2"}
FREEZES = ((), ("vision",), ("vision", "llm"))
TOLERANCE = 0.05  # compiled FLOP ratio vs the rule's
COUNTER_BYTES = 1024  # optimizer step counters of all stages, at most


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    json: str | None = None  # where to write the rows (a JSON list); None: print only
    quick: bool = False  # the tiny preset (for the test)
    steps: int = 4  # steps per row (the first compiles)


def _nbytes(tree: Any) -> int:
    import jax

    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def base_config(config: BenchConfig) -> Any:
    """The rows' common settings (a row adds ``model.freeze``)."""
    from experiments.runner import bench_config, layout_fields

    return bench_config(
        steps=config.steps,
        model={"preset": "tiny" if config.quick else "small"},
        data={"global_batch": GLOBAL_BATCH},
        parallel={"microbatches": MICROBATCHES, **layout_fields(LAYOUTS, "non-colocated")},
    )


def run(row: Any, devices: list) -> dict:
    """One row: trains ``row.steps`` steps, counting the second step's calls."""
    from experiments import runner
    from hetjax.inspect import Recorder
    from hetjax.inspect.hlo import cost_flops, matmul_flops
    from hetjax.inspect.memory import peak_bytes
    from hetjax.runtime import flops

    rec = Recorder()
    tr = runner.trainer(row, devices=devices, observers=[rec])
    ex, model, graph, seq_len = tr.engine, tr.model.mllm, tr.graph, tr.model.seq_len
    batches = runner.batches(tr, row.steps)
    _, times = runner.timed_steps(ex, batches, rec)  # rec: the second step's calls
    size = {key: prog.mesh.size for key, prog in ex.programs.items()}
    compiled = rec.per_step(lambda c: matmul_flops(c.as_text()), size)
    supervised = int(batches[1]["loss_mask"].sum())
    # The head runs at the loss budget's positions (per cp block), as the trainer counts.
    cp = next(m.layout.cp for m in graph.modules if m.name == "llm")
    head = GLOBAL_BATCH * model.head_positions(seq_len, cp)
    forward, _, executed, attention = tr.model.step_flops(supervised, head)
    freeze = row.model.frozen
    frozen = model.frozen_parts(freeze) if freeze else frozenset()
    trainable = {k: v for k, v in ex.full_params().items() if k not in frozen}
    peaks: dict[str, int] = {}
    for (key, _), c in rec.compiled.items():
        name = f"{key[0]}/{key[1]}"
        peaks[name] = max(peaks.get(name, 0), peak_bytes(c))
    return {
        "freeze": ",".join(freeze) or "none",
        "compiled_flops_per_step": compiled,
        "xla_cost_analysis_flops_per_step": rec.per_step(cost_flops, size),
        "expected_flops_per_step": sum(flops.hardware_flops(graph, executed, attention).values()),
        "model_tflops_per_step": sum(flops.model_flops(graph, forward).values()) / 1e12,
        "opt_state_bytes": _nbytes(ex.opt_state),
        "trainable_param_bytes": _nbytes(trainable),
        "peak_bytes_per_stage": peaks,
        "step_time_s": statistics.median(times),
        "backward_stages": sorted(f"{k[0]}/{k[1]}" for k, p in ex.programs.items() if p.backward),
    }


def add_ratios(rows: list[dict]) -> None:
    full = rows[0]
    for r in rows:
        r["flops_ratio_vs_full"] = r["compiled_flops_per_step"] / full["compiled_flops_per_step"]
        r["expected_ratio"] = r["expected_flops_per_step"] / full["expected_flops_per_step"]
        r["compiled_vs_expected"] = r["compiled_flops_per_step"] / r["expected_flops_per_step"]


def goals() -> list:
    """The conditions every row must meet."""
    from experiments.runner import Goal

    def ratio_off(r: dict) -> float:
        return r["flops_ratio_vs_full"] / r["expected_ratio"] - 1

    return [
        Goal(
            lambda r: abs(ratio_off(r)) <= TOLERANCE,
            lambda r: (
                f"freeze {r['freeze']}: compiled FLOP ratio {r['flops_ratio_vs_full']:.3f} "
                f"is {ratio_off(r):+.1%} off the expected {r['expected_ratio']:.3f}"
            ),
        ),
        Goal(
            lambda r: abs(r["compiled_vs_expected"] - 1) <= TOLERANCE,
            lambda r: (
                f"freeze {r['freeze']}: compiled {r['compiled_flops_per_step']:.4g} FLOPs "
                f"per step vs the expected {r['expected_flops_per_step']:.4g}"
            ),
        ),
        Goal(
            lambda r: r["opt_state_bytes"] <= 2 * r["trainable_param_bytes"] + COUNTER_BYTES,
            lambda r: (
                f"freeze {r['freeze']}: {r['opt_state_bytes']} B of optimizer state for "
                f"{r['trainable_param_bytes']} B of trained parameters: frozen parts have state"
            ),
        ),
    ]


COLUMNS = (
    ("freeze", "<12", "freeze"),
    ("GFLOP/step", "11.3f", lambda r: r["compiled_flops_per_step"] / 1e9),
    ("expected", "9.3f", lambda r: r["expected_flops_per_step"] / 1e9),
    ("ratio", "7.3f", "flops_ratio_vs_full"),
    ("expected", "8.3f", "expected_ratio"),
    ("opt MiB", "8.2f", lambda r: r["opt_state_bytes"] / 2**20),
    ("max peak MiB", "12.2f", lambda r: max(r["peak_bytes_per_stage"].values()) / 2**20),
    ("step s", "7.3f", "step_time_s"),
    (" backward stages", "", lambda r: " " + ", ".join(r["backward_stages"])),
)


def main(config: BenchConfig) -> list[dict]:
    """Runs the three rows, prints a table, writes JSON, checks the goals."""
    from experiments import runner

    devices = runner.start(DEVICES, steps=config.steps)
    base = base_config(config)
    rows = runner.measured(
        [runner.variant(base, model={"freeze": ",".join(f)}) for f in FREEZES],
        lambda row: run(row, devices),
        lambda row: row.model.freeze or "none",
    )
    add_ratios(rows)
    runner.print_table(rows, COLUMNS)
    runner.finish_rows(rows, config.json, runner.missed(rows, goals()), "goal missed")
    return rows


if __name__ == "__main__":
    from experiments.runner import run_bench

    run_bench(
        main, BenchConfig, prog="bench_freeze", doc=__doc__, quick="the tiny preset (for the test)"
    )
