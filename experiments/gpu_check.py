"""What to measure when a GPU is lent: stage MFU, collectives, attention kernels, compiles.

    python -m experiments.gpu_check --json out.json [--peak-tflops 989] [--smoke]

Built to finish within 5 minutes on one H100/H200; ``--smoke`` runs the same code at
tiny sizes on (simulated) CPU devices, which is what the test covers: one layer per
module, sequence 48, batch 1, and one executor whose two stages are both the LLM and the
ViT rows (the full run builds one per row); its model also serves the collectives check. Each
section below is one key of the JSON object; a section that fails (e.g. out of memory)
reports ``{"error": ...}`` and the others still run.

- ``llm_stage``: MFU of the LLM's stage program (forward + backward) at a real width: a
  4-layer LLM of ``llm-14b``'s width (5120, 40 heads, 8 kv heads, MLP 17920, vocabulary
  128256, embedding and head included) at sequence 4096, batch 1, bfloat16 compute
  (parameters float32), one device, one microbatch. Per activation policy
  (``--recompute``): ``full`` (the backward replays the forward) and ``none`` (the
  forward keeps the ``jax.vjp`` residuals). The LLM is the loss stage, whose forward
  runs inside its backward program (op ``B`` alone), so both policies run the same
  program there; the ViT row shows what ``none`` saves. Why 4096, not 8192: the first
  H200 runs took the plain attention path at ``cp=1``, which materialises the float32
  ``[heads, L, L]`` scores (40 x 8192^2 x 4 B = 10.7 GB per layer, several arrays of it
  kept per layer), and at 8192 the stage asked XLA:GPU for 113 GiB. On a GPU causal
  attention now takes cuDNN's fused kernel (:func:`hetjax.ops.causal_attention`), but
  the 8192 stage has not run with it yet; ``--seq-len 8192`` tries. Timed with the executor's
  ``profile=True`` step (each program waited for); ``mfu`` counts model FLOPs (the 3x
  rule, :func:`hetjax.runtime.flops.model_flops`), ``hfu`` the matmul FLOPs the compiled
  programs execute (recompute included; :func:`hetjax.inspect.hlo.matmul_flops`).
  ``recompiles_after_step_1``: backend compiles during step 2 (must be 0).
  ``grad_dtypes``: element types of the stage's backward and reduction (see
  :mod:`experiments.bench_bf16`); on GPU its matmuls write bf16, on XLA:CPU f32.
- ``vit_stage``: the same for CLIP ViT-L/14-336 (23 layers, 576 tokens), batch 16.
- ``reduce_scatter``: on 4 devices (tiny model, LLM ``dp=2,tp=2``, ZeRO-1 and sequence
  parallelism on), which collectives the step's ZeRO-1 reduction (the ``reduce``
  program's collectives across ``dp``) and the sequence-parallel blocks (the LLM
  backward's collectives across ``tp``) compile to; ``needs_devices`` when fewer are
  visible. XLA:CPU has no reduce-scatter pass (it keeps all-reduce + slice), so on CPU
  ``zero1_reduce_scatter`` / ``sp_reduce_scatter`` are false by construction.
- ``attention``: fwd+bwd time of the ring attention's kernel vs the all-gather's at
  ``cp=1`` (one device, the block computation alone: ``ring_attention(...,
  dense_at_cp1=False)``), at the LLM's heads and sequence; ``fused``: cuDNN's fused
  kernel that ``causal_attention`` takes on a GPU against its plain path (times, and
  the relative difference of output and gradients).
- ``inflight_guard``: whether the executor's XLA:CPU-only in-flight guard is on (it must
  be off on GPU).
- ``device``, ``peak_tflops``: the device kind and its dense BF16 peak
  (:func:`hetjax.runtime.flops.peak_tflops`; ``--peak-tflops`` overrides; unknown: MFU
  is null).

Runs that are not ``--smoke`` apply :func:`hetjax.gpu_flags` (``--no-gpu-flags``: not).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import traceback
import warnings
from collections import Counter
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The 14B-wide stage and its attention scores need most of the device's memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

# SGD has no state to alias, so the update's donated buffers go unused: not a problem.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

POLICIES = ("full", "none")
STAGE = 0  # every module here has one stage


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The shapes of one run (full or smoke)."""

    llm_width_of: str  # a PAPER_LLMS name, or "tiny"
    llm_layers: int
    seq_len: int
    llm_batch: int
    vit: str  # "clip-l-336" or "tiny"
    vit_batch: int
    attention_reps: int
    vit_layers: int | None = None  # None: the encoder's own depth
    # One executor of one model measures both stages (the LLM model's encoder is the ViT
    # under test, at the LLM's batch), and the collectives check trains that model too.
    shared: bool = False


FULL = Sizes("llm-14b", 4, 4096, 1, "clip-l-336", 16, 5)  # why 4096: see the docstring
# The smallest shapes the checks allow (seq 48: the synthetic samples' longest is 48
# inputs): compiling, not running, is the smoke run's cost.
SMOKE = Sizes("tiny", 1, 48, 1, "tiny", 1, 1, vit_layers=1, shared=True)


@dataclasses.dataclass(frozen=True)
class CheckConfig:
    json: str | None = None  # where to write the JSON object; None: print only
    smoke: bool = False  # tiny sizes on CPU devices (for the test)
    peak_tflops: float | None = None  # dense BF16 TFLOP/s per device; None: from the table
    gpu_flags: bool = True  # apply hetjax.gpu_flags() (not in --smoke)
    seq_len: int | None = None  # the LLM's sequence length; None: 4096 (smoke: 48)
    sections: tuple[str, ...] = ()  # run only these report keys' sections; (): all


# -- models ---------------------------------------------------------------------------------


def llm_model(sizes: Sizes) -> Any:
    """The LLM row's model config (a tiny ViT feeds the LLM under test)."""
    from models.config import PAPER_LLMS, PRESETS, MLLMConfig

    tiny = PRESETS["tiny"]
    base = tiny.llm if sizes.llm_width_of == "tiny" else PAPER_LLMS[sizes.llm_width_of]
    llm = dataclasses.replace(base, depth=sizes.llm_layers)
    vision = tiny.vision
    if sizes.shared and sizes.vit_layers is not None:
        vision = dataclasses.replace(vision, depth=sizes.vit_layers)
    return MLLMConfig("gpu-check-llm", llm=llm, vision=vision, seq_len=sizes.seq_len)


def vit_model(sizes: Sizes) -> Any:
    """The ViT row's model: the encoder under test feeding the tiny LLM."""
    from models.config import PRESETS, MLLMConfig

    tiny = PRESETS["tiny"]
    vit = tiny.vision if sizes.vit == "tiny" else PRESETS["llava-1.5-7b"].vision
    if sizes.vit_layers is not None:
        vit = dataclasses.replace(vit, depth=sizes.vit_layers)
    return MLLMConfig("gpu-check-vit", llm=tiny.llm, vision=vit, seq_len=vit.num_tokens + 64)


# -- one stage's MFU ------------------------------------------------------------------------


def build_trainer(cfg: Any, devices: list, policy: str | None, observers: list, batch: int):
    """The one-device trainer of ``cfg`` (bf16 compute, global batch ``batch``), every
    module under the activation policy ``policy`` (``parallel.recompute``)."""
    import optax

    from experiments import runner

    row = runner.bench_config(
        model={"dtype": "bfloat16"},
        data={"global_batch": batch},
        parallel={"layouts": {"llm": "dp=1"}, "microbatches": 1, "recompute": {"*": policy}},
    )
    return runner.trainer(
        row,
        devices=devices[:1],
        observers=observers,
        preset=cfg,
        optimizer=optax.sgd(1e-4),  # no moments: the memory goes to activations
    )


def stage_rows(cfg: Any, modules: tuple, batch_size: int, devices: list, policy: str | None, peak):
    """Per module of ``modules``: MFU, HFU and times of its stage under recompute
    ``policy``, all from one executor's steps."""
    import jax

    from experiments.bench_bf16 import grad_dtypes
    from hetjax.inspect import CompileCounter, Recorder
    from hetjax.inspect.hlo import matmul_flops
    from hetjax.runtime import flops

    rec = Recorder()
    tr = build_trainer(cfg, devices, policy, [rec], batch_size)
    ex, graph, data = tr.engine, tr.graph, tr.data
    batch = data.batch(0)
    t0 = time.perf_counter()
    jax.block_until_ready(ex.step(batch))
    compile_s = time.perf_counter() - t0
    rec.pause()
    next_batch = data.batch(1)
    with CompileCounter() as compiles:
        jax.block_until_ready(ex.step(next_batch))
    for s in range(2):  # the second profiled step is the one reported
        batch = data.batch(2 + s)
        # Wait for the update too, so the next step's programs start on an idle device.
        jax.block_until_ready((ex.step(batch, profile=True), ex.state))
    forward = cfg.forward_flops(batch_size, cfg.seq_len, int(batch["loss_mask"].sum()))
    model_flops = flops.model_flops(graph, forward)
    rows = {}
    for module in modules:
        key = (module, STAGE)
        times = {kind: ts[-1] for (kind, st), ts in ex.op_times.items() if st == key}
        stage_s = sum(times.values())
        model_f = model_flops[module]
        hw = sum(
            matmul_flops(rec.compiled[(key, kind)].as_text()) * n
            for (k, kind), n in rec.calls.items()
            if k == key and kind in ("fwd", "bwd")
        )
        row = {
            "policy": policy or "full",
            "stage_time_s": stage_s,
            "op_time_s": times,
            "model_tflops": model_f / 1e12,
            "hardware_tflops": hw / 1e12,
            "tflops_per_s": model_f / 1e12 / stage_s,
            "mfu": model_f / 1e12 / stage_s / peak if peak else None,
            "hfu": hw / 1e12 / stage_s / peak if peak else None,
            "compile_and_first_step_s": compile_s,
            # the step's compiles, whichever stage's (one executor runs them all)
            "recompiles_after_step_1": compiles.count,
            "recompiled": compiles.names,
        }
        if module == "llm":
            row["grad_dtypes"] = grad_dtypes(ex, rec)
            row["inflight_guard"] = inflight_guard(ex, devices)
        rows[module] = row
    return rows


def inflight_guard(ex: Any, devices: list) -> dict:
    """The executor's CPU-only in-flight guard: on for XLA:CPU, off on a GPU."""
    enabled = ex.inflight_guard
    platform = devices[0].platform
    return {"platform": platform, "enabled": enabled, "ok": enabled == (platform == "cpu")}


SECTION = {"llm": "llm_stage", "vision": "vit_stage"}


def stage_sections(cfg: Any, modules: tuple, batch_size: int, devices: list, peak) -> dict:
    """Report sections (``llm_stage``, ``vit_stage``) of ``modules``' stages: their rows
    per activation policy."""
    out: dict[str, Any] = {}
    for module in modules:
        enc = cfg.llm if module == "llm" else cfg.vision
        out[SECTION[module]] = {
            "module": module,
            "shape": {
                "width": enc.width,
                "layers": enc.depth,
                "tokens_per_sample": cfg.seq_len if module == "llm" else cfg.vision.num_tokens,
                "batch": batch_size,
            },
        }
    for policy in POLICIES:
        rows = guarded(stage_rows, cfg, modules, batch_size, devices, policy, peak)
        for module in modules:
            out[SECTION[module]][policy] = rows.get(module, rows)  # or the error
    return out


# -- collectives ----------------------------------------------------------------------------


def reduce_scatter_section(cfg: Any, devices: list) -> dict:
    """Collective kinds of ZeRO-1's reduction and of sequence-parallel blocks, training
    ``cfg`` (float32; None: the ``tiny`` preset)."""
    import jax

    from experiments import runner
    from hetjax.inspect import Recorder, collectives, varied_axes

    if len(devices) < 4:
        return {"needs_devices": 4, "visible": len(devices), "checked": False}
    layouts = {"vision": "dp=4", "llm": "dp=2,tp=2"}
    row = runner.bench_config(
        data={"global_batch": 4},
        parallel={"layouts": layouts, "microbatches": 1, "zero1": True, "sequence_parallel": True},
    )
    rec = Recorder()
    tr = runner.trainer(row, devices=devices[:4], observers=[rec], preset=cfg)
    ex = tr.engine
    jax.block_until_ready(ex.step(tr.data.batch(0)))
    key = ("llm", 0)
    mesh = ex.programs[key].mesh

    def kinds(kind: str, axis: str) -> dict[str, int]:
        found = collectives(rec.compiled[(key, kind)].as_text(), mesh.size)
        return dict(Counter(c.kind for c in found if axis in varied_axes(c, mesh)))

    zero1, sp = kinds("reduce", "dp"), kinds("bwd", "tp")
    return {
        "checked": True,
        "platform": devices[0].platform,
        "zero1_reduction_kinds": zero1,
        "zero1_reduce_scatter": "reduce-scatter" in zero1,
        "sp_bwd_tp_kinds": sp,
        "sp_reduce_scatter": "reduce-scatter" in sp,
    }


# -- attention ------------------------------------------------------------------------------


def attention_section(cfg: Any, devices: list, reps: int) -> dict:
    """Ring vs all-gather kernel time at cp=1 (forward + backward), at the LLM's shape."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    from hetjax.ops import ring_attention

    mesh = Mesh(np.array(devices[:1]).reshape(1, 1, 1, 1), ("dp", "ep", "cp", "tp"))
    c = cfg.llm
    b, l, h, g, k = 1, cfg.seq_len, c.heads, c.kv_heads, c.head_dim
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, l, h, k), jnp.bfloat16)
    kv = [jax.random.normal(x, (b, l, g, k), jnp.bfloat16) for x in keys[1:]]
    pos = jnp.arange(l)
    out: dict[str, Any] = {"shape": {"batch": b, "seq": l, "heads": h, "kv_heads": g, "dim": k}}
    for impl in ("ring", "allgather"):

        def loss(q, k, v, impl=impl):
            o = ring_attention(q, k, v, pos, mesh=mesh, impl=impl, dense_at_cp1=False)
            return jnp.sum(o.astype(jnp.float32))

        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        out[f"{impl}_fwd_bwd_s"] = timed(step, (q, *kv), reps)[1]
    out["ring_over_allgather"] = out["ring_fwd_bwd_s"] / out["allgather_fwd_bwd_s"]
    out["fused"] = guarded(fused_attention_rows, q, kv, pos, reps)
    return out


def timed(step: Any, args: tuple, reps: int) -> tuple[Any, float]:
    """(the first result of ``step(*args)``, the median time of ``reps`` more calls)."""
    import jax

    from hetjax.inspect import Timer

    first = jax.block_until_ready(step(*args))
    timer = Timer()
    for _ in range(reps):
        with timer:
            jax.block_until_ready(step(*args))
    return first, timer.median


def fused_attention_rows(q: Any, kv: list, pos: Any, reps: int) -> dict:
    """cuDNN's fused kernel against the plain path of ``causal_attention`` (fwd+bwd time,
    and how far its output and gradients are from the plain path's, relative to the
    largest plain value): what ``causal_attention`` picks on a GPU."""
    import jax
    import jax.numpy as jnp

    from hetjax.ops.ring_kernels import causal_attention, fused_attention_applies

    if not fused_attention_applies(q, kv[0]):
        return {"checked": False, "why": f"not taken here ({jax.default_backend()}, {q.dtype})"}
    ct = jax.random.normal(jax.random.key(1), q.shape, jnp.float32)
    got, out = {}, {"checked": True}
    for fused in (False, True):

        def loss(q, k, v, fused=fused):
            o = causal_attention(q, k, v, pos, fused=fused)
            return jnp.sum(o.astype(jnp.float32) * ct), o

        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
        got[fused], out[f"{'fused' if fused else 'plain'}_fwd_bwd_s"] = timed(step, (q, *kv), reps)
    out["plain_over_fused"] = out["plain_fwd_bwd_s"] / out["fused_fwd_bwd_s"]
    (grads_p, o_p), (grads_f, o_f) = got[False], got[True]
    for name, a, b in zip(("dq", "dk", "dv", "out"), (*grads_p, o_p), (*grads_f, o_f), strict=True):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        out[f"{name}_rel_diff"] = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
    return out


# -- driver ---------------------------------------------------------------------------------


def guarded(fn, *args) -> Any:
    """``fn(*args)``, or ``{"error": ...}`` if it raises (so later sections still run)."""
    try:
        return fn(*args)
    except Exception as e:  # out of memory, an XLA error: report it, keep going
        traceback.print_exc(file=sys.stderr)
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}


def print_table(report: dict) -> None:
    print(f"device: {report['device']} ({report['num_devices']}), peak {report['peak_tflops']}")
    print(
        f"{'stage':<6} {'policy':<6} {'time s':>8} {'TFLOP/s':>8} {'MFU':>6} {'HFU':>6} recompiles"
    )
    for section in ("llm_stage", "vit_stage"):
        sec = report.get(section, {"module": section, "full": "not run", "none": "not run"})
        for policy in POLICIES:
            r = sec.get(policy, {})
            if "stage_time_s" not in r:
                print(f"{sec.get('module', section):<6} {policy:<6} {r}")
                continue

            def pct(x):
                return f"{x:6.1%}" if x is not None else "     -"

            print(
                f"{sec['module']:<6} {policy:<6} {r['stage_time_s']:8.4f} {r['tflops_per_s']:8.2f}"
                f" {pct(r['mfu'])} {pct(r['hfu'])} {r['recompiles_after_step_1']}"
            )
    a = report.get("attention", "not run")
    if "ring_fwd_bwd_s" in a:
        print(
            f"attention cp=1 fwd+bwd: ring {a['ring_fwd_bwd_s'] * 1e3:.2f} ms, all-gather "
            f"{a['allgather_fwd_bwd_s'] * 1e3:.2f} ms"
            f" (ring/all-gather {a['ring_over_allgather']:.2f})"
        )
    else:
        print(f"attention: {a}")
    f = a.get("fused", {}) if isinstance(a, dict) else {}
    if f.get("checked"):
        print(
            f"attention cp=1 plain vs cuDNN fused fwd+bwd: {f['plain_fwd_bwd_s'] * 1e3:.2f} ms vs"
            f" {f['fused_fwd_bwd_s'] * 1e3:.2f} ms; relative difference out"
            f" {f['out_rel_diff']:.1e}, dq {f['dq_rel_diff']:.1e}, dk {f['dk_rel_diff']:.1e},"
            f" dv {f['dv_rel_diff']:.1e}"
        )
    else:
        print(f"attention fused: {f}")
    print(f"reduce-scatter: {report.get('reduce_scatter', 'not run')}")
    guard = report.get("llm_stage", {}).get("full", {})
    print(f"in-flight guard: {guard.get('inflight_guard') if isinstance(guard, dict) else None}")


def main(config: CheckConfig, devices: list | None = None) -> dict:
    """Runs every section, prints a table, writes the JSON object. ``devices``: the ones
    to use when a JAX backend already runs (a test calling it in-process); None: set up
    here (GPU flags first)."""
    from experiments.cli import ConfigError, accelerator_installed, setup_devices

    if devices is not None:
        pass
    elif config.smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    elif not accelerator_installed():
        raise ConfigError("no GPU here: the full check needs one; use --smoke on CPU")
    elif config.gpu_flags:
        from hetjax.gpu import apply_gpu_flags

        apply_gpu_flags()
    if devices is None:
        devices = setup_devices(None)  # before anything else starts a JAX backend
    from hetjax.runtime import flops

    sizes = SMOKE if config.smoke else FULL
    if config.seq_len:
        sizes = dataclasses.replace(sizes, seq_len=config.seq_len)
    kind = devices[0].device_kind
    peak = config.peak_tflops or flops.peak_tflops(kind)
    report: dict[str, Any] = {
        "smoke": config.smoke,
        "device": kind,
        "platform": devices[0].platform,
        "num_devices": len(devices),
        "peak_tflops": peak,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    t0 = time.perf_counter()
    llm = llm_model(sizes)
    if sizes.shared:  # one executor: both stages; its model's collectives too
        stages = [(("llm", "vision"), llm, sizes.llm_batch)]
    else:
        stages = [(("llm",), llm, sizes.llm_batch), (("vision",), None, sizes.vit_batch)]
    # (report keys, what computes them): each runs guarded
    sections: list[tuple[tuple, Any]] = [
        (
            tuple(SECTION[m] for m in modules),
            lambda modules=modules, cfg=cfg, batch=batch: stage_sections(
                cfg or vit_model(sizes), modules, batch, devices, peak
            ),
        )
        for modules, cfg, batch in stages
    ]
    rs_cfg = llm if sizes.shared else None
    sections.append(
        (("reduce_scatter",), lambda: {"reduce_scatter": reduce_scatter_section(rs_cfg, devices)})
    )
    sections.append(
        (
            ("attention",),
            lambda: {"attention": attention_section(llm, devices, sizes.attention_reps)},
        )
    )
    from experiments.cli import write_json

    if config.sections:
        unknown = set(config.sections) - {n for names, _ in sections for n in names}
        if unknown:
            raise ConfigError(
                f"--sections: unknown {sorted(unknown)}; choose from llm_stage, vit_stage,"
                " reduce_scatter, attention"
            )
        sections = [(n, run) for n, run in sections if set(n) & set(config.sections)]
    for names, run in sections:
        got = guarded(run)
        for name in names:
            report[name] = got.get(name, got)  # or the error
        print(f"  {', '.join(names)} done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        # Written after every section, so a run killed at a time limit keeps what it did.
        write_json(config.json, report)
    report["total_s"] = time.perf_counter() - t0
    print_table(report)
    write_json(config.json, report)
    return report


def parse_args(argv: list[str]) -> CheckConfig:
    from experiments.cli import OneLineParser, positive_float, positive_int

    p = OneLineParser(prog="gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write the report as a JSON object")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (for the test)")
    p.add_argument(
        "--peak-tflops", type=positive_float, default=None, help="dense BF16 TFLOP/s per device"
    )
    p.add_argument("--no-gpu-flags", dest="gpu_flags", action="store_false")
    p.add_argument("--seq-len", type=positive_int, default=None, help="LLM sequence (default 4096)")
    p.add_argument(
        "--sections",
        type=lambda v: tuple(x for x in v.split(",") if x),
        default=(),
        help="comma-separated report keys to run (llm_stage, vit_stage, reduce_scatter,"
        " attention); default all",
    )
    return CheckConfig(**vars(p.parse_args(argv)))


if __name__ == "__main__":
    from experiments.cli import run_cli

    def _run(argv: list[str]) -> int:
        main(parse_args(argv))
        return 0

    run_cli(_run, "gpu_check")
