"""What to measure when a GPU is lent: kernels, stages and a full step against the card's
own matmul ceiling, and the GPU options (issue 30).

    python -m experiments.gpu_check --json experiments/results/gpu_check_<card>.json
    python -m experiments.gpu_check --smoke            # the same code, tiny, on CPU
    bash experiments/gpu_check.sh                      # on a lent GPU: the one call

``experiments/gpu_check.sh`` is the one command a session lent a GPU runs first. Every
section is one key of the JSON object, written after each section (a run killed at its
limit keeps what it did); a section or row that fails (out of memory) reports
``{"error": ...}`` and the rest still run; rows past ``--budget-s`` (default 450 s, so
the whole call fits 8 minutes of device time with the start) report ``{"skipped": ...}``;
one still running when the script's hard time limit ends the call, ``{"stopped": ...}``.
``--sections a,b`` runs only those. Every timed row reports ``tflops_per_s`` (model
FLOPs per second), ``mfu`` and ``hfu`` (over the dense bf16 peak,
:func:`hetjax.runtime.flops.peak_tflops` or ``--peak-tflops``) and ``of_ceiling`` (over
the bf16 matmul rate measured at the start of the same call).

- ``roofline``: bf16 matmul at ``8192^3`` (the ceiling) and at each stage's matmul shapes
  (q/k/v, out, gate|up, down, head; ViT's four), and their FLOP-weighted stage rate.
- ``attention``: fwd+bwd of plain vs fused attention as the models call it: causal and
  packed rows at the LLM's heads, CLIP's encoder attention (577 tokens), a ring block at
  cp=1 (ring and all-gather kernels); the fused path's largest relative difference from
  the plain one in the output and each gradient (bf16).
- ``llm_blocks``: LLM stages without the head (8 layers at 7B width 4096, 4 at 14B width
  5120; sequence 4096, 8192, 32768; batch 1): one jitted forward+backward+SGD update of
  the block stack, parameters donated. MFU by the anchors' count (6 x parameters x
  tokens, causal attention at half the square), HFU from the compiled program's matmuls
  and fused attention calls (:func:`hetjax.inspect.hlo.matmul_flops`).
- ``variants``: the first ``llm_blocks`` row under each GPU option: layers unrolled (no
  scan loop, ``StagedModule(unroll=True)``), donation off, and each XLA flag recipe
  (``none``, ``o1``, ``maxtext``: :mod:`hetjax.gpu`) in a child process.
- ``llm_loss_stage``: the LLM's loss stage (4 layers at 14B width, head and loss, sequence
  4096) through the executor (its ``profile=True`` step times each program);
  ``grad_dtypes``, recompiles after step 1 (must be 0), the in-flight guard (off on GPU).
- ``vit_stage``: CLIP ViT-L/14-336 (23 layers), batch 32, recompute ``full`` and ``none``.
- ``llava_step``: LLaVA-1.5-7B's shapes with the LLM cut to 8 layers (sequence 2048, batch
  8, vision frozen, AdamW): one full executor step, MFU/HFU by the task's own count.
- ``profile``: one trace of that step: kernel time in matmuls, attention, other fusions,
  copies, and gaps.
- ``executor_vs_fused``: the same step as the reference trainer's single ``jax.jit``; the
  executor's time over it.
- ``reduce_scatter``: on 4 devices, the collectives of ZeRO-1 and sequence parallelism
  (``needs_devices`` on one GPU).
- ``qwen_step``: Qwen2.5-VL-7B's shapes (the whole tower, frozen; the LLM cut to 8
  layers; AdamW) on records of mixed image sizes, two-image samples, a video and text,
  written on the spot: executor steps, MFU/HFU by the task's per-patch count, positions,
  real tokens and patches per second, fused attention calls, device memory
  (:mod:`experiments.gpu_check.qwen`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import warnings
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The 32768-token stages and the LLaVA step need most of the device's memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
# SGD has no state to alias, so the update's donated buffers go unused: not a problem.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

# Run order: what the goals read first, so a call cut by its budget loses the least
# (``profile`` reuses ``llava_step``'s trainer, which ``executor_vs_fused`` then drops).
SECTIONS = (
    "roofline",
    "llm_blocks",
    "attention",
    "llm_loss_stage",
    "vit_stage",
    "llava_step",
    "profile",
    "executor_vs_fused",
    "variants",
    "reduce_scatter",
    "qwen_step",  # last: its own model and data; the script's 80 s past the budget cover it
)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The shapes of one run (full or smoke). Configs are ``models.config`` objects."""

    smoke: bool
    roofline_n: int
    matmul_reps: int
    attention_llm: Any  # LLMConfig whose heads the attention rows use
    attention_seq: int
    attention_reps: int
    llm_blocks: tuple  # (name, LLMConfig, layers) per block stage
    llm_seqs: tuple[int, ...]
    block_reps: int
    recipes: tuple[str, ...]  # XLA flag recipes the variants measure
    loss_llm: Any
    loss_layers: int
    loss_seq: int
    vit: Any  # EncoderConfig
    vit_batch: int
    llava: Any  # MLLMConfig
    llava_layers: int
    llava_seq: int
    llava_batch: int
    llava_policy: str
    step_reps: int
    qwen: Any  # MLLMConfig: a qwen2.5-vl preset
    qwen_layers: int  # its LLM cut to these layers
    qwen_seq: int
    qwen_batch: int
    qwen_images: tuple  # (height, width) pixels of the records' images
    qwen_video: tuple  # (frames, height, width) of the records' video
    # Compute dtype of the block, stage and step programs. The smoke run's is float32:
    # XLA:CPU cannot run some bf16 x bf16 -> f32 weight-gradient dots (hetjax.ops.dense),
    # and what the smoke run checks is structure, not bf16 numerics (attention's rows
    # stay bf16 everywhere).
    dtype: str = "bfloat16"


def full_sizes() -> Sizes:
    from models.config import PAPER_LLMS, PRESETS

    llava = PRESETS["llava-1.5-7b"]
    llm7, llm14 = llava.llm, PAPER_LLMS["llm-14b"]
    return Sizes(
        smoke=False,
        roofline_n=8192,
        matmul_reps=10,
        attention_llm=llm14,
        attention_seq=8192,
        attention_reps=5,
        llm_blocks=(("7b", llm7, 8), ("14b", llm14, 4)),
        llm_seqs=(4096, 8192, 32768),
        block_reps=3,
        recipes=("none", "o1", "maxtext"),
        loss_llm=llm14,
        loss_layers=4,
        loss_seq=4096,
        vit=llava.vision,
        vit_batch=32,
        llava=llava,
        llava_layers=8,
        llava_seq=2048,
        llava_batch=8,
        llava_policy="none",
        step_reps=3,
        # 256 to 494 merged tokens an image (1024 to 1976 patches); the video 884 tokens
        # (4 temporal patches of 26x34); two images up to 885 tokens: seq 1024 holds each
        qwen=PRESETS["qwen2.5-vl-7b"],
        qwen_layers=8,
        qwen_seq=1024,
        qwen_batch=4,
        qwen_images=((448, 448), (336, 644), (644, 476), (728, 532)),
        qwen_video=(8, 364, 476),
    )


def smoke_sizes() -> Sizes:
    """The smallest shapes the sections allow (sequence 48: the synthetic samples' longest
    is 48 inputs): compiling, not running, is the smoke run's cost."""
    from models.config import PRESETS

    tiny, small = PRESETS["tiny"], PRESETS["llava-1.5-tiny"]
    vit = dataclasses.replace(small.vision, depth=1)
    return Sizes(
        smoke=True,
        roofline_n=128,
        matmul_reps=1,
        attention_llm=tiny.llm,
        attention_seq=32,
        attention_reps=1,
        llm_blocks=(("tiny", tiny.llm, 1),),
        llm_seqs=(32,),
        block_reps=1,
        recipes=("none",),  # the child process: tests/test_gpu_check.py runs one
        loss_llm=tiny.llm,
        loss_layers=1,
        loss_seq=48,
        vit=vit,
        vit_batch=1,
        llava=dataclasses.replace(small, vision=vit),
        llava_layers=1,
        llava_seq=small.seq_len,
        llava_batch=1,
        llava_policy="none",
        step_reps=1,
        qwen=PRESETS["qwen2.5-vl-tiny"],
        qwen_layers=1,
        qwen_seq=96,
        qwen_batch=4,
        qwen_images=((28, 56), (56, 56), (56, 84)),
        qwen_video=(4, 56, 56),
        dtype="float32",
    )


@dataclasses.dataclass(frozen=True)
class CheckConfig:
    json: str | None = None  # where to write the JSON object; None: print only
    smoke: bool = False  # tiny sizes on CPU devices (for the test)
    peak_tflops: float | None = None  # dense BF16 TFLOP/s per device; None: from the table
    xla_flags: str | None = None  # hetjax.gpu recipe (o1, maxtext) or none; None: o1 (smoke: none)
    sections: tuple[str, ...] = ()  # run only these sections; (): all
    budget_s: float = 450.0  # rows starting later than this are skipped
    first_only: bool = False  # llm_blocks: only its first stage and sequence (variants' child)


def run_sections(config: CheckConfig, run: Any, report: dict) -> None:
    """Runs the chosen sections in order, writing the JSON after each."""
    from experiments.cli import write_json
    from experiments.gpu_check import blocks, kernels, profile, qwen, stages
    from experiments.gpu_check.common import guarded

    recipe = report["xla_recipe"]
    compute = {
        "roofline": kernels.roofline_section,
        "attention": kernels.attention_section,
        "llm_blocks": blocks.llm_blocks_section,
        "variants": lambda run: blocks.variants_section(run, recipe),
        "llm_loss_stage": stages.llm_loss_stage_section,
        "vit_stage": stages.vit_stage_section,
        "llava_step": stages.llava_step_section,
        "profile": profile.profile_section,
        "executor_vs_fused": stages.executor_vs_fused_section,
        "reduce_scatter": stages.reduce_scatter_section,
        "qwen_step": qwen.qwen_step_section,
    }
    t0 = time.perf_counter()
    for name in config.sections or SECTIONS:
        skipped = run.over()
        if skipped is None:  # what the JSON says of a section the call's time limit stops
            report[name] = {"stopped": "still running when the call's time limit came"}
            write_json(config.json, report)
        report[name] = skipped or guarded(compute[name], run)
        print(f"  {name} done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        write_json(config.json, report)


def main(config: CheckConfig, devices: list | None = None) -> dict:
    """Runs the sections, prints a table, writes the JSON object. ``devices``: the ones
    to use when a JAX backend already runs (a test calling it in-process); None: set up
    here (the XLA flags first)."""
    from experiments.cli import ConfigError, accelerator_installed, setup_devices, write_json

    unknown = set(config.sections) - set(SECTIONS)
    if unknown:
        raise ConfigError(
            f"--sections: unknown {sorted(unknown)}; choose from {', '.join(SECTIONS)}"
        )
    recipe = config.xla_flags or ("none" if config.smoke else "o1")
    if devices is None:
        if config.smoke:
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
        elif not accelerator_installed():
            raise ConfigError("no GPU here: the full check needs one; use --smoke on CPU")
        if recipe != "none":
            from hetjax.gpu import apply_gpu_flags

            apply_gpu_flags(recipe)  # type: ignore[arg-type]
        devices = setup_devices(None)  # before anything else starts a JAX backend
    from experiments.gpu_check.common import Run, guarded
    from experiments.gpu_check.kernels import matmul_tflops
    from hetjax.runtime import flops

    sizes = smoke_sizes() if config.smoke else full_sizes()
    if config.first_only:
        sizes = dataclasses.replace(
            sizes, llm_blocks=sizes.llm_blocks[:1], llm_seqs=sizes.llm_seqs[:1]
        )
    kind = devices[0].device_kind
    run = Run(sizes, devices, config.peak_tflops or flops.peak_tflops(kind), config.budget_s)
    n = sizes.roofline_n
    t0 = time.perf_counter()
    run.ceiling_tflops = guarded(matmul_tflops, n, n, n, sizes.matmul_reps)
    if isinstance(run.ceiling_tflops, dict):  # the card cannot even multiply: report it
        run.ceiling_tflops = None
    report: dict[str, Any] = {
        "smoke": config.smoke,
        "device": kind,
        "platform": devices[0].platform,
        "num_devices": len(devices),
        "peak_tflops": run.peak,
        "ceiling_tflops": run.ceiling_tflops,
        "xla_recipe": recipe,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    run_sections(config, run, report)
    report["total_s"] = time.perf_counter() - t0
    from experiments.gpu_check.table import print_table

    print_table(report)
    write_json(config.json, report)
    return report


def parse_args(argv: list[str]) -> CheckConfig:
    from experiments.cli import OneLineParser, positive_float

    p = OneLineParser(prog="gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write the report as a JSON object")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (for the test)")
    p.add_argument(
        "--peak-tflops", type=positive_float, default=None, help="dense BF16 TFLOP/s per device"
    )
    p.add_argument(
        "--xla-flags",
        choices=("none", "o1", "maxtext"),
        default=None,
        help="hetjax.gpu flag recipe applied first (default o1; --smoke: none)",
    )
    p.add_argument("--no-gpu-flags", dest="xla_flags", action="store_const", const="none")
    p.add_argument("--budget-s", type=positive_float, default=450.0, help="skip rows after this")
    p.add_argument(
        "--first-only", action="store_true", help="llm_blocks: first stage and sequence only"
    )
    p.add_argument(
        "--sections",
        type=lambda v: tuple(x for x in v.split(",") if x),
        default=(),
        help=f"comma-separated sections to run ({', '.join(SECTIONS)}); default all",
    )
    return CheckConfig(**vars(p.parse_args(argv)))
