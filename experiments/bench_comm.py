"""Communication per module: heterogeneous layouts vs the homogeneous baseline.

    python -m experiments.bench_comm --json out.json [--quick]

The paper's case against one layout for the whole graph: an encoder that inherits the
LLM's tensor parallelism pays all-reduces around tiny matmuls, and one that inherits
context parallelism splits a short patch sequence over cp ranks that must then pass K/V
blocks around a ring in every layer, saving no memory worth having. This benchmark
measures, on 8 simulated CPU devices, the paper's layouts scaled down (model ``tiny`` or
``tiny-moe``), each as the heterogeneous executor (colocated: the encoder ``dp=8``, the
LLM its own layout) and as the homogeneous baseline (``mode="homogeneous"``: the encoder
inherits the LLM's layout without PP):

- ``tp4``: LLM ``dp=2,tp=4`` (the homogeneous encoder inherits tp=4);
- ``cp2``: LLM ``dp=2,cp=2,tp=2`` (inherits cp=2 and tp=2);
- ``cp4``: LLM ``dp=2,cp=4`` (inherits cp=4 only);
- ``moe``: ``tiny-moe`` LLM ``dp=4,ep=2,tp=2`` (inherits ep=2 - a dense encoder reads it
  as data parallelism - and tp=2).

``--quick`` (for the test) runs ``cp2`` and ``moe`` (each kind of inheritance: tp, cp,
ep; both models), with fewer timed steps (about two minutes).

One JSON row per (scenario, mode, module), with:

- ``collective_bytes``: by kind (all-reduce, all-gather, reduce-scatter, all-to-all,
  collective-permute), summed over the module's devices, per step. The executor
  reports every stage program it compiles (``on_compile``, kept by a
  :class:`hetjax.inspect.Recorder` passed at construction, which also counts the first
  step's calls); each collective of its HLO counts its full buffer per device
  (all-gather: its result; reduce-scatter: its operand; the others: their operand =
  result), times the trip counts of the ``while`` loops around it
  (``known_trip_count``: the scanned layers), times the program's calls per step
  (counted in that step), times the stage's devices.
  XLA:CPU has no reduce-scatter pass: a reduce-scatter stays an all-reduce followed by
  a dynamic slice, and counts as an all-reduce here. The HLO is read by
  :func:`hetjax.inspect.collectives`.
- ``boundary_bytes``: bytes the module's outgoing link moves per step (forward plan and
  the cotangent's reverse plan, every microbatch; cross-island plus island-local bytes,
  from :class:`hetjax.boundary.TransferPlan`), plus its pipeline stage-to-stage copies:
  the ``nbytes`` of the first step's ``on_transfer`` events.
- ``peak_bytes_per_device``: the largest ``memory_analysis()`` footprint (arguments +
  outputs - aliased + temporaries) of the module's programs, per device.
- ``step_time_s``: median wall time of the timed steps (the whole step, both modules;
  the Recorder stays attached, which costs the executor an argument signature per
  program call, about 20 us); ``compute_time_s``: the module's F/B time in one profiled
  step (extra).

Exits non-zero unless, in every scenario where the homogeneous encoder inherits
``tp > 1`` or ``cp > 1``, the heterogeneous encoder moves fewer collective bytes. An
encoder inheriting ``cp`` splits its patch tokens over cp and rings K/V blocks around
its cp ranks in every layer (bidirectional ring attention), exactly as the LLM does -
that is what inheriting a layout means here; ``dp=8`` instead needs no ring at all.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import defaultdict
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

PROGRAMS = ("fwd", "bwd", "zeros", "reduce", "update")
DEVICES = 8
GLOBAL_BATCH = 16


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One LLM layout; the encoder is ``dp=8`` (heterogeneous) or inherits it."""

    name: str
    preset: str  # model preset
    layouts: dict[str, str]  # module -> layout text of the heterogeneous run
    microbatches: int = 1


SCENARIOS = (
    Scenario("tp4", "tiny", {"vision": "dp=8", "llm": "dp=2,tp=4"}),
    Scenario("cp2", "tiny", {"vision": "dp=8", "llm": "dp=2,cp=2,tp=2"}),
    Scenario("cp4", "tiny", {"vision": "dp=8", "llm": "dp=2,cp=4"}),
    Scenario("moe", "tiny-moe", {"vision": "dp=8", "llm": "dp=4,ep=2,tp=2"}),
)
# cp2 inherits cp and tp, moe ep and tp on the MoE model; tp4 and cp4 alone are covered
# by the program tests
QUICK = ("cp2", "moe")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What to run; flags map one-to-one onto these fields."""

    json: str | None = None  # where to write the rows (a JSON list); None: print only
    quick: bool = False  # scenarios cp2 and moe, fewer timed steps (for the test)
    steps: int = 5  # steps per executor (the first compiles; the rest are timed)


def module_rows(ex, rec) -> dict[str, dict[str, Any]]:
    """Collective bytes, boundary bytes and peak bytes per module, from a
    :class:`hetjax.inspect.Recorder` that counted one step."""
    from hetjax.inspect import KINDS, bytes_by_kind, collectives, peak_bytes

    rows = {}
    for spec in ex.graph.modules:
        total = dict.fromkeys(KINDS, 0)
        peak = 0
        for key, prog in ex.programs.items():
            if key[0] != spec.name:
                continue
            for name in PROGRAMS:
                compiled = rec.compiled.get((key, name))
                if compiled is None:  # never called (the sink's last fwd)
                    continue
                per_run = bytes_by_kind(collectives(compiled.as_text(), prog.mesh.size))
                for kind, b in per_run.items():
                    total[kind] += b * rec.calls[(key, name)] * prog.mesh.size
                peak = max(peak, peak_bytes(compiled))
        rows[spec.name] = dict(
            collective_bytes=total,
            boundary_bytes=int(rec.moved_from(spec.name)),
            peak_bytes_per_device=peak,
            layout=str(spec.layout),
        )
    return rows


# -- one scenario ---------------------------------------------------------------------------


def run(scenario: Scenario, mode: str, work: dict, steps: int) -> list[dict]:
    """Rows of one (scenario, mode): one per module."""
    import jax

    from experiments import runner
    from hetjax.inspect import Recorder, Timer

    rec = Recorder()
    placement = "colocated" if mode == "heterogeneous" else "homogeneous"
    cfg = runner.variant(
        work["base"],
        model={"preset": scenario.preset},
        parallel={
            "microbatches": scenario.microbatches,
            **runner.layout_fields(scenario.layouts, placement),
        },
    )
    params = work[scenario.preset]
    tr = runner.trainer(cfg, devices=work["devices"], observers=[rec], params=params)
    ex, batches = tr.engine, runner.batches(tr, steps)
    jax.block_until_ready(ex.step(batches[0]))
    rec.pause()  # calls and bytes of the first step; its compiles are all there are
    timer = Timer()
    for s in range(1, steps):
        with timer:
            jax.block_until_ready((ex.step(batches[s % len(batches)]), ex.params))
    ex.step(batches[0], profile=True)
    compute = defaultdict(float)
    for (_, key), ts in ex.op_times.items():
        compute[key[0]] += sum(ts)
    rows = []
    for module, row in module_rows(ex, rec).items():
        rows.append(
            dict(
                scenario=scenario.name,
                mode=mode,
                module=module,
                **row,
                step_time_s=timer.median,
                compute_time_s=compute[module],
                llm_layout=scenario.layouts["llm"],
            )
        )
    return rows


def inherits_tp_or_cp(rows: list[dict], scenario: str) -> bool:
    """Whether the homogeneous encoder of ``scenario`` got tp > 1 or cp > 1."""
    from hetjax import Layout

    for r in rows:
        if r["scenario"] == scenario and r["mode"] == "homogeneous" and r["module"] != "llm":
            layout = Layout.parse(r["layout"])
            return layout.tp > 1 or layout.cp > 1
    return False


def check(rows: list[dict]) -> list[str]:
    """The condition: the heterogeneous encoder moves fewer collective bytes than the
    homogeneous one wherever the latter inherits tp > 1 or cp > 1. Returns violations."""
    by = {(r["scenario"], r["mode"], r["module"]): r for r in rows}
    bad = []
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        if not inherits_tp_or_cp(rows, scenario):
            continue
        for (s, mode, module), r in by.items():
            if s != scenario or mode != "heterogeneous" or module == "llm":
                continue
            het = sum(r["collective_bytes"].values())
            hom = sum(by[(s, "homogeneous", module)]["collective_bytes"].values())
            if not het < hom:
                bad.append(
                    f"{scenario}: heterogeneous {module} moves {het} collective bytes per step, "
                    f"the homogeneous one ({by[(s, 'homogeneous', module)]['layout']}) {hom}"
                )
    return bad


def _kib(key: str, kind: str | None = None):
    def get(r: dict) -> str:
        return f"{(r[key] if kind is None else r[key][kind]) / 1024:.0f}"

    return get


def columns() -> list:
    from hetjax.inspect import KINDS

    short = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS"}
    short |= {"all-to-all": "A2A", "collective-permute": "CP"}
    return [
        ("scenario", "8s", "scenario"),
        ("mode", "13s", "mode"),
        ("module", "7s", "module"),
        ("layout", "26s", "layout"),
        *((f"{short[k]} KiB", ">9s", _kib("collective_bytes", k)) for k in KINDS),
        ("bound KiB", ">9s", _kib("boundary_bytes")),
        ("peak KiB", ">9s", _kib("peak_bytes_per_device")),
        ("step ms", "8.1f", lambda r: 1e3 * r["step_time_s"]),
        ("comp ms", "8.1f", lambda r: 1e3 * r["compute_time_s"]),
    ]


def main(config: BenchConfig) -> list[dict]:
    """Runs every scenario in both modes, prints a table, writes JSON, checks."""
    from experiments import runner

    # Both modes of a scenario compile the same LLM programs: the second loads them.
    devices = runner.start(DEVICES, steps=config.steps, cache="bench_comm_")
    scenarios = [s for s in SCENARIOS if not config.quick or s.name in QUICK]
    steps = min(config.steps, 3) if config.quick else config.steps
    base = runner.bench_config(
        steps=100, optimizer={"warmup_steps": 0}, data={"global_batch": GLOBAL_BATCH}
    )
    work: dict[str, Any] = {"devices": devices, "base": base}
    for name in dict.fromkeys(s.preset for s in scenarios):
        work[name] = runner.init_params(runner.variant(base, model={"preset": name}))
    t0 = time.perf_counter()
    runs = [(s, mode) for s in scenarios for mode in ("heterogeneous", "homogeneous")]
    per_run = runner.measured(runs, lambda r: run(*r, work, steps), lambda r: f"{r[0].name} {r[1]}")
    rows = [row for module_rows in per_run for row in module_rows]
    runner.print_table(rows, columns())
    print(f"{len(rows)} rows in {time.perf_counter() - t0:.0f} s")
    runner.finish_rows(rows, config.json, check(rows), "condition violated")
    return rows


if __name__ == "__main__":
    from experiments.runner import run_bench

    quick = "scenarios cp2 and moe (for the test)"
    run_bench(main, BenchConfig, prog="bench_comm", doc=__doc__, quick=quick)
