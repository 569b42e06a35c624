"""Sections ``roofline`` (the card's bf16 matmul ceiling, at 8192^3 and at the stages'
own matmul shapes) and ``attention`` (plain vs fused kernels: causal, packed, encoder, a
ring block; times, TFLOP/s and the bf16 differences of outputs and gradients)."""

from __future__ import annotations

from typing import Any

from experiments.gpu_check.common import Run, guarded, timed


def matmul_tflops(m: int, k: int, n: int, reps: int) -> float:
    """TFLOP/s of a bf16 ``[m, k] @ [k, n]`` (f32 accumulation, bf16 out) on random data
    (never zeros: they run faster than real data)."""
    import jax
    import jax.numpy as jnp

    ka, kb = jax.random.split(jax.random.key(m + k + n))
    a = jax.random.normal(ka, (m, k), jnp.bfloat16)
    b = jax.random.normal(kb, (k, n), jnp.bfloat16)
    _, t = timed(jax.jit(jnp.matmul), (a, b), reps)
    return 2 * m * k * n / t / 1e12


def stage_matmuls(run: Run) -> dict[str, list[tuple[str, int, int, int]]]:
    """Per stage of the check, its forward matmuls ``(name, M, K, N)`` at its token count."""
    s = run.sizes
    out = {}
    for name, llm, _layers in s.llm_blocks:
        d, h, g, k, f = llm.width, llm.heads, llm.kv_heads, llm.head_dim, llm.mlp
        t = s.llm_seqs[0]
        out[f"{name}@{t}"] = [
            ("qkv", t, d, (h + 2 * g) * k),
            ("out", t, h * k, d),
            ("gate_up", t, d, 2 * f),
            ("down", t, f, d),
            ("head", t, d, llm.vocab),
        ]
    vit = s.vit
    t = s.vit_batch * vit.block_tokens
    d, f = vit.width, vit.mlp
    out[f"vit@{s.vit_batch}x{vit.block_tokens}"] = [
        ("qkv", t, d, 3 * d),
        ("out", t, d, d),
        ("fc1", t, d, f),
        ("fc2", t, f, d),
    ]
    return out


def roofline_section(run: Run) -> dict:
    """The ceiling (``n^3``) and each stage's matmuls: TFLOP/s per shape and the
    FLOP-weighted rate of one of each (what a stage of perfect matmuls would reach)."""
    n, reps = run.sizes.roofline_n, run.sizes.matmul_reps
    out: dict[str, Any] = {"ceiling": {"shape": [n, n, n], "tflops_per_s": run.ceiling_tflops}}
    stages = list(stage_matmuls(run).items())
    for stage, shapes in stages[:1] if run.sizes.smoke else stages:
        if skip := run.over():
            out[stage] = skip
            continue
        rows, flops, seconds = {}, 0.0, 0.0
        for name, m, k, n_ in shapes:
            rate = matmul_tflops(m, k, n_, reps)
            rows[name] = {
                "shape": [m, k, n_],
                "tflops_per_s": rate,
                "of_ceiling": rate / run.ceiling_tflops,
            }
            flops += 2 * m * k * n_
            seconds += 2 * m * k * n_ / (rate * 1e12)
        out[stage] = {"matmuls": rows, "stage_tflops_per_s": flops / seconds / 1e12}
        out[stage]["of_ceiling"] = out[stage]["stage_tflops_per_s"] / run.ceiling_tflops
    return out


# -- attention --------------------------------------------------------------------------


def compare(run: Run, fn: Any, args: tuple, flops: float, fusable: bool = True) -> dict:
    """fwd+bwd of ``fn(q, k, v, kernel)`` with ``kernel="plain"`` and the fused kernel
    (``"cudnn"`` on a GPU; elsewhere ``"xla"``, the fused call's semantics in XLA, so the
    comparison runs on CPU too): times, TFLOP/s of ``flops`` (the pass's attention FLOPs,
    forward+backward), and the fused path's largest difference from the plain one,
    relative to the largest plain value, in the output and each input's gradient (bf16
    rounding is about 4e-3)."""
    import jax
    import jax.numpy as jnp

    from hetjax.ops.fused_attention import fused_attention_applies

    fused = "cudnn" if fused_attention_applies(args[0], args[1]) else "xla"
    kernels = ("plain", fused) if fusable else ("plain",)
    ct = jax.random.normal(jax.random.key(7), args[0].shape, jnp.float32)
    got, out = {}, {"shape": list(args[0].shape), "fused_kernel": fused}
    for kernel in kernels:

        def loss(q, k, v, kernel=kernel):
            o = fn(q, k, v, kernel)
            return jnp.sum(o.astype(jnp.float32) * ct), o

        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
        key = "plain" if kernel == "plain" else "fused"
        got[key], t = timed(step, args, run.sizes.attention_reps)
        out[f"{key}_fwd_bwd_s"] = t
        out[f"{key}_tflops_per_s"] = flops / t / 1e12
    if not fusable:
        out["fused_kernel"] = None
        return out
    out["plain_over_fused"] = out["plain_fwd_bwd_s"] / out["fused_fwd_bwd_s"]
    (grads_p, o_p), (grads_f, o_f) = got["plain"], got["fused"]
    for what, a, b in zip(("dq", "dk", "dv", "out"), (*grads_p, o_p), (*grads_f, o_f), strict=True):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        out[f"{what}_rel_diff"] = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
    return out


def replicas(fn: Any) -> Any:
    """``fn(q, k, v, kernel)`` under ``jax.vmap`` over 2 replicas of half the batch each
    (the executor's data-parallel replicas)."""
    import jax

    def vmapped(q, k, v, kernel):
        split = [x.reshape(2, x.shape[0] // 2, *x.shape[1:]) for x in (q, k, v)]
        return jax.vmap(lambda q, k, v: fn(q, k, v, kernel))(*split).reshape(q.shape)

    return vmapped


def attention_section(run: Run) -> dict:
    """Plain vs fused attention through the models' entry points
    (:func:`hetjax.ops.attention.attention`, :func:`~hetjax.ops.causal_attention`,
    :func:`~hetjax.ops.ring_attention`, each with its ``kernel=``) at the LLM's heads
    (``sizes.attention_llm``, ``sizes.attention_seq``, batch 1): causal (the kernel's own
    mask), causal from positions (a bias), packed rows (4 samples a row, positions
    restarting; cuDNN's packed layout), a ring block at cp=1 (the ring's per-rank kernel;
    the all-gather variant's, plain only); and CLIP's encoder attention (``vit_batch`` x 577)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    from hetjax.ops import causal_attention, ring_attention
    from hetjax.ops.attention import attention

    s = run.sizes
    c, l = s.attention_llm, s.attention_seq
    b, h, g, k = 1, c.heads, c.kv_heads, c.head_dim
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, l, h, k), jnp.bfloat16)
    qkv = (q, *(jax.random.normal(x, (b, l, g, k), jnp.bfloat16) for x in keys[1:]))
    pos = jnp.arange(l)
    seg = jnp.repeat(jnp.arange(4), l // 4)[None].repeat(b, 0)
    ppos = jnp.tile(jnp.arange(l // 4), 4)[None].repeat(b, 0)
    causal = 3 * 4 * b * h * k * l * l / 2  # fwd + bwd, half the square
    mesh = Mesh(np.array(run.devices[:1]).reshape(1, 1, 1, 1), ("dp", "ep", "cp", "tp"))

    def ring(impl):
        def fn(q, k, v, kernel):
            # zigzag at cp=1 is the identity order; the fused ring blocks need it
            zig = {"zigzag": True} if impl == "ring" else {}
            return ring_attention(
                q, k, v, pos, mesh=mesh, impl=impl, dense_at_cp1=False, kernel=kernel, **zig
            )

        return fn

    rows = {
        "causal": (lambda q, k, v, kern: attention(q, k, v, causal=True, kernel=kern), causal),
        "causal_bias": (lambda q, k, v, kern: causal_attention(q, k, v, pos, kernel=kern), causal),
        "packed": (
            lambda q, k, v, kern: causal_attention(
                q, k, v, ppos, segment_ids=seg, kernel=kern, max_segments=4
            ),
            causal / 4,
        ),
        "ring_block": (ring("ring"), causal),
    }
    out: dict[str, Any] = {"shape": {"batch": b, "seq": l, "heads": h, "kv_heads": g, "dim": k}}
    for name, (fn, flops) in rows.items():
        out[name] = run.over() or guarded(compare, run, fn, qkv, flops)
    # The executor runs every stage program under jax.vmap over its data-parallel
    # replicas: the fused calls' own batching (hetjax.ops.vmap_fold) on 2 replicas of
    # one row each, the packed rows' segment ids closed over (unmapped).
    two = tuple(jnp.concatenate([x, x[:, ::-1]]) for x in qkv)
    for name in ("causal", "packed"):
        fn, flops = rows[name]
        out[f"{name}_vmap2"] = run.over() or guarded(compare, run, replicas(fn), two, 2 * flops)
    # the all-gather ring has no fused kernel: its plain time against the ring's
    out["allgather_block"] = run.over() or guarded(
        compare, run, ring("allgather"), qkv, causal, False
    )
    e = s.vit
    n, ek = e.block_tokens, jax.random.split(jax.random.key(1), 3)
    enc = tuple(
        jax.random.normal(x, (s.vit_batch, n, e.heads, e.width // e.heads), jnp.bfloat16)
        for x in ek
    )
    enc_flops = 3 * 4 * s.vit_batch * e.width * n * n
    out["encoder"] = run.over() or guarded(
        compare,
        run,
        lambda q, k, v, kern: attention(q, k, v, causal=False, kernel=kern),
        enc,
        enc_flops,
    )
    return out
