"""Ask the planner for a layout: ``python -m experiments.plan``.

    python -m experiments.plan --encoder vit-6b --llm llm-120b --gpus 256 --seq-len 8192 \\
        --gpu h100 [--global-batch 512] [--images 4] [--baseline paper|best] \\
        [--json out.json]

Prints the best plans (heterogeneous: colocated or non-colocated), the two homogeneous
baselines (the encoder inheriting the LLM's layout): ``hom`` the best one the search
finds, ``stk`` the paper's (the LLM's own layout with ZeRO-1, CP only where activations
need it; where it differs), the predicted gain over ``--baseline`` and the memory per
GPU. ``--model NAME`` plans a
runnable preset (``tiny``, ``small``, ...) instead of the paper-scale ``--encoder`` /
``--llm`` shapes, as hetjax's executor runs it (one image per sample, its own sequence
length, global batch 32 unless given; FP32 on ``--gpu cpu``). Otherwise an unset
``--global-batch`` is 4M tokens per step (``2**22 // seq_len`` samples), what a Megatron
user runs at this scale; ``--images`` (default 4: 4096 image tokens, half of an 8K
sample) sets the token density.
"""

from __future__ import annotations

import dataclasses

TOKENS_PER_STEP = 2**22
RUN_BATCH = 32  # --model: llava_train's default global batch


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    encoder: str = "vit-6b"  # paper-scale encoder preset (models.config.PAPER_ENCODERS)
    llm: str = "llm-120b"  # paper-scale LLM preset (models.config.PAPER_LLMS)
    model: str | None = None  # a runnable preset instead (tiny, small, ...)
    gpus: int = 256  # GPUs of the job
    seq_len: int | None = None  # LLM tokens per sample (None: 8192; --model: its own)
    global_batch: int | None = None  # samples per step (None: 4M tokens)
    images: int = 4  # images per sample
    gpu: str = "h100"  # hardware profile (h100, h200, cpu)
    top: int = 5  # plans listed
    baseline: str = "paper"  # the gain printed is over: paper (stock) or best (homogeneous)
    even_stages: bool = False  # LLM pp must divide its layers (always for --model)
    json: str | None = None  # write the result here


def default_batch(seq_len: int) -> int:
    """4M tokens per step (at least one sample)."""
    return max(1, TOKENS_PER_STEP // seq_len)


def model_config(config: PlanConfig):
    from models.config import PAPER_ENCODERS, PAPER_LLMS, get_preset, paper_preset

    if config.model:
        return get_preset(config.model)
    for flag, name, known in (
        ("--encoder", config.encoder, PAPER_ENCODERS),
        ("--llm", config.llm, PAPER_LLMS),
    ):
        if name not in known:
            raise ValueError(f"{flag} {name!r} is unknown; choose one of {', '.join(known)}")
    return paper_preset(config.encoder, config.llm, config.seq_len or 8192)


def as_dict(est) -> dict:
    """One plan's figures as plain data."""
    p = est.plan
    return {
        "mode": p.mode,
        "vision": str(p.vision),
        "llm": str(p.llm),
        "microbatches": p.microbatches,
        "islands": [p.vision.layout.num_devices, p.llm.layout.num_devices]
        if p.mode == "non-colocated"
        else None,
        "step_time_s": est.step_time_s,
        "tokens_per_s": est.tokens_per_s,
        "tflops_per_gpu": est.tflops_per_gpu,
        "peak_memory_gib": est.peak_memory_bytes / 2**30,
        "memory_limit_gib": est.memory_limit_bytes / 2**30,
    }


def table(result, top: int, baseline: str = "paper") -> str:
    """The readable table: the best plans, both baselines (``hom``: the best homogeneous
    plan; ``stk``: the paper's stock one, when it differs) and the gain over ``baseline``."""
    head = f"{'':3} {'plan':<92} {'tok/s':>9} {'TFLOPS/GPU':>10} {'GiB/GPU':>8}"
    rows = [head]
    for i, e in enumerate(result.ranked[:top]):
        rows.append(_row(str(i + 1), e))
    rows.append(_row("hom", result.homogeneous))
    stk = result.stock is not None and result.stock is not result.homogeneous
    if stk:
        rows.append(_row("stk", result.stock))
    what = {"paper": f"the paper's baseline ({'stk' if stk else 'hom'})"}
    what["best"] = "the best homogeneous plan (hom)"
    rows.append(
        f"predicted gain of the best plan ({result.best.plan.mode}) over {what[baseline]}: "
        f"{result.gain(baseline):+.1f}% tokens/s ({result.candidates} plans priced in "
        f"{result.seconds:.1f} s)"
    )
    return "\n".join(rows)


def _row(tag: str, e) -> str:
    return (
        f"{tag:3} {str(e.plan):<92} {e.tokens_per_s:9.0f} {e.tflops_per_gpu:10.3g}"
        f" {e.peak_memory_bytes / 2**30:8.1f}"
    )


def main(config: PlanConfig) -> dict:
    """Runs the planner, prints the table, writes JSON."""
    from hetjax.plan import Workload, get_profile
    from hetjax.plan.search import search

    hw = get_profile(config.gpu)
    cfg = model_config(config)
    seq = config.seq_len or cfg.seq_len
    batch = config.global_batch or (RUN_BATCH if config.model else default_batch(seq))
    if config.model:  # a runnable preset: plan what hetjax's executor runs
        work = hetjax_workload(batch, seq, act_bytes=2 if hw.name != "cpu" else 4)
    else:
        work = Workload(batch, seq, config.images)
    result = search(
        cfg, config.gpus, work, hw, even_stages=config.even_stages or bool(config.model)
    )
    print(
        f"{cfg.name} on {config.gpus} x {hw.name}, global batch {work.global_batch} x "
        f"{work.seq_len} tokens, {work.images_per_sample} images per sample"
    )
    print(table(result, config.top, config.baseline))
    out = {
        "model": cfg.name,
        "gpus": config.gpus,
        "gpu": hw.name,
        "global_batch": work.global_batch,
        "seq_len": work.seq_len,
        "images_per_sample": work.images_per_sample,
        "best": as_dict(result.best),
        "homogeneous": as_dict(result.homogeneous),
        "paper_baseline": as_dict(result.stock) if result.stock is not None else None,
        "top": [as_dict(e) for e in result.ranked[: config.top]],
        "baseline": config.baseline,
        "gain_pct": result.gain(config.baseline),
        "gain_pct_best": result.gain("best"),
        "search_seconds": result.seconds,
    }
    from experiments.cli import write_json

    write_json(config.json, out)
    return out


def parse_args(argv: list[str]) -> PlanConfig:
    from experiments.cli import OneLineParser, positive_int
    from hetjax.plan.search import BASELINES

    p = OneLineParser(prog="plan", description=__doc__.splitlines()[0])
    d = PlanConfig()
    p.add_argument("--encoder", default=d.encoder, help="paper-scale encoder, e.g. vit-6b")
    p.add_argument("--llm", default=d.llm, help="paper-scale LLM, e.g. llm-120b")
    p.add_argument("--model", default=d.model, help="a runnable preset instead (tiny, small)")
    p.add_argument("--gpus", type=int, default=d.gpus, help="GPUs of the job")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sample")
    p.add_argument("--global-batch", type=positive_int, default=None, help="samples per step")
    p.add_argument("--images", type=positive_int, default=d.images, help="images per sample")
    p.add_argument("--gpu", default=d.gpu, help="hardware profile: h100, h200, cpu")
    p.add_argument(
        "--even-stages", action="store_true", help="LLM pp divides its layers (hetjax's executor)"
    )
    p.add_argument("--top", type=positive_int, default=d.top, help="plans listed")
    p.add_argument(
        "--baseline",
        default=d.baseline,
        choices=BASELINES,
        help="gain over: paper (the LLM's own layout, inherited by the encoder) or best "
        "(the best homogeneous plan)",
    )
    p.add_argument("--json", default=d.json, help="write the result as JSON")
    return PlanConfig(**vars(p.parse_args(argv)))


AUTO = "auto"  # --layout auto: parallel.layouts == {AUTO: AUTO}


def hetjax_workload(global_batch: int, seq_len: int, *, act_bytes: int):
    """A runnable preset's step as hetjax's executor runs it: one image per sample, XLA's
    full attention, one TP input-gradient reduction per column-parallel weight (fused
    q|k|v and gate|up: two per block), ep gradients (and cp ones, except a
    dense LLM's, which are reduced once per step) summed per microbatch (what the
    validation test checks against the compiled programs)."""
    from hetjax.plan import Workload

    return Workload(
        global_batch,
        seq_len,
        1,
        act_bytes=act_bytes,
        full_attention=True,
        fused_columns=False,
        replica_grads_per_microbatch=True,
    )


def auto_plans(
    cfg, num_devices: int, work, *, gpu: str, zero1: bool, sequence_parallel: bool
) -> list:
    """The planner's heterogeneous plans for ``--layout auto``, best first: whole pipeline
    stages, the run's own ZeRO-1 and sequence-parallel switches, hetjax's recompute (the
    executor re-runs each stage's forward in its backward: priced as none)."""
    from hetjax.plan.search import search

    if cfg.audio is not None or cfg.vision is None:
        raise ValueError(
            f"--layout auto plans one vision encoder and the LLM; {cfg.name} has "
            f"{', '.join(cfg.encoders) or 'no encoder'}: give --layout per module"
        )
    saver = dict(recompute="none", zero1=zero1, sequence_parallel=sequence_parallel)
    result = search(cfg, num_devices, work, gpu, even_stages=True, savers=[saver], keep=64)
    return list(result.ranked)


class StepTimeCheck:
    """``--layout auto``'s observer: at the end of the run, prints the planner's step time
    beside the measured one (the median over the steps after the first, which compiles)."""

    def __init__(self, predicted_s: float, print_fn=print):
        self.predicted_s, self.print = predicted_s, print_fn

    def on_step(self, step: int, metrics) -> None:
        pass

    def on_end(self, history) -> None:
        import statistics

        times = [m["step_time_s"] for m in history[1:]]
        if not times:
            return
        measured = statistics.median(times)
        self.print(
            f"--layout auto: predicted step {self.predicted_s:.4g} s, measured "
            f"{measured:.4g} s (median of {len(times)} steps after the first): "
            f"{self.predicted_s / measured - 1:+.0%}"
        )


def layout_choices(ests: list) -> list:
    """The planner's estimates as :class:`hetjax.train.LayoutChoice` s, in their order:
    layouts as objects, islands (non-colocated) and microbatches (what
    :class:`hetjax.train.Trainer` takes, trying them in order)."""
    from hetjax.train import LayoutChoice

    out = []
    for est in ests:
        plan = est.plan
        v, l = plan.vision.layout, plan.llm.layout
        islands = {"vision": v.num_devices, "llm": l.num_devices}
        islands = islands if plan.mode == "non-colocated" else None
        out.append(LayoutChoice({"vision": v, "llm": l}, plan.mode, islands, plan.microbatches))
    return out


def one_line(main_fn, parse_fn):
    """``argv -> 0`` running ``main_fn(parse_fn(argv))``; a ValueError (the planner's
    errors) becomes a ConfigError, which ``run_cli`` prints as one line."""

    def run(argv: list[str]) -> int:
        from experiments.cli import ConfigError

        try:
            main_fn(parse_fn(argv))
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return 0

    return run


def cli(argv: list[str]) -> int:
    """The command line (see :func:`one_line`)."""
    return one_line(main, parse_args)(argv)


if __name__ == "__main__":
    from experiments.cli import run_cli

    run_cli(cli, "plan")
