"""The planner's step time against measured steps: ``python -m experiments.validate_plan``.

    python -m experiments.validate_plan [--quick] [--steps N] [--no-calibrate | --write-profile]
        [--json out.json]

Trains each layout of ``ROWS`` (tiny and small presets on 8 simulated CPU devices:
colocated, non-colocated islands, the homogeneous baseline; dp, tp, pp, cp, ep; a frozen
encoder; the three recompute policies; fsdp) for ``--steps`` steps through
:func:`experiments.runner.trainer`, the same :class:`hetjax.train.Trainer` a user runs,
and compares the fastest of the timed steps (see :func:`measure_rows`) with
the planner's :func:`hetjax.plan.estimate` of the same plan. Each row also counts the
host calls of one step (program dispatches and transfers, through an executor observer)
beside the planner's count (:func:`hetjax.plan.cost.calls`).

The machine is shared and its speed drifts with the load, so by default the CPU profile
is fitted in the same run, in the same minutes as the rows: the calibration's programs
(:class:`experiments.calibrate.Probes`) are timed once per round of each group of rows,
and each row is predicted with the rates of its own group's rounds (``dispatch_us`` and
``launch_us``, then ``fsdp_call_us``, from the executor rows,
``experiments.calibrate.DISPATCH_ROWS``, measured with the tiny rows; none of them a
validation layout). The committed
``hetjax/plan/profiles/cpu.json`` is what ``--no-calibrate`` (and ``--quick``, for the
test: one tiny row) uses, and ``--write-profile`` replaces with this run's (the rates of
the fastest calls over all rounds). Prints a
row per layout and a summary: median and worst ``|predicted / measured - 1|`` and
Kendall's tau between the two rankings, against the fastest step (the goals') and
against the median (how much the machine's load moves them); goals 15%, 30%,
0.8, reported (the exit status does not check them). ``--json`` writes
``{"rows": [...], "summary": {...}}``.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

DEVICES = 8
GOALS = {"median_abs_error": 0.15, "worst_abs_error": 0.30, "kendall_tau": 0.8}


@dataclasses.dataclass(frozen=True)
class Row:
    """One layout: what the trainer runs and the planner prices."""

    name: str
    preset: str
    mode: str  # colocated, non-colocated, homogeneous
    vision: str | None  # layout text (None: homogeneous, inherited from the LLM)
    llm: str
    microbatches: int
    recompute: str = "none"
    freeze: str = ""  # "vision,projector": the whole encoder module frozen
    batch: int = 16


ROWS = (
    Row("tiny colocated tp+pp", "tiny", "colocated", "dp=8", "dp=2,tp=2,pp=2", 2),
    Row("tiny non-colocated pp", "tiny", "non-colocated", "dp=4", "dp=2,pp=2", 2),
    Row("tiny homogeneous tp", "tiny", "homogeneous", None, "dp=4,tp=2", 2),
    Row("tiny colocated dp", "tiny", "colocated", "dp=8", "dp=8", 1),
    Row("tiny colocated pp4", "tiny", "colocated", "dp=4,tp=2", "dp=2,pp=4", 4),
    Row("tiny colocated cp+tp", "tiny", "colocated", "dp=4,tp=2", "dp=2,cp=2,tp=2", 2),
    Row("tiny-moe islands ep", "tiny-moe", "non-colocated", "dp=4", "dp=4,ep=4", 2),
    Row(
        "tiny frozen encoder",
        "tiny",
        "non-colocated",
        "dp=4",
        "dp=2,pp=2",
        2,
        freeze="vision,projector",
    ),
    Row("tiny recompute full", "tiny", "non-colocated", "dp=4", "dp=2,pp=2", 2, "full"),
    Row("tiny recompute selective", "tiny", "colocated", "dp=8", "dp=2,tp=2,pp=2", 2, "selective"),
    # fsdp, which the planner searches for --layout auto: the plan it picks on 8 devices,
    # and fsdp beside tp (the fsdp parity file's case A, the LLM's side)
    Row("tiny islands fsdp", "tiny", "non-colocated", "dp=2,pp=2", "fsdp=4", 2),
    Row("tiny colocated fsdp+tp", "tiny", "colocated", "dp=8", "fsdp=4,tp=2", 2),
    Row("small colocated dp+tp", "small", "colocated", "dp=8", "dp=4,tp=2", 1, batch=8),
    Row("small non-colocated pp", "small", "non-colocated", "dp=4", "dp=2,pp=2", 2, batch=8),
    Row("small colocated tp+pp", "small", "colocated", "dp=4,tp=2", "dp=2,tp=2,pp=2", 2, batch=8),
    Row("small homogeneous tp", "small", "homogeneous", None, "dp=4,tp=2", 1, batch=8),
)
QUICK_ROWS = ROWS[1:2]


@dataclasses.dataclass(frozen=True)
class ValidateConfig:
    json: str | None = None  # write {"rows": [...], "summary": {...}}
    quick: bool = False  # one tiny row, the committed profile (for the test)
    steps: int = 10  # steps per row (the first compiles, the second counts calls, 8 timed)
    no_calibrate: bool = False  # predict with the committed CPU profile
    write_profile: bool = False  # write the profile fitted in this run to profiles/cpu.json


def plan_of(row: Row, cfg: Any = None) -> tuple[Any, Any, Any]:
    """``(model config, hetjax.plan.Plan, Workload)`` of ``row`` (``cfg``: a shrunk model
    instead of its preset) as hetjax's executor runs it (FP32, XLA's attention;
    :func:`experiments.plan.hetjax_workload`)."""
    from experiments.plan import hetjax_workload
    from hetjax import Layout
    from hetjax.plan import ModulePlan, Plan
    from models.config import get_preset

    cfg = cfg or get_preset(row.preset)
    lay_l = Layout.parse(row.llm)
    lay_v = Layout.parse(row.vision) if row.vision else Layout(dp=lay_l.dp, tp=lay_l.tp)
    frozen = set(row.freeze.split(",")) >= {"vision", "projector"}
    vision = ModulePlan(lay_v, recompute=row.recompute, frozen=frozen)
    llm = ModulePlan(lay_l, recompute=row.recompute, frozen="llm" in row.freeze.split(","))
    work = hetjax_workload(row.batch, cfg.seq_len, act_bytes=4)
    return cfg, Plan(row.mode, vision, llm, row.microbatches), work


def predict(row: Row, hw: Any, cfg: Any = None) -> tuple[float, int]:
    """The planner's step seconds and host calls per step of ``row`` on ``hw``."""
    from hetjax.plan import estimate
    from hetjax.plan.cost import calls

    cfg, plan, work = plan_of(row, cfg)
    est = estimate(cfg, plan, work, hw)
    nv = plan.vision.layout.pp
    per = calls(plan, work, list(est.stages[:nv]), list(est.stages[nv:]))
    return est.step_time_s, round(sum(plan.microbatches * (f + b) + n for f, b, n in per))


def config_of(row: Row, steps: int) -> Any:
    """The row's :class:`~hetjax.config.TrainConfig`."""
    from experiments import runner

    layouts = {"llm": row.llm} | ({"vision": row.vision} if row.vision else {})
    parallel = runner.layout_fields(layouts, row.mode)
    parallel |= {"microbatches": row.microbatches, "recompute": {"*": row.recompute}}
    return runner.bench_config(
        model={"preset": row.preset, "freeze": row.freeze},
        data={"global_batch": row.batch},
        parallel=parallel,
        steps=steps,
    )


class _Run:
    """One row's trainer, compiled and warm, counting the host calls of one step."""

    def __init__(self, row: Row, devices: list, preset: Any = None):
        from experiments import runner
        from hetjax import Observer

        class Calls(Observer):
            count = 0

            def on_dispatch(self, event: Any) -> None:
                self.count += 1

            def on_transfer(self, event: Any) -> None:
                self.count += 1

        self.counter = Calls()
        tr = runner.trainer(
            config_of(row, 2), devices=devices, observers=[self.counter], preset=preset
        )
        self.engine, self.batch = tr.engine, tr.data.batch(0)
        runner.timed_steps(self.engine, [self.batch])  # compiles
        before = self.counter.count
        runner.timed_steps(self.engine, [self.batch])  # warm-up, not timed: counts the calls
        self.calls = self.counter.count - before
        self.times: list[float] = []

    def step(self) -> None:
        """Times one more step (the engine is warm)."""
        import time

        import jax

        t0 = time.perf_counter()
        metrics = self.engine.step(self.batch)
        float(metrics["loss"])
        jax.block_until_ready(self.engine.params)
        self.times.append(time.perf_counter() - t0)


def measure_rows(
    rows: list[Row], devices: list, steps: int, presets: dict | None = None, probes: Any = None
) -> list[dict]:
    """Per row: the fastest of ``steps - 2`` timed steps, their median, and the host calls
    of one step. Two steps per row are not timed: the first compiles, the second warms up
    and counts the calls. The rows' trainers are built first and then stepped in turn, a
    step of each per round, so a burst of load on the shared machine lands on every row
    alike (``presets``: row name -> a shrunk model); ``probes``
    (:class:`experiments.calibrate.Probes`), if given, are timed once per round too.

    ``measured_step_s`` is the fastest step: other work on the machine only ever adds
    time to a step (it takes cores, caches and memory bandwidth; it never lends them), so
    the minimum over enough steps is the estimate of the step alone that the least load
    disturbs, and the calibration's programs are timed the same way
    (:func:`experiments.calibrate.fastest`). The median is kept beside it
    (``measured_median_step_s``) to show how loaded the run was."""
    presets = presets or {}
    runs = [_Run(row, devices, presets.get(row.name)) for row in rows]
    for _ in range(max(steps - 2, 1)):
        for run in runs:
            run.step()
        if probes is not None:
            probes.time_once()
    out = [
        {
            "measured_step_s": min(r.times),
            "measured_median_step_s": statistics.median(r.times),
            "measured_steps": len(r.times),
            "measured_times_s": r.times,  # in round order
            "measured_calls": r.calls,
        }
        for r in runs
    ]
    del runs
    return out


def _sign(x: float) -> int:
    return int(x > 0) - int(x < 0)


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a between two orderings of the same items (1: the same order)."""
    n, s = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            s += _sign(a[i] - a[j]) * _sign(b[i] - b[j])
    return 2 * s / (n * (n - 1)) if n > 1 else 1.0


def summary(rows: list[dict]) -> dict:
    """Median and worst |error|, Kendall's tau of the predicted and measured rankings."""
    pred = [r["predicted_step_s"] for r in rows]
    out: dict = {"rows": len(rows), "goals": GOALS}
    for suffix, key in (("", "measured_step_s"), ("_vs_median", "measured_median_step_s")):
        errors = [abs(p / r[key] - 1) for p, r in zip(pred, rows, strict=True)]
        out[f"median_abs_error{suffix}"] = statistics.median(errors)
        out[f"worst_abs_error{suffix}"] = max(errors)
        out[f"kendall_tau{suffix}"] = kendall_tau(pred, [r[key] for r in rows])
    return out


def main(config: ValidateConfig) -> dict:
    from experiments import calibrate, runner
    from hetjax.plan import get_profile

    if config.steps < 3:
        raise SystemExit("--steps must be at least 3 (the first compiles, the second counts)")
    devices = runner.start(DEVICES, cache="validate_plan")
    hw, fitted_on = get_profile("cpu"), "hetjax/plan/profiles/cpu.json"
    todo = list(QUICK_ROWS if config.quick else ROWS)
    calibrating = not (config.quick or config.no_calibrate)
    extra, models = calibrate.dispatch_rows() if calibrating else ([], {})
    probes = calibrate.Probes(devices) if calibrating else None
    # Rows measured together (round-robin, :func:`measure_rows`): the dispatch rows with
    # the tiny ones; the small ones one at a time (their trainers' memory). The
    # calibration's programs are timed in the rounds of every group: each group's rows are
    # predicted with the rates of its own minutes of the shared machine.
    groups = [extra + [r for r in todo if r.preset != "small"]]
    groups += [[r] for r in todo if r.preset == "small"]
    measured, rates = {}, {}
    for group in groups:
        start = probes.rounds if probes else 0
        got_rows = measure_rows(group, devices, config.steps, models, probes)
        for row, got in zip(group, got_rows, strict=True):
            measured[row.name] = got
            rates[row.name] = probes.points(start) if probes else None
            print(f"  measured {row.name}: {got['measured_step_s']:.3f} s", file=sys.stderr)
    profiles = {row.name: hw for row in todo}
    if calibrating:
        # dispatch and launch from the executor rows, with the rates of their own rounds
        host = [measured[r.name] for r in extra]
        own = calibrate.micro_profile(rates[extra[0].name], DEVICES)
        tiny, fit = calibrate.with_host_costs(*own, host)
        fixed = {k: getattr(tiny, k) for k in ("dispatch_us", "launch_us", "fsdp_call_us")}
        for row in todo:
            profiles[row.name] = dataclasses.replace(
                calibrate.micro_profile(rates[row.name], DEVICES)[0], **fixed
            )
        # the profile this run writes: the rates of the fastest calls of every round
        hw, record = calibrate.micro_profile(probes.points(), DEVICES)
        hw = dataclasses.replace(hw, **fixed)
        record["dispatch_rows"] = fit["dispatch_rows"]
        fitted_on = f"this run ({record['date']})"
        if config.write_profile:
            from hetjax.plan.hardware import PROFILE_DIR, save_profile

            save_profile(hw, os.path.join(PROFILE_DIR, "cpu.json"), record)
    print(f"profile: {fitted_on}: {calibrate.describe(hw)}", file=sys.stderr)
    rows = []
    for row in todo:
        got = measured[row.name]
        if calibrating:
            print(f"  {row.name}: {calibrate.describe(profiles[row.name])}", file=sys.stderr)
        predicted, calls = predict(row, profiles[row.name])
        rows.append(
            {
                "layout": row.name,
                "preset": row.preset,
                "mode": row.mode,
                "vision": row.vision,
                "llm": row.llm,
                "microbatches": row.microbatches,
                "recompute": row.recompute,
                "freeze": row.freeze,
                "global_batch": row.batch,
                "predicted_step_s": predicted,
                **got,
                "predicted_calls": calls,
                "profile": calibrate.describe(profiles[row.name]),
                "error": predicted / got["measured_step_s"] - 1,
                "error_vs_median": predicted / got["measured_median_step_s"] - 1,
            }
        )
    runner.print_table(
        rows,
        [
            ("layout", "<26", "layout"),
            ("predicted s", "12.4f", "predicted_step_s"),
            ("fastest s", "10.4f", "measured_step_s"),
            ("error", "+7.1%", "error"),
            ("median s", "9.4f", "measured_median_step_s"),
            ("error", "+7.1%", "error_vs_median"),
            ("calls", "6d", "measured_calls"),
            ("planned", "8d", "predicted_calls"),
        ],
    )
    s = summary(rows)
    s["profile"] = fitted_on
    print(
        f"median |error| {s['median_abs_error']:.1%} (goal <= 15%), worst "
        f"{s['worst_abs_error']:.1%} (goal <= 30%), Kendall tau {s['kendall_tau']:.2f} "
        f"(goal >= 0.8) over {len(rows)} layouts; against the median step: median "
        f"{s['median_abs_error_vs_median']:.1%}, worst {s['worst_abs_error_vs_median']:.1%}, "
        f"tau {s['kendall_tau_vs_median']:.2f}"
    )
    out = {"rows": rows, "summary": s, "profile": dataclasses.asdict(hw)}
    if calibrating:  # what the profile was fitted on: points, worst errors, executor rows
        out["fitted_on"] = record
    from experiments.cli import write_json

    write_json(config.json, out)
    return out


def parse_args(argv: list[str]) -> ValidateConfig:
    from experiments.cli import OneLineParser, positive_int

    p = OneLineParser(prog="validate_plan", description=__doc__.splitlines()[0])
    d = ValidateConfig()
    p.add_argument("--json", default=d.json, help="write the rows and the summary as JSON")
    p.add_argument("--quick", action="store_true", help="one tiny row (for the test)")
    p.add_argument("--steps", type=positive_int, default=d.steps, help="steps per row")
    p.add_argument(
        "--no-calibrate", action="store_true", help="use the committed CPU profile as is"
    )
    p.add_argument(
        "--write-profile", action="store_true", help="write this run's profile to cpu.json"
    )
    return ValidateConfig(**vars(p.parse_args(argv)))


if __name__ == "__main__":
    from experiments.cli import run_cli

    run_cli(lambda argv: main(parse_args(argv)) and 0, "validate_plan")
