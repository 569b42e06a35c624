"""Sections ``llm_blocks`` (LLM stages without the head: forward, backward and an SGD
update of the block stack, one jitted program) and ``variants`` (the GPU options of that
program: scanned vs unrolled layers, donation, XLA flag recipes)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from experiments.gpu_check.common import Run, guarded, peak_bytes, random_tree, timed


def block_step(module: Any, *, unroll: Any, donate: bool) -> Any:
    """The jitted step of a block stack: ``(blocks, x, ct) -> (new blocks, dx)``, the
    gradient of ``sum(blocks(x) * ct)`` (``ct`` stands in for the head's cotangent) and an
    SGD update (so donated parameters are dead after it, as in a real update)."""
    import jax
    import jax.numpy as jnp

    def loss(blocks, x, ct):
        h = module.apply_blocks(blocks, x, unroll=unroll)
        return jnp.sum(h.astype(jnp.float32) * ct)

    def step(blocks, x, ct):
        grads, dx = jax.grad(loss, argnums=(0, 1))(blocks, x, ct)
        return jax.tree.map(lambda p, g: p - 1e-6 * g.astype(p.dtype), blocks, grads), dx

    return jax.jit(step, donate_argnums=(0,) if donate else ())


def blocks_row(run: Run, llm: Any, layers: int, seq: int, *, unroll=1, donate=True) -> dict:
    """One block-stack program of ``layers`` layers of ``llm``'s width at ``seq`` tokens
    (batch 1, ``sizes.dtype`` compute, f32 parameters): its rates, compile time and memory."""
    import time

    import jax
    import jax.numpy as jnp

    from hetjax.inspect.hlo import matmul_flops
    from models.llm import make_llm

    cfg = dataclasses.replace(llm, depth=layers)
    dtype = jnp.dtype(run.sizes.dtype)
    module = make_llm(cfg, {"image": 0}, dtype)
    keys = jax.random.split(jax.random.key(seq), 3)
    blocks = random_tree(module.abstract_params()["blocks"], keys[0])
    x = jax.random.normal(keys[1], (1, seq, cfg.width), dtype)
    ct = jax.random.normal(keys[2], (1, seq, cfg.width), jnp.float32)
    step = block_step(module, unroll=unroll, donate=donate)
    t0 = time.perf_counter()
    compiled = step.lower(blocks, x, ct).compile()
    compile_s = time.perf_counter() - t0
    _, t = timed(compiled, (blocks, x, ct), run.sizes.block_reps, chain=donate)
    model = 3 * cfg.forward_flops(seq, seq, 0)  # no head: supervised = 0
    return {
        "layers": layers,
        "width": cfg.width,
        "seq": seq,
        "unroll": unroll,
        "donate": donate,
        **run.rates(model, matmul_flops(compiled.as_text()), t),
        "compile_s": compile_s,
        "program_bytes": peak_bytes(compiled),
    }


def llm_blocks_section(run: Run) -> dict:
    """Every (stage, sequence) of ``sizes.llm_blocks`` x ``sizes.llm_seqs``, scanned,
    parameters donated (the executor's defaults)."""
    out = {}
    for name, llm, layers in run.sizes.llm_blocks:
        for seq in run.sizes.llm_seqs:
            out[f"{name}@{seq}"] = run.over() or guarded(blocks_row, run, llm, layers, seq)
    return out


# -- variants ---------------------------------------------------------------------------

RECIPES = ("none", "o1", "maxtext")


def variants_section(run: Run, recipe: str) -> dict:
    """The first block stage at the first sequence under each GPU option: the layer scan
    unrolled (no loop) or not, donation on or off (in this process), and each XLA flag
    recipe (:data:`hetjax.gpu.RECIPES`, or none; each in its own process, since XLA reads
    its flags once): ``this process`` is ``recipe``."""
    name, llm, layers = run.sizes.llm_blocks[0]
    seq = run.sizes.llm_seqs[0]
    out: dict[str, Any] = {"stage": f"{name}@{seq}", "xla_flags_here": recipe}
    for key, kw in (
        ("scan_donate", {}),
        ("unrolled_donate", {"unroll": True}),
        ("scan_no_donate", {"donate": False}),
    ):
        out[key] = run.over() or guarded(blocks_row, run, llm, layers, seq, **kw)
    for other in run.sizes.recipes:
        if other != recipe:
            out[f"xla_{other}"] = run.over() or guarded(other_process, run, other)
    return out


def other_process(run: Run, recipe: str) -> dict:
    """The ``llm_blocks`` row of the first stage and sequence measured by a child
    ``gpu_check`` under XLA flag recipe ``recipe`` (given the time left)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.json")
        argv = [sys.executable, "-m", "experiments.gpu_check", "--sections", "llm_blocks"]
        argv += ["--first-only", "--xla-flags", recipe, "--json", path]
        argv += ["--budget-s", str(max(1, int(run.left_s())))]
        if run.sizes.smoke:
            argv.append("--smoke")
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        done = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=run.left_s() + 60
        )
        if done.returncode != 0:
            return {"error": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"}
        with open(path) as f:
            report = json.load(f)
    rows = report["llm_blocks"]
    row = next(iter(rows.values())) if isinstance(rows, dict) else rows
    return {"xla_flags": report["xla_flags"], **row}
