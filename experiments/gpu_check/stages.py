"""Sections that run the library's own programs through :class:`hetjax.train.Trainer`
(:mod:`experiments.runner`): ``llm_loss_stage`` and ``vit_stage`` (one stage's
forward+backward programs, timed by the executor's ``profile=True`` step),
``llava_step`` (one full executor step: forward, backward, update),
``executor_vs_fused`` (the same step as the reference trainer's one ``jax.jit``) and
``reduce_scatter`` (which collectives ZeRO-1 and sequence parallelism compile to)."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from experiments.gpu_check.common import Run, guarded

STAGE = 0  # every module here has one stage


def build_trainer(run: Run, cfg: Any, policy: str, batch: int, observers=(), **parallel):
    """The one-device trainer of ``cfg`` (``sizes.dtype`` compute, global batch ``batch``, one
    microbatch), every module under the activation policy ``policy``."""
    import optax

    from experiments import runner

    fields = {"layouts": {"llm": "dp=1"}, "microbatches": 1, "recompute": {"*": policy}}
    row = runner.bench_config(
        model={"dtype": run.sizes.dtype},
        data={"global_batch": batch},
        parallel={**fields, **parallel},
    )
    return runner.trainer(
        row,
        devices=run.devices[:1],
        observers=list(observers),
        preset=cfg,
        optimizer=optax.sgd(1e-4),  # no moments: the memory goes to activations
    )


def stage_row(run: Run, cfg: Any, module: str, batch_size: int, policy: str) -> dict:
    """MFU, HFU and times of ``module``'s stage (fwd+bwd programs, update excluded) under
    recompute ``policy``. Every module's row comes from one executor's profiled steps,
    kept for the sections of the call that ask for the same model (the smoke run's
    ``llm_loss_stage`` and ``vit_stage`` share one)."""
    key = (cfg.name, policy, batch_size)
    if key not in run.stage_rows:
        run.stage_rows[key] = stage_rows(run, cfg, batch_size, policy)
    rows = run.stage_rows[key]
    return rows.get(module, rows)


def stage_rows(run: Run, cfg: Any, batch_size: int, policy: str) -> dict:
    import jax

    from experiments.bench_bf16 import grad_dtypes
    from hetjax.inspect import CompileCounter, Recorder
    from hetjax.inspect.hlo import matmul_flops
    from hetjax.runtime import flops

    rec = Recorder()
    tr = build_trainer(run, cfg, policy, batch_size, [rec])
    ex, graph, data = tr.engine, tr.graph, tr.data
    t0 = time.perf_counter()
    jax.block_until_ready(ex.step(data.batch(0)))
    compile_s = time.perf_counter() - t0
    rec.pause()
    with CompileCounter() as compiles:
        jax.block_until_ready(ex.step(data.batch(1)))
    for s in range(2):  # the second profiled step is the one reported
        batch = data.batch(2 + s)
        # Wait for the update too, so the next step's programs start on an idle device.
        jax.block_until_ready((ex.step(batch, profile=True), ex.state))
    sizes = (batch_size, cfg.seq_len, int(batch["loss_mask"].sum()))
    model = flops.model_flops(graph, cfg.forward_flops(*sizes), cfg.attention_flops(*sizes[:2]))
    rows = {}
    for module in ("llm", "vision"):
        key = (module, STAGE)
        times = {kind: ts[-1] for (kind, st), ts in ex.op_times.items() if st == key}
        hw = sum(
            matmul_flops(rec.compiled[(key, kind)].as_text()) * n
            for (k, kind), n in rec.calls.items()
            if k == key and kind in ("fwd", "bwd")
        )
        rows[module] = {
            "policy": policy,
            "op_time_s": times,
            **run.rates(model[module], hw, sum(times.values())),
            "compile_and_first_step_s": compile_s,
            # the step's compiles, whichever stage's (one executor runs them all)
            "recompiles_after_step_1": compiles.count,
            "recompiled": compiles.names,
        }
    enabled, platform = ex.inflight_guard, run.devices[0].platform
    rows["llm"]["grad_dtypes"] = grad_dtypes(ex, rec)
    rows["llm"]["inflight_guard"] = {
        "platform": platform,
        "enabled": enabled,
        "ok": enabled == (platform == "cpu"),
    }
    return rows


def llm_model(run: Run) -> Any:
    """The loss stage's model: ``sizes.loss_llm`` at ``loss_layers`` (a tiny ViT feeds it)."""
    import dataclasses

    from models.config import PRESETS, MLLMConfig

    s, tiny = run.sizes, PRESETS["tiny"]
    llm = dataclasses.replace(s.loss_llm, depth=s.loss_layers)
    vision = dataclasses.replace(tiny.vision, depth=1) if s.smoke else tiny.vision
    return MLLMConfig("gpu-check-llm", llm=llm, vision=vision, seq_len=s.loss_seq)


def vit_model(run: Run) -> Any:
    """The ViT stage's model: ``sizes.vit`` feeding the tiny LLM (smoke: the loss stage's
    model, whose executor then measures both)."""
    from models.config import PRESETS, MLLMConfig

    if run.sizes.smoke:
        return llm_model(run)
    vit = run.sizes.vit
    return MLLMConfig(
        "gpu-check-vit", llm=PRESETS["tiny"].llm, vision=vit, seq_len=vit.num_tokens + 64
    )


def llm_loss_stage_section(run: Run) -> dict:
    """The LLM's loss stage (blocks, head, loss) at ``sizes.loss_*``: its forward runs
    inside its backward program (op ``B`` alone), so one policy says it all."""
    cfg = llm_model(run)
    shape = {"width": cfg.llm.width, "layers": cfg.llm.depth, "seq": cfg.seq_len, "batch": 1}
    return {"shape": shape, "none": run.over() or guarded(stage_row, run, cfg, "llm", 1, "none")}


def vit_stage_section(run: Run) -> dict:
    """The vision encoder's stage at ``sizes.vit`` and ``vit_batch``, per recompute
    policy (``full`` replays the forward in the backward; ``none`` keeps residuals)."""
    cfg, b = vit_model(run), run.sizes.vit_batch
    e = cfg.vision
    out: dict[str, Any] = {
        "shape": {"width": e.width, "layers": e.depth, "tokens": e.block_tokens, "batch": b}
    }
    for policy in ("full", "none"):
        out[policy] = run.over() or guarded(stage_row, run, cfg, "vision", b, policy)
    return out


# -- the full step ----------------------------------------------------------------------


def llava_config(run: Run) -> Any:
    """``sizes.llava``: LLaVA-1.5-7B's shapes with the LLM cut to ``llava_layers``."""
    import dataclasses

    s = run.sizes
    llm = dataclasses.replace(s.llava.llm, depth=s.llava_layers)
    return dataclasses.replace(s.llava, name="gpu-check-llava", llm=llm, seq_len=s.llava_seq)


def llava_trainer(run: Run, *, reference: bool) -> Any:
    """The LLaVA step's trainer (vision frozen, as LLaVA-1.5's second stage), shared by
    the sections of one call; the executor's is dropped before the reference is built
    (both would not fit next to each other)."""
    import optax

    from experiments import runner

    key = "reference" if reference else "executor"
    if key not in run.shared:
        run.shared.clear()
        s = run.sizes
        par = (
            {"reference": True}
            if reference
            else {"layouts": {"llm": "dp=1"}, "recompute": {"*": s.llava_policy}}
        )
        row = runner.bench_config(
            model={"dtype": run.sizes.dtype, "freeze": "vision"},
            data={"global_batch": s.llava_batch},
            parallel={"microbatches": 1, **par},
        )
        optimizer = optax.adamw(1e-5)
        run.shared[key] = runner.trainer(
            row, devices=run.devices[:1], preset=llava_config(run), optimizer=optimizer
        )
    return run.shared[key]


def step_times(run: Run, tr: Any) -> tuple[dict, float]:
    """(the last step's metrics, the median wall time of ``sizes.step_reps`` steps after
    the compiling one), each step waited for in full (loss and parameters)."""
    import statistics

    from experiments import runner

    batches = runner.batches(tr, 1 + run.sizes.step_reps)
    _, total = runner.timed_steps(tr.engine, batches)
    metrics = tr.model.flop_metrics(tr)
    supervised = float(batches[-1]["loss_mask"].sum())
    t = statistics.median(total)
    return metrics(supervised, t), t


def llava_step_section(run: Run) -> dict:
    """One full executor step of the cut LLaVA-7B (forward, backward, AdamW update): MFU
    and HFU by the task's own counting (:meth:`models.llava.task.LlavaTask.flop_metrics`)."""
    tr = llava_trainer(run, reference=False)
    metrics, t = step_times(run, tr)
    run.shared["executor_step_s"] = t
    cfg = llava_config(run)
    out = {
        "shape": {
            "llm_layers": cfg.llm.depth,
            "llm_width": cfg.llm.width,
            "seq": cfg.seq_len,
            "batch": run.sizes.llava_batch,
        }
    }
    return {**out, **step_row(run, metrics, t)}


def step_row(run: Run, metrics: dict, t: float) -> dict:
    hw = metrics["hardware_tflops_per_step"] * 1e12
    return {
        **run.rates(metrics["model_tflops_per_step"] * 1e12, hw, t),
        "mfu_by_module": {
            k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("mfu/")
        },
    }


def executor_vs_fused_section(run: Run) -> dict:
    """The same step as the reference trainer's one fused ``jax.jit`` (same model, batch,
    freeze and optimizer), and the executor's time over it (the goal: at most 1.03)."""
    if "executor_step_s" not in run.shared:
        run.shared["executor_step_s"] = step_times(run, llava_trainer(run, reference=False))[1]
    executor = run.shared["executor_step_s"]
    metrics, t = step_times(run, llava_trainer(run, reference=True))
    run.shared.clear()
    return {
        "executor_step_s": executor,
        "fused": step_row(run, metrics, t),
        "executor_over_fused": executor / t,
    }


# -- collectives ------------------------------------------------------------------------


def reduce_scatter_section(run: Run) -> dict:
    """Collective kinds of ZeRO-1's reduction and of sequence-parallel blocks on 4
    devices (tiny model, LLM ``dp=2,tp=2``); XLA:CPU has no reduce-scatter pass, so on
    CPU both are all-reduces by construction."""
    import jax

    from experiments import runner
    from hetjax.inspect import Recorder, collectives, varied_axes
    from models.config import PRESETS

    devices = run.devices
    if len(devices) < 4:
        return {"needs_devices": 4, "visible": len(devices), "checked": False}
    layouts = {"vision": "dp=4", "llm": "dp=2,tp=2"}
    row = runner.bench_config(
        data={"global_batch": 4},
        parallel={"layouts": layouts, "microbatches": 1, "zero1": True, "sequence_parallel": True},
    )
    rec = Recorder()
    preset = llm_model(run) if run.sizes.smoke else PRESETS["tiny"]
    tr = runner.trainer(row, devices=devices[:4], observers=[rec], preset=preset)
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
