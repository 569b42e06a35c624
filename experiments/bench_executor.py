"""Benchmark the heterogeneous executor: compiles, DP reductions, memory, bubble, dispatch.

    python -m experiments.bench_executor --json out.json [--png-dir DIR] [--quick]

Each row is a :class:`hetjax.config.TrainConfig` variant run by
:mod:`experiments.runner`'s trainer on ``--devices`` simulated CPU devices (8 by
default): a layout in one of three placements and a microbatch count M: colocated
(vision ``dp=8``, LLM ``dp=2,tp=2,pp=2``; the three-phase schedule, whose LLM phase is
1F1B), non-colocated (vision ``dp=4`` | LLM ``dp=2,pp=2`` on islands 4 + 4) and the
homogeneous baseline of ``dp=2,tp=2,pp=2``, the last two under 1F1B and GPipe, each for
M in {2, 4, 8}. Layouts scale with ``--devices`` (a multiple of 4). The model is the
``tiny`` preset; ``--quick`` (for the test) runs every row kind on ``nano``, tiny shrunk
to negligible compute: the non-colocated rows with M in {2, 4}, colocated M = 2 and the
homogeneous rows with M = 2. A microbatch always holds ``--microbatch-size`` samples
(default: one per device; global batch = M x that), so the rows of one layout share
their programs: the run keeps a persistent compilation cache (a temporary directory, or
the one ``JAX_COMPILATION_CACHE_DIR`` names), which turns later compiles of an identical
program into loads.

Everything is measured through the executor's public observer hooks: each row's
trainer builds its executor with three observers (:class:`hetjax.inspect.Recorder`,
:class:`hetjax.inspect.AsyncTimer` and :class:`hetjax.inspect.LiveSampler`), each
listening during one step.

How each figure is measured, and its limits:

- ``step_time_s``: median wall time of steps 2..``--steps``, each waited for in full
  (loss and updated parameters). Other processes on the machine show up in it, and so
  do the attached observers: their hooks return at once outside their step, but the
  executor still computes each call's argument signature for ``on_compile`` (about
  20 us a call on this machine, under 1 % of a ``tiny`` step). The dispatch figures
  below come from executors without observers.
- ``compiles_after_step1`` / ``compiles_after_step5``: ``jax.monitoring`` backend-compile
  events (:class:`hetjax.inspect.CompileCounter`), cumulative from the start of the
  trainer's construction (its executor's; the parameters are the workload's). An
  executable loaded from the persistent cache counts too (the event wraps
  compile-or-load), so equal counts mean no program was rebuilt for steps 2-5.
- ``dp_reductions_per_param_per_step``: every stage's ``bwd`` and ``reduce`` as the
  executor compiled them in step 1 (``on_compile``, kept by the Recorder). In the HLO an
  all-reduce is a DP reduction when one of its replica groups spans devices with
  different ``(dp, ep)`` coordinates of the stage mesh (TP all-reduces of activations are
  not); its operands shaped like a parameter shard are reductions of that parameter,
  weighted by runs per step (``bwd`` M times, ``reduce`` once) and divided by the number
  of parameters with that shard shape. The row shows the largest value over parameters
  (``dp_reductions_min`` the smallest); stages with ``dp=1`` need none and are left out.
  Limits: counts are static (an all-reduce inside a loop body counts once - but any DP
  parameter reduction in ``bwd`` already fails the check), and a reduction XLA flattened
  into a differently shaped buffer would be missed (it then shows as 0 and fails).
- ``peak_activation_bytes_per_stage``: one step with a sampler that reads
  ``jax.live_arrays()`` after each ``fwd``/``bwd`` (``on_dispatch`` fires after the
  call, while the event still holds its inputs; what a call saw before it is what the
  previous call left plus the transfers and data placed since, so no separate "before"
  sample is taken). The stage inputs a ``bwd`` receives (``x`` and the microbatch data:
  the executor's stash) are attributed to their schedule stage from their F (the sample
  after the ``fwd`` call that got them; on the loss stage, whose F only stashes, the
  first sample holding the microbatch data the executor places at F) to their B (the
  sample after it); the figure is the peak over samples of those arrays' live bytes,
  summed over the stage's devices (replicas included). Samples are taken only at program
  calls. The bound 1F1B <= (P - s) / M x GPipe is checked per stage against
  the GPipe row of the same layout and M, s being the stage's depth on the longest path
  and P that path's stage count. ``peak_live_bytes_per_stage`` is the broader figure:
  every array created during the step and live on the stage's devices except gradient
  accumulators (forward outputs, cotangents, transfer copies, microbatch data; colocated
  stages share devices, so it mixes their arrays). It is not held to the bound.
- ``bubble_measured``: one unprofiled step with a watcher thread per stage that waits for
  each F/B's inputs, then its outputs (those not donated meanwhile: the stash and the
  accumulator are; a watcher's error is raised by the row): the op runs from
  max(dispatch, inputs seen ready,
  end of every earlier F/B on devices it shares) to output seen ready. Dispatch is the
  ``on_dispatch`` event's ``t0``, taken before the executor waits for in-flight programs
  on shared devices (XLA:CPU), so the op starts no earlier than those ended, which is
  when that wait returned. Per stage ``1 - busy / window``, the window from the first op's
  start to the last op's end (F/B only, as in the simulator). Eight simulated devices and
  the host share this machine's cores, so stages compete for CPU and the figure is
  informative, not a bar. ``bubble_measured_profiled``: ``ex.op_times`` of a
  ``profile=True`` step summed per stage over that step's wall time; that step waits for
  every op, so stages never overlap and it is pessimistic by construction.
  ``bubble_simulated`` is ``ex.timeline().bubble`` (the schedule simulated with the
  profiled mean durations).
- ``dispatch_overhead_ratio``: the median steady-state step (of ``DISPATCH_STEPS``) of an
  executor with the row's layout, schedule and M on the ``nano`` model with the shortest
  valid sequence, over the same for :class:`hetjax.ReferenceTrainer` - one fused jit of
  the same step (same model, batch, M and devices). ``dispatch_step_time_s``,
  ``dispatch_host_time_s`` (until ``step`` returns) and ``fused_step_time_s`` are kept.
  Limit: on simulated CPU devices the fused step is not free either (its per-microbatch
  gradient all-reduce across 8 device threads costs milliseconds), so the ratio compares
  two small costs and varies with machine load.

Exits non-zero when a "done when" condition fails: compiles grew between step 1 and 5, a
parameter is not DP-reduced exactly once per step, or 1F1B breaks the activation bound.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import pathlib
import statistics
import sys
import time
from collections import Counter
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

DISPATCH_STEPS = 10  # steps of the nano executor and the fused reference (first compiles)


@dataclasses.dataclass(frozen=True)
class Row:
    """One executor configuration to measure."""

    layouts: dict[str, str]  # module -> layout text
    placement: str  # colocated, non-colocated, homogeneous
    schedule: str  # requested: 1f1b or gpipe (colocated: three-phase, LLM phase 1F1B)
    microbatches: int  # M


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What to measure; flags map one-to-one onto these fields."""

    json: str | None = None  # where to write the rows (a JSON list); None: print only
    png_dir: str | None = None  # directory for each row's simulated Gantt chart
    devices: int = 8  # simulated CPU devices (a multiple of 4; layouts scale with it)
    steps: int = 5  # timed steps per row (>= 5: compiles are read after steps 1 and 5)
    microbatch_size: int | None = None  # samples per microbatch (None: --devices)
    seq_len: int | None = None  # tokens per sample (None: the model's)
    model: str = "tiny"  # tiny (the preset) or nano (negligible compute)
    quick: bool = False  # nano model, each placement and schedule once (for the test)


def make_rows(n: int, quick: bool) -> list[Row]:
    """The layouts of the issue, scaled from 8 devices to ``n`` (a multiple of 4)."""
    llm_tp = f"dp={n // 4},tp=2,pp=2"
    colocated = {"vision": f"dp={n}", "llm": llm_tp}
    islands = {"vision": f"dp={n // 2}", "llm": f"dp={n // 4},pp=2"}
    # The executor gives the encoder the LLM's layout without PP (stock Megatron).
    homogeneous = {"vision": f"dp={n // 4},tp=2", "llm": llm_tp}
    if quick:  # every placement and schedule once; 1F1B against GPipe at M = 2 and 4
        rows = [Row(islands, "non-colocated", s, m) for m in (2, 4) for s in ("1f1b", "gpipe")]
        rows.append(Row(colocated, "colocated", "1f1b", 2))
        return rows + [Row(homogeneous, "homogeneous", s, 2) for s in ("1f1b", "gpipe")]
    rows = [Row(colocated, "colocated", "1f1b", m) for m in (2, 4, 8)]
    for layouts, placement in ((islands, "non-colocated"), (homogeneous, "homogeneous")):
        rows += [Row(layouts, placement, s, m) for m in (2, 4, 8) for s in ("1f1b", "gpipe")]
    return rows


# -- DP reductions from the compiled HLO -----------------------------------------------------


def dp_reductions(ex, rec) -> list[float]:
    """DP reductions per step of every parameter (of stages with ``dp > 1``), from the
    programs a :class:`hetjax.inspect.Recorder` saw compiled."""
    import jax

    from hetjax.inspect import dp_all_reduce_shapes

    runs = {"bwd": ex.microbatches, "reduce": 1}
    values: list[float] = []
    for key, prog in ex.programs.items():
        if prog.replicas == 1:
            continue
        leaves = jax.tree.leaves(ex.params[key])
        params = Counter(tuple(a.sharding.shard_shape(a.shape)) for a in leaves)
        reduced: Counter = Counter()
        for name, times in runs.items():
            hlo = rec.compiled[(key, name)].as_text()
            for shape, n in dp_all_reduce_shapes(hlo, prog.mesh).items():
                reduced[shape] += n * times
        for shape, n in params.items():
            values += [reduced[shape] / n] * n
    return values


# -- one row --------------------------------------------------------------------------------


def _wait(metrics, ex_or_trainer) -> None:
    import jax

    float(metrics["loss"])
    jax.block_until_ready(ex_or_trainer.params)


def _stage_depths(ex) -> tuple[list[int], int]:
    """Each schedule stage's depth on the longest path, and that path's stage count."""
    from hetjax import schedules as hs

    infos = ex.schedule.stages
    modules = {i.module: i.pp for i in infos}
    edges = [(l.src, l.dst) for l in ex.graph.links if l.src in modules and l.dst in modules]
    graph = hs.ModuleGraph(modules, edges)
    return [graph.depth(i.module) + i.index for i in infos], graph.total_stages()


@dataclasses.dataclass
class Workload:
    """A model with its parameters, and what has been measured on it."""

    base: Any  # hetjax.config.TrainConfig: the model's settings (model.seq_len, seed)
    preset: Any  # models.config.MLLMConfig
    params: Any
    microbatch_size: int  # samples per microbatch
    fused: dict[int, float] = dataclasses.field(default_factory=dict)  # M -> fused step s

    def config(self, m: int, steps: int, **parallel: Any) -> Any:
        """The row of ``m`` microbatches trained ``steps`` steps, with ``parallel``."""
        from experiments.runner import variant

        return variant(
            self.base,
            steps=steps,
            data={"global_batch": m * self.microbatch_size},
            parallel={"microbatches": m, **parallel},
        )

    def trainer(self, config: Any, devices: list, observers=()) -> Any:
        from experiments import runner

        return runner.trainer(
            config, devices=devices, observers=observers, preset=self.preset, params=self.params
        )


def nano_preset(llm_depth: int = 2) -> Any:
    """The ``tiny`` preset shrunk to negligible compute (LLM width 16, ``llm_depth`` layers)."""
    from models.config import get_preset

    preset = get_preset("tiny")
    return dataclasses.replace(
        preset,
        name="nano",
        llm=dataclasses.replace(preset.llm, width=16, depth=llm_depth, heads=2, kv_heads=2, mlp=16),
        vision=dataclasses.replace(preset.vision, width=8, depth=1, heads=2, mlp=8),
    )


def make_workload(
    name: str, *, seq_len: int | None, microbatch_size: int, llm_depth: int = 2
) -> Workload:
    """``tiny`` (the preset) or ``nano`` (tiny shrunk to negligible compute, ``llm_depth``
    LLM layers, shortest valid sequence) on a fixed seed."""
    from experiments import runner
    from models.config import get_preset
    from models.data import SyntheticConfig

    preset = nano_preset(llm_depth) if name == "nano" else get_preset("tiny")
    if name == "nano":
        shortest = SyntheticConfig.for_model(preset, seq_len=1, seed=0).max_sample_tokens() - 1
        seq_len = seq_len or shortest
    base = runner.bench_config(model={"preset": "tiny", "seq_len": seq_len})
    return Workload(base, preset, runner.init_params(base, preset), microbatch_size)


def build_trainer(row: Row, work: Workload, devices: list, steps: int, observers=()):
    """The trainer of ``row`` on ``work`` (its executor: ``.engine``)."""
    from experiments.runner import layout_fields

    fields = dict(schedule=row.schedule, **layout_fields(row.layouts, row.placement))
    return work.trainer(work.config(row.microbatches, steps, **fields), devices, observers)


def run_row(row: Row, work: Workload, light: Workload, devices: list, counter, config) -> dict:
    """Builds the executor of ``row`` on ``work``, measures it, returns one JSON row;
    the dispatch overhead is measured on ``light`` (the same workload, or a nano one)."""
    from experiments import runner
    from hetjax.inspect import AsyncTimer, LiveSampler, Recorder, Timer

    m, steps = row.microbatches, config.steps
    rec, timer, sampler = Recorder(), AsyncTimer(), LiveSampler()
    start = counter.count
    tr = build_trainer(row, work, devices, steps + 3, observers=[rec, timer, sampler])
    ex, batches = tr.engine, runner.batches(tr, steps + 3)
    stage_ids = dict(ex.stage_ids)  # homogeneous: encoders run inside the sink's stage 0
    fused_into = stage_ids[(ex.graph.sink, 0)]

    def stage_of(key):
        return stage_ids.get(key, fused_into)

    num_stages = len(ex.schedule.stages)
    _wait(ex.step(batches[0]), ex)
    rec.pause()  # its compiled programs are all we need; it counts nothing more
    compiles = [counter.count - start]
    steps_timer = Timer()
    for i in range(1, steps):
        with steps_timer:
            _wait(ex.step(batches[i]), ex)
        if i == 4:
            compiles.append(counter.count - start)

    # Profiled step: per-op wall times -> simulated timeline and the serialised bubble.
    with Timer() as profiled:
        _wait(ex.step(batches[steps], profile=True), ex)
    wall = profiled.last
    busy = [0.0] * num_stages
    for (_, key), ts in ex.op_times.items():
        busy[stage_of(key)] += sum(ts)
    timeline = ex.timeline()

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # watchers see completions within ~0.1 ms, not ~5 ms
    try:
        timer.start(stage_of, num_stages)
        _wait(ex.step(batches[steps + 1]), ex)
    finally:
        sys.setswitchinterval(switch)
    bubble_async = timer.bubble({k: p.devices for k, p in ex.programs.items()})

    sampler.start(stage_of)
    _wait(ex.step(batches[steps + 2]), ex)
    sampler.stop()
    stage_devices = [set() for _ in range(num_stages)]
    for key, prog in ex.programs.items():
        stage_devices[stage_of(key)].update(prog.mesh.devices.flat)
    act_peaks = sampler.stash_peaks(num_stages)
    live_peaks = sampler.live_peaks(stage_devices)

    dp = dp_reductions(ex, rec)
    depths, depth_total = _stage_depths(ex)
    step_time = steps_timer.median
    if config.png_dir:
        name = f"{row.placement}-{row.schedule}-M{m}.png"
        timeline.to_png(pathlib.Path(config.png_dir) / name)
    out = dict(
        layout="|".join(f"{s.name}:{s.layout}" for s in ex.graph.modules),
        placement=row.placement,
        schedule=row.schedule,
        microbatches=m,
        step_time_s=step_time,
        compiles_after_step1=compiles[0],
        compiles_after_step5=compiles[-1],
        dp_reductions_per_param_per_step=max(dp) if dp else None,
        peak_activation_bytes_per_stage=act_peaks,
        bubble_measured=bubble_async,
        bubble_simulated=list(timeline.bubble),
        # extras
        schedule_name=ex.schedule.name,
        stages=[str(i) for i in ex.schedule.stages],
        stage_depths=depths,
        pipeline_depth=depth_total,
        global_batch=m * work.microbatch_size,
        dp_reductions_min=min(dp) if dp else None,
        peak_live_bytes_per_stage=live_peaks,
        bubble_measured_profiled=[1.0 - b / wall for b in busy],
    )
    del ex, tr, rec, timer, sampler
    gc.collect()
    light_tr = build_trainer(row, light, devices, DISPATCH_STEPS)
    host, total = runner.timed_steps(light_tr.engine, runner.batches(light_tr, DISPATCH_STEPS))
    del light_tr
    gc.collect()
    fused = fused_step_time(light, m, devices, DISPATCH_STEPS)
    out.update(
        dispatch_overhead_ratio=statistics.median(total) / fused,
        dispatch_step_time_s=statistics.median(total),
        dispatch_host_time_s=statistics.median(host),
        fused_step_time_s=fused,
    )
    return out


def fused_step_time(work: Workload, m: int, devices: list, steps: int) -> float:
    """Median steady-state step of the reference trainer (one jit), cached per M."""
    if m not in work.fused:
        from experiments import runner

        tr = work.trainer(work.config(m, steps, reference=True), devices)
        times = runner.timed_steps(tr.engine, runner.batches(tr, steps))[1]
        work.fused[m] = statistics.median(times)
        del tr
        gc.collect()
    return work.fused[m]


# -- checks and output ----------------------------------------------------------------------


def activation_bound(rows: list[dict]) -> None:
    """Adds ``activation_bound`` (PASS / FAIL / n/a) to every row, in place."""
    gpipe = {
        (r["layout"], r["placement"], r["microbatches"]): r
        for r in rows
        if r["schedule"] == "gpipe"
    }
    for r in rows:
        ref = gpipe.get((r["layout"], r["placement"], r["microbatches"]))
        if r["schedule"] != "1f1b" or ref is None:
            r["activation_bound"] = "n/a"
            continue
        p, m = r["pipeline_depth"], r["microbatches"]
        ok = all(
            mine * m <= (p - s) * theirs
            for mine, theirs, s in zip(
                r["peak_activation_bytes_per_stage"],
                ref["peak_activation_bytes_per_stage"],
                r["stage_depths"],
                strict=True,
            )
        )
        r["activation_bound"] = "PASS" if ok else "FAIL"


def _name(r: dict) -> str:
    return f"{r['placement']} {r['schedule']} M={r['microbatches']}"


def goals() -> list:
    """The issue's "done when" conditions, per row."""
    from experiments.runner import Goal

    return [
        Goal(
            lambda r: r["compiles_after_step5"] == r["compiles_after_step1"],
            lambda r: (
                f"{_name(r)}: compiles {r['compiles_after_step1']} after step 1, "
                f"{r['compiles_after_step5']} after step 5"
            ),
        ),
        Goal(
            lambda r: (r["dp_reductions_min"], r["dp_reductions_per_param_per_step"]) == (1, 1),
            lambda r: (
                f"{_name(r)}: DP reductions per parameter per step in "
                f"[{r['dp_reductions_min']}, {r['dp_reductions_per_param_per_step']}], "
                "want exactly 1"
            ),
        ),
        Goal(
            lambda r: r["activation_bound"] != "FAIL",
            lambda r: (
                f"{_name(r)}: 1F1B activation bytes {r['peak_activation_bytes_per_stage']} "
                "exceed (P - s) / M of GPipe's"
            ),
        ),
    ]


def _joined(key: str, fmt: str = "{:.2f}", scale: float = 1.0):
    return lambda r: "/".join(fmt.format(x / scale) for x in r[key])


COLUMNS = (
    ("placement", "13s", "placement"),
    ("sched", "5s", "schedule"),
    ("M", "2d", "microbatches"),
    ("step ms", "8.1f", lambda r: 1e3 * r["step_time_s"]),
    ("c1", "3d", "compiles_after_step1"),
    ("c5", "3d", "compiles_after_step5"),
    ("dpred", "5.2f", "dp_reductions_per_param_per_step"),
    ("stash KiB per stage", ">20s", _joined("peak_activation_bytes_per_stage", "{:.0f}", 1024)),
    ("bound", ">5s", "activation_bound"),
    ("bubble meas", ">15s", _joined("bubble_measured")),
    ("bubble sim", ">15s", _joined("bubble_simulated")),
    ("disp x", "6.2f", "dispatch_overhead_ratio"),
)


def print_table(rows: list[dict]) -> None:
    from experiments.runner import print_table as table

    table(rows, COLUMNS)
    for layout in dict.fromkeys(r["layout"] for r in rows):
        stages = next(r["stages"] for r in rows if r["layout"] == layout)
        print(f"  {layout}: stages {', '.join(stages)}")


def main(config: BenchConfig) -> list[dict]:
    """Runs every row, prints a table, writes JSON, and fails on a violated condition."""
    from experiments import runner
    from experiments.cli import ConfigError

    if config.devices % 4 or config.steps < 5:
        raise ConfigError("--devices must be a multiple of 4 and --steps at least 5")
    # Rows of one layout share their programs: later executors load them from this cache.
    devices = runner.start(config.devices, cache="bench_executor_")
    from hetjax.inspect import CompileCounter

    counter = CompileCounter().start()  # cumulative: rows read differences of its count
    size = config.microbatch_size or config.devices
    model = "nano" if config.quick else config.model
    work = make_workload(model, seq_len=config.seq_len, microbatch_size=size)
    # The fused reference runs dp over every device: its microbatch must split over them.
    light = (
        work
        if model == "nano"
        else make_workload("nano", seq_len=None, microbatch_size=config.devices)
    )
    if config.png_dir:
        pathlib.Path(config.png_dir).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = runner.measured(
        make_rows(config.devices, config.quick),
        lambda row: run_row(row, work, light, devices, counter, config),
        lambda row: _name(dataclasses.asdict(row)),
    )
    activation_bound(rows)
    print_table(rows)
    print(f"{len(rows)} rows in {time.perf_counter() - t0:.0f} s")
    counter.stop()
    missed = runner.missed(rows, goals())
    runner.finish_rows(rows, config.json, missed, "done-when conditions violated")
    return rows


def flags(p: Any, d: BenchConfig) -> None:
    """The flags besides ``--json``, ``--quick`` and ``--steps``."""
    from experiments.cli import positive_int

    p.add_argument("--png-dir", default=d.png_dir, help="write each row's simulated Gantt chart")
    p.add_argument(
        "--devices",
        type=positive_int,
        default=d.devices,
        help="simulated CPU devices, a multiple of 4 (default 8)",
    )
    p.add_argument("--microbatch-size", type=positive_int, default=d.microbatch_size)
    p.add_argument("--seq-len", type=positive_int, default=d.seq_len)
    p.add_argument("--model", choices=["tiny", "nano"], default=d.model)


if __name__ == "__main__":
    from experiments.runner import run_bench

    run_bench(
        main,
        BenchConfig,
        prog="bench_executor",
        doc=__doc__,
        quick="nano model, every row kind once (about a minute)",
        flags=flags,
    )
