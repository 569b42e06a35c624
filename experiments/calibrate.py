"""Fit a hardware profile from measured runs: ``python -m experiments.calibrate``.

    python -m experiments.calibrate [--devices 8] [--write] [--json out.json]
    python -m experiments.calibrate --gpu-record experiments/results/gpu_check_h200.json [--write]

CPU (the default): times small programs on the simulated devices, all of them at once
(they share the host's cores, as in training), the fastest of the calls timed in the
rounds of the executor rows below, the programs in turn (:class:`Probes`):

- stacks of ``LAYERS`` transformer-like MLP blocks (``h + gelu(h W1) W2``, ``h`` of
  ``[T, D]`` rows per device, ``W1`` of ``[D, F]``), scanned (``lax.scan``) as a stage
  scans its blocks, their forward a ``jax.vjp`` program that returns the residuals and
  their backward a second program that applies them, as the engine's stage programs do
  (:mod:`hetjax.runtime.vjp`), at the per-device shapes ``BLOCKS`` of the ``tiny`` and
  ``small`` presets' stages and their TP shards: less the element-wise bytes the cost
  model prices for them, ``R n / (n + k)`` (:func:`hetjax.plan.calibrate.fit_matmul`,
  ``n = min(T, D, F)`` as :mod:`hetjax.plan.stage` reads it) gives ``peak_tflops`` and
  ``matmul_knee``;
- plain attention's forward (a vjp program) and backward at ``ATTENTION`` (the tiny
  LLM's and ViT's and the small LLM's, each at two sample counts): less its matmuls at
  the curve, the passes over its score matrix at the memory rate give ``score_passes``
  (:func:`score_passes`: the softmax's exp and the mask cost more than its bytes);
- the models' own blocks (``MODEL_BLOCKS``: ``LAYERS`` blocks of the tiny, tiny-moe and
  small presets' ViT and LLM as their ``StagedModule`` runs them, norms, RoPE,
  projections, SwiGLU or GELU and routed experts included), each at two sample counts:
  less their matmuls and score passes as priced above and a fixed cost per program
  pair of each kind, the rest gives ``elementwise_scale`` (what their element-wise work
  costs over its bytes at the memory rate) and ``moe_buffer_passes`` (passes over an MoE
  layer's dispatch buffers) (:func:`block_terms`; the curve, which leaves the MLP
  blocks' element-wise bytes to that scale, is fitted again with it, a few rounds);
- an element-wise ``x * a + b`` at ``SIZES`` elements per device: the line through
  (bytes read and written, seconds) gives ``hbm_tbps``;
- an all-reduce over every device at ``SIZES``: the line through (bytes each device
  sends, seconds) gives the link bandwidth (both lines fitted on relative error, so the
  small buffers a tiny model moves count);
- ``CHAIN`` all-reduces of 4 KB over device pairs (TP's group) one after the other in
  one program: the time per all-reduce gives ``latency_us``, the cost of a collective
  as a stage program issues it (XLA:CPU's rendezvous of the devices' threads; a
  program of one collective also pays its set-up, ~100 us more here, which is not per
  collective);
- the executor itself on a model of negligible compute (``tiny`` shrunk), in four
  layouts (``DISPATCH_ROWS``: non-colocated vision ``dp=4`` | LLM ``pp=4`` in 4
  microbatches, many calls on one device each; colocated ``dp=8`` in one, few calls on 8
  devices each; islands 4 + 4 with the LLM ``dp=4`` in 2, and the same with ``fsdp=4``):
  what the rest of the profile does not explain of the steps without fsdp gives
  ``dispatch_us`` (per host call the planner counts) and ``launch_us`` (per block, pass
  and device), then what it does not explain of the fsdp row's step beyond its twin's
  gives ``fsdp_call_us`` (per fsdp collective, which the engine chains on CPU: 49 per
  microbatch there).

GPU: fits ``matmul_efficiency`` and ``memory_efficiency`` of the built-in H200 so that
the cost model prices the ``gpu_check`` record's stage rows as measured (the LLM's loss
stage and the ViT stage, policy ``none``; they ran plain attention: the record predates
the fused kernel) and its plain attention row (:func:`hetjax.plan.calibrate.fit_efficiencies`),
and ``fused_attention_efficiency`` from the record's fused attention time. The H100
profile is the H200's with the H100's memory (80 GiB, 3.35 TB/s HBM3); its compute
(989 TFLOP/s BF16) and links are the same, so only memory-bound work slows, by 4.8 / 3.35.

``--write`` writes ``hetjax/plan/profiles/<name>.json`` (what
:func:`hetjax.plan.get_profile` loads), with what it was fitted on: machine, date, jax
version, devices and the points.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import math
import os
import platform
import time
from typing import Any

# Per-device (rows T, width D, MLP width F) of the blocks the matmul curve is fitted on:
# the tiny and small presets' stages as validate_plan runs them (tiny: ViT T 16-32, D 32,
# F 64; LLM T 128-256, D 64, F 128; small: ViT T 64-128, D 384, F 1536; LLM T 256, D 512,
# F 1536), their TP=2 shards (F / 2), and two between them.
BLOCKS = (
    (16, 32, 64),
    (32, 32, 64),
    (32, 32, 32),
    (128, 64, 128),
    (256, 64, 128),
    (128, 64, 64),
    (256, 64, 64),
    (256, 128, 512),
    (256, 256, 1024),
    (64, 384, 1536),
    (128, 384, 768),
    (64, 384, 768),
    (256, 512, 1536),
    (256, 512, 768),
)
LAYERS = 2  # blocks per scanned stack
# Plain attention per device (samples B, length L, heads H, kv heads G, head_dim K,
# causal), each at two sample counts (the slope is the kernel's, the rest a fixed cost
# per program): the tiny LLM's and ViT's and the small LLM's.
ATTENTION = tuple(
    (b * scale, l, h, g, k, causal)
    for b, l, h, g, k, causal in (
        (2, 64, 8, 4, 8, True),
        (4, 16, 4, 4, 8, False),
        (1, 128, 8, 4, 64, True),
    )
    for scale in (1, 4)
)
# The models' own blocks (their StagedModule: norms, RoPE, q/k/v/o projections, SwiGLU or
# GELU, routed experts), (preset, part, samples per device), each at two sample counts
# (the slope is the work, the rest a fixed cost per program): what they cost beyond the
# matmuls and score passes priced above gives elementwise_scale and moe_buffer_passes.
MODEL_BLOCKS = tuple(
    (preset, part, samples)
    for preset, part in (
        ("tiny", "vision"),
        ("tiny", "llm"),
        ("tiny-moe", "llm"),
        ("small", "vision"),
        ("small", "llm"),
    )
    for samples in ((1, 2) if preset == "small" else (1, 4))
)
BLOCK_TERMS = ("elementwise", "moe", "moe_launch", "weights")  # block_terms fits these
# float32 elements per device: from a tiny preset's activations (2**12-2**14) up
SIZES = (2**10, 2**13, 2**16, 2**19, 2**22)
PROBE_S = 0.2  # seconds a timed probe call lasts at least (back-to-back runs)
CHAIN = (1, 33)  # all-reduces over device pairs in one program (TP's group), 4 KB each
HBM_RATIO = 3.35 / 4.8  # H100 / H200 memory bandwidth (TB/s)


@dataclasses.dataclass(frozen=True)
class CalibrateConfig:
    devices: int = 8  # simulated CPU devices
    gpu_record: str | None = None  # fit h200 / h100 from this gpu_check record instead
    write: bool = False  # write hetjax/plan/profiles/<name>.json
    json: str | None = None  # write the points and the fit


class Probes:
    """The calibration's programs on ``devices`` (all at once: they share the host's cores,
    as in training), compiled and warm, each call's time kept.

    :meth:`time_once` times one call of each, in turn; ``experiments.validate_plan`` calls
    it once per round of its rows, so the programs and the rows are timed in the same
    minutes of the shared machine. :meth:`points` takes the fastest call of each: other
    work only ever adds time to a call (it takes cores, caches and memory bandwidth; it
    never lends them). A timed "call" repeats the program back to back for at least
    ``call_s`` seconds (the time per run kept): the fastest of a few 1 ms calls finds a
    quiet moment of a loaded machine that the fastest of a few steps of 0.1-5 s does not,
    and the two are compared."""

    def __init__(self, devices: list, call_s: float = PROBE_S):
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        n = self.n = len(devices)
        mesh = Mesh(np.asarray(devices), ("d",))
        put = lambda shape: jax.device_put(jnp.ones(shape), NamedSharding(mesh, P("d")))  # noqa: E731
        # a stack of blocks, as a stage runs it: the forward program is the vjp (output and
        # residuals), the backward program applies it to the output's cotangent
        forward = jax.jit(lambda x, w: jax.vjp(_blocks, x, w))
        backward = jax.jit(lambda vjp, g: vjp(g))
        self.programs = []
        for t, d, f in BLOCKS:
            layers = NamedSharding(mesh, P(None, "d"))
            w = [jax.device_put(jnp.full((LAYERS, n, *s), 0.01), layers) for s in ((d, f), (f, d))]
            x = put((n, t, d))
            y, vjp = forward(x, w)
            self.programs += [(forward, (x, w)), (backward, (vjp, y))]
        for b, l, h, g, k, causal in ATTENTION:
            q, kv = put((n, b, l, h, k)), put((n, b, l, g, k))
            attend = jax.jit(functools.partial(_attention_vjp, causal))
            y, vjp = attend(q, kv, kv)
            self.programs += [(attend, (q, kv, kv)), (backward, (vjp, y))]
        for preset, part, samples in MODEL_BLOCKS:
            params, x, stack = _model_stack(preset, part, samples, mesh)
            y, vjp = stack(params, x)
            self.programs += [(stack, (params, x)), (backward, (vjp, y))]
        axpy = jax.jit(lambda x: x * 1.5 + 0.5)
        total = jax.jit(
            jax.shard_map(
                lambda x: jax.lax.psum(x, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")
            )
        )
        xs = [put((n, size)) for size in SIZES]
        self.programs += [(axpy, (x,)) for x in xs] + [(total, (x,)) for x in xs]
        pairs = Mesh(np.asarray(devices).reshape(-1, 2), ("a", "t"))
        lanes = NamedSharding(pairs, P(("a", "t")))
        for k in CHAIN:
            chain = functools.partial(_chain, k)
            spec = P(("a", "t"))
            prog = jax.jit(jax.shard_map(chain, mesh=pairs, in_specs=spec, out_specs=spec))
            self.programs.append((prog, (jax.device_put(jnp.ones((n, 2**10)), lanes),)))
        self.repeats = []
        for f, args in self.programs:
            jax.block_until_ready(f(*args))
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            self.repeats.append(max(1, math.ceil(call_s / (time.perf_counter() - t0))))
        self.times: list[list[float]] = [[] for _ in self.programs]

    @property
    def rounds(self) -> int:
        return len(self.times[0])

    def time_once(self) -> None:
        """Times one call of each program, in turn."""
        import jax

        for (f, args), reps, out in zip(self.programs, self.repeats, self.times, strict=True):
            t0 = time.perf_counter()
            for _ in range(reps):
                jax.block_until_ready(f(*args))
            out.append((time.perf_counter() - t0) / reps)

    def points(self, start: int = 0) -> dict[str, list]:
        """Per device: block ``(T, D, F, matmul flops, element-wise bytes, s)`` (forward
        and backward together, fwd + bwd: :func:`block_point`), element-wise ``(bytes,
        s)`` and all-reduce ``(bytes sent, s)`` points, each program's time the fastest
        call of the rounds from ``start`` on."""
        t = [min(x[start:]) for x in self.times]
        fb = [a + b for a, b in zip(t[0::2], t[1::2], strict=False)]  # forward + backward
        nb, na, nm = len(BLOCKS), len(ATTENTION), len(MODEL_BLOCKS)
        k, n, s = 2 * (nb + na + nm), self.n, len(SIZES)
        return {
            "blocks": [block_point(shape, x) for shape, x in zip(BLOCKS, fb[:nb], strict=True)],
            "attention": [
                (*shape[:5], x) for shape, x in zip(ATTENTION, fb[nb : nb + na], strict=True)
            ],
            "model_blocks": [
                (*b, x) for b, x in zip(MODEL_BLOCKS, fb[nb + na : nb + na + nm], strict=True)
            ],
            "elementwise": [
                (2.0 * 4 * size, x) for size, x in zip(SIZES, t[k : k + s], strict=True)
            ],
            "all_reduce": [
                (2.0 * (n - 1) / n * 4 * size, x)
                for size, x in zip(SIZES, t[k + s : k + 2 * s], strict=True)
            ],
            "chained_all_reduces": [
                (float(c), x) for c, x in zip(CHAIN, t[k + 2 * s :], strict=True)
            ],
        }


def _blocks(x: Any, w: list) -> Any:
    """``LAYERS`` MLP blocks ``h + gelu(h W1) W2`` over ``lax.scan``, per device (``d``)."""
    import jax
    import jax.numpy as jnp

    def block(h: Any, ws: Any) -> tuple:
        up, down = ws
        u = jax.nn.gelu(jnp.einsum("dtw,dwf->dtf", h, up))
        return h + jnp.einsum("dtf,dfw->dtw", u, down), None

    return jax.lax.scan(block, x, tuple(w))[0]


def _attention_vjp(causal: bool, q: Any, k: Any, v: Any) -> tuple:
    """The forward program of plain attention per device (``d``): output and vjp."""
    import jax

    from hetjax.ops.attention import attention

    per_device = jax.vmap(lambda a, b, c: attention(a, b, c, causal=causal, kernel="plain"))
    return jax.vjp(per_device, q, k, v)


def _model_stack(preset: str, part: str, samples: int, mesh: Any) -> tuple:
    """``LAYERS`` blocks of ``part`` (``llm`` or ``vision``) of ``preset`` as the models
    build them (their own ``StagedModule.apply_blocks``), per device (``d``, weights
    per device as a replica's gradients are): the stacked parameters, ``samples``
    samples of input and the forward program (a vjp, as :class:`Probes`' blocks)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from models.config import get_preset
    from models.encoders import make_encoder
    from models.llm import make_llm

    cfg = get_preset(preset)
    if part == "llm":
        module = make_llm(dataclasses.replace(cfg.llm, depth=LAYERS), {"image": 0})
        tokens, width = cfg.seq_len, cfg.llm.width
    else:
        module = make_encoder("vision", dataclasses.replace(cfg.vision, depth=LAYERS))
        tokens, width = cfg.vision.block_tokens, cfg.vision.width
    n, split = mesh.size, NamedSharding(mesh, P("d"))
    per = lambda a: jax.device_put(jnp.broadcast_to(a, (n, *a.shape)), split)  # noqa: E731
    params = jax.tree.map(per, module.init(jax.random.key(0))["blocks"])
    x = jax.random.normal(jax.random.key(1), (n, samples, tokens, width))
    per_device = jax.vmap(lambda p, h: module.apply_blocks(p, h))
    return params, jax.device_put(x, split), jax.jit(lambda p, h: jax.vjp(per_device, p, h))


def model_block_parts(hw: Any, preset: str, part: str, samples: int) -> dict[str, float]:
    """Seconds ``hw``'s cost model prices for a :data:`MODEL_BLOCKS` stack, forward and
    backward on one device without launch costs, by term: ``compute`` (weight and
    attention matmuls), ``scores`` (plain attention's score passes), ``elementwise``
    (the blocks' element-wise bytes at ``elementwise_scale`` 1), ``moe`` (one pass over
    the MoE dispatch buffers), ``moe_launch`` (1 us per MoE block and pass) and
    ``weights`` (one pass over a trained stage's block weights per backward)."""
    from hetjax import Layout
    from hetjax.plan import ModulePlan
    from hetjax.plan.parts import encoder_shape, llm_shape
    from hetjax.plan.stage import module_stages
    from models.config import get_preset

    cfg = get_preset(preset)
    shape = llm_shape(cfg, cfg.seq_len, True) if part == "llm" else encoder_shape(cfg)
    shape = dataclasses.replace(shape, depth=LAYERS, first_flops=0.0, last_flops=0.0)
    zero = dict(launch_us=0.0, moe_launch_us=0.0, score_passes=0.0, weight_passes=0.0)
    zero |= dict(elementwise_scale=0.0, moe_buffer_passes=0.0)

    def price(**fields: float) -> float:
        h = dataclasses.replace(hw, **{**zero, **fields})
        plan = ModulePlan(Layout())
        st = module_stages(
            shape, plan, samples=samples, microbatches=1, live=[1], hw=h, act_bytes=4
        )
        return st[0].forward_s + st[0].backward_s

    compute = price()
    return {
        "compute": compute,
        "scores": price(score_passes=hw.score_passes) - compute,
        "elementwise": price(elementwise_scale=1.0) - compute,
        "moe": price(moe_buffer_passes=1.0) - compute,
        "moe_launch": price(moe_launch_us=1.0) - compute,
        "weights": price(weight_passes=1.0) - compute,
    }


def block_terms(hw: Any, points: list, fit: tuple = BLOCK_TERMS) -> tuple[dict, list[dict]]:
    """What :data:`MODEL_BLOCKS` points ``(preset, part, samples, seconds)`` (forward +
    backward) cost beyond ``hw``'s price, as coefficients of its terms
    (:func:`model_block_parts`): each point's time is a fixed cost per program pair
    plus each term of ``fit`` times its coefficient (``elementwise``:
    ``elementwise_scale``; ``moe``: ``moe_buffer_passes``; ``moe_launch``:
    ``moe_launch_us``; ``weights``: ``weight_passes``; ``compute``: a factor on the
    matmuls' time) and the other terms as priced; non-negative least squares on
    relative error. Returns the coefficients (every term; where not fitted, as priced:
    1 for ``compute``, ``scores`` and ``elementwise``, else 0) and per point what it was
    priced at."""
    import numpy as np
    from scipy.optimize import nnls

    parts = [model_block_parts(hw, p, q, n) for p, q, n, _ in points]
    t = np.asarray([x[-1] for x in points])
    a = np.asarray([[1.0] + [c[term] for term in fit] for c in parts])
    coef: dict = dict.fromkeys(parts[0], 0.0) | dict(compute=1.0, scores=1.0, elementwise=1.0)
    rest = np.asarray([sum(v * c[k] for k, v in coef.items() if k not in fit) for c in parts])
    x, _ = nnls(a / t[:, None], 1.0 - rest / t)
    coef.update({term: float(v) for term, v in zip(fit, x[1:], strict=True)})
    coef["fixed_s"] = float(x[0])
    rows = []
    for (p, q, n, seconds), c in zip(points, parts, strict=True):
        priced = sum(coef[k] * v for k, v in c.items())
        error = (priced + x[0]) / seconds - 1
        rows.append({"block": f"{p} {q} x{n}", "measured_s": seconds, "priced_s": priced, **c})
        rows[-1] |= {"fixed_s": float(x[0]), "error": float(error)}
    return coef, rows


def score_passes(hw: Any, points: list) -> float:
    """``score_passes`` of ``hw`` from plain attention ``(B, L, H, G, K, seconds)``
    points (forward + backward): their QK^T and PV priced by ``hw``'s curve at ``K``
    (:func:`hetjax.plan.stage.attention_kernel`), the rest a fixed cost per program plus
    passes over the ``B H L^2`` float32 scores at ``hw``'s memory rate (the forward one
    pass each, the backward two), by least squares on relative error."""
    import numpy as np

    from hetjax.plan.stage import attention_kernel

    rows, rhs = [], []
    for b, l, h, _, k, seconds in points:
        rate, _ = attention_kernel(hw, 4, k, b * l)
        matmuls = 3 * 4.0 * b * l * l * h * k / rate
        one_pass = hw.memory_seconds(3 * b * h * l * l * 4.0)
        rows.append([2.0 / seconds, one_pass / seconds])  # two programs' fixed cost
        rhs.append(1.0 - matmuls / seconds)
    (_, passes), *_ = np.linalg.lstsq(np.asarray(rows), np.asarray(rhs), rcond=None)
    return max(float(passes), 0.0)


def block_point(shape: tuple, seconds: float) -> tuple:
    """``(T, D, F, flops, bytes, seconds)`` of a block stack's forward and backward per
    device: its matmul FLOPs (3 x the forward's ``2 x 2 T D F`` per block) and the
    element-wise bytes the cost model prices for it (:func:`hetjax.plan.stage
    .elementwise_elements`' terms: the residual add ``3 D`` and GELU ``2 F`` elements
    per token, float32; the backward twice the forward's)."""
    t, d, f = shape
    flops = 3 * LAYERS * 4.0 * t * d * f
    nbytes = 3 * LAYERS * t * (3 * d + 2 * f) * 4.0
    return (float(t), float(d), float(f), flops, nbytes, seconds)


def matmul_points(blocks: list, bytes_per_s: float, scale: float = 1.0) -> list:
    """``(n, flops, seconds)`` of the block points for the matmul curve: ``n = min(T, D,
    F)`` (the smallest per-device dimension, as the cost model reads it) and the seconds
    less the element-wise bytes at ``bytes_per_s`` (priced apart by the cost model, at
    ``scale`` times their bytes: ``elementwise_scale``)."""
    return [
        (min(t, d, f), flops, s - scale * nbytes / bytes_per_s)
        for t, d, f, flops, nbytes, s in blocks
    ]


def _chain(k: int, x: Any) -> Any:
    """``k`` all-reduces over the ``t`` axis, each on the last one's result."""
    import jax

    for _ in range(k):
        x = jax.lax.psum(x, "t") * 0.5
    return x


DISPATCH_ROWS = (  # the executor on negligible compute: many 1-device calls, few 8-device
    ("nano islands pp4", "non-colocated", "dp=4", "pp=4", 4),  # ones; fsdp's chain beside
    ("nano colocated dp8", "colocated", "dp=8", "dp=8", 1),  # the same layout without it
    ("nano islands dp4", "non-colocated", "dp=4", "dp=4", 2),
    ("nano islands fsdp4", "non-colocated", "dp=4", "fsdp=4", 2),
)
HOST = ("dispatch_us", "launch_us")  # fitted on the dispatch rows without fsdp
FSDP_TWINS = ("nano islands fsdp4", "nano islands dp4")  # fsdp_call_us: the one beside the other


def dispatch_rows() -> tuple[list, dict]:
    """The ``DISPATCH_ROWS`` as :class:`experiments.validate_plan.Row` s and their model."""
    from experiments import validate_plan as vp
    from experiments.bench_executor import nano_preset

    rows = [vp.Row(name, "tiny", *rest) for name, *rest in DISPATCH_ROWS]
    nano = nano_preset(4)
    return rows, {row.name: nano for row in rows}


def host_costs(hw: Any, measured: list[dict]) -> tuple[dict, list]:
    """``dispatch_us``, ``launch_us`` and ``fsdp_call_us`` from the ``dispatch_rows``
    steps ``measured`` (:func:`experiments.validate_plan.measure_rows`): what ``hw``
    prices of the rows without fsdp without the first two, then those by least squares
    (at least 0); then, with them, what the fsdp row costs more than its twin without
    fsdp (the same layout with dp for fsdp, measured in the same rounds, so that their
    common costs and the machine's load cancel) beyond what ``hw`` prices of that
    difference, per fsdp collective (at least 0)."""
    import numpy as np

    from experiments import validate_plan as vp

    rows, models = dispatch_rows()
    zero = dataclasses.replace(hw, dispatch_us=0.0, launch_us=0.0, fsdp_call_us=0.0)
    price = lambda row, h: vp.predict(row, h, cfg=models[row.name])  # noqa: E731
    a, t, out = [], [], []
    for row, got in zip(rows, measured, strict=True):
        rest, calls = price(row, zero)
        out.append({"layout": row.name, **got, "planned_calls": calls})
        if "fsdp" not in row.llm:
            one = [price(row, dataclasses.replace(zero, **{k: 1.0}))[0] - rest for k in HOST]
            a.append(one)
            t.append(got["measured_step_s"] - rest)
    fits = dict(zip(HOST, _nonnegative_lstsq(np.asarray(a), np.asarray(t)), strict=True))
    base = dataclasses.replace(zero, **fits)
    by_name = {r.name: (r, g["measured_step_s"]) for r, g in zip(rows, measured, strict=True)}
    (row, got), (twin, twin_got) = (by_name[name] for name in FSDP_TWINS)
    priced = price(row, base)[0]
    per_call = price(row, dataclasses.replace(base, fsdp_call_us=1.0))[0] - priced
    extra = (got - twin_got) - (priced - price(twin, base)[0])
    return fits | {"fsdp_call_us": max(extra / per_call, 0.0)}, out


def _nonnegative_lstsq(a: Any, t: Any) -> tuple[float, ...]:
    """Least squares with every coefficient at least 0: the free solution if it is, else
    the best fit with one coefficient pinned at 0 (two unknowns)."""
    import numpy as np

    free, *_ = np.linalg.lstsq(a, t, rcond=None)
    if min(free) >= 0:
        return tuple(float(x) for x in free)
    best, out = np.inf, (0.0,) * a.shape[1]
    for j in range(a.shape[1]):
        col = a[:, j]
        x = max(float(col @ t / (col @ col)), 0.0)
        if (err := float(np.sum((t - x * col) ** 2))) < best:
            best, out = err, tuple(x if i == j else 0.0 for i in range(a.shape[1]))
    return out


def micro_profile(points: dict[str, list], devices: int) -> tuple[Any, dict]:
    """The CPU profile's rates from the :class:`Probes`' ``points`` on ``devices``
    (dispatch and launch not yet fitted), and the record of what it was fitted on."""
    import jax

    from hetjax.plan import get_profile
    from hetjax.plan.calibrate import fit_line, fit_matmul

    ew, ar = fit_line(points["elementwise"]), fit_line(points["all_reduce"])
    chain = fit_line(points["chained_all_reduces"])
    hw = dataclasses.replace(
        get_profile("cpu"),
        matmul_efficiency=1.0,
        hbm_tbps=ew.rate / 1e12,
        memory_efficiency=1.0,
        nvlink_gbps=ar.rate / 1e9,
        ib_gbps=ar.rate / 1e9,
        comm_efficiency=1.0,
        latency_us=1e6 / chain.rate,  # seconds per all-reduce issued inside a program
        gpus_per_node=devices,
        elementwise_scale=1.0,
        moe_buffer_passes=0.0,
        moe_launch_us=0.0,
        weight_passes=0.0,
    )
    # The curve leaves the MLP blocks' element-wise bytes to elementwise_scale, which the
    # models' blocks then fit given the curve: a few rounds of both (a fixed point).
    blocks, rows = points.get("model_blocks"), []
    for _ in range(4 if blocks else 1):
        points = {
            **points,
            "matmul": matmul_points(points["blocks"], ew.rate, hw.elementwise_scale),
        }
        mm = fit_matmul(points["matmul"])
        hw = dataclasses.replace(hw, peak_tflops=mm.tflops, matmul_knee=mm.knee)
        if points.get("attention"):
            hw = dataclasses.replace(hw, score_passes=score_passes(hw, points["attention"]))
        if blocks:
            coef, rows = block_terms(hw, blocks)
            hw = dataclasses.replace(
                hw,
                elementwise_scale=coef["elementwise"],
                moe_buffer_passes=coef["moe"],
                moe_launch_us=coef["moe_launch"],
                weight_passes=coef["weights"],
            )
    record = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "host_cores": os.cpu_count(),
        "date": _now(),
        "jax": jax.__version__,
        "devices": devices,
        "points": points,
        "worst_point_error": {
            "matmul": mm.max_rel_error,
            "elementwise": ew.max_rel_error,
            "all_reduce": ar.max_rel_error,
        },
        "model_blocks": rows,  # per model-block point: measured, priced by term, error
    }
    return hw, record


def with_host_costs(hw: Any, record: dict, measured: list[dict]) -> tuple[Any, dict]:
    """``hw`` with ``dispatch_us``, ``launch_us`` and ``fsdp_call_us`` fitted
    (:func:`host_costs`)."""
    fits, rows = host_costs(hw, measured)
    return dataclasses.replace(hw, **fits), {**record, "dispatch_rows": rows}


def cpu_profile(devices: list, steps: int = 10) -> tuple[Any, dict]:
    """The CPU profile fitted on ``devices`` now, and the record of what it was fitted on."""
    from experiments import validate_plan as vp

    probes = Probes(devices)
    rows, models = dispatch_rows()
    measured = vp.measure_rows(rows, devices, steps, models, probes)
    return with_host_costs(*micro_profile(probes.points(), len(devices)), measured)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def gpu_profiles(path: str) -> tuple[Any, Any, dict]:
    """The H200 profile fitted on a ``gpu_check`` record, the H100's derived from it, and
    per fitted program its ``predicted / measured - 1``."""
    import json

    from hetjax.plan import get_profile
    from hetjax.plan.calibrate import fit_efficiencies

    with open(path) as f:
        rec = json.load(f)
    if "H200" not in rec.get("device", ""):
        raise ValueError(f"{path} was measured on {rec.get('device')!r}; give an H200 record")
    fused_record = path.replace(".json", "_8192.json")
    with open(fused_record) as f:
        fused = json.load(f)["attention"]
    shape = fused["shape"]
    b, h, k, l = shape["batch"], shape["heads"], shape["dim"], shape["seq"]
    causal = 3 * 4 * b * h * k * l * l / 2  # fwd + bwd FLOPs, half the square
    h200 = get_profile("h200")
    eff = causal / fused["fused"]["fused_fwd_bwd_s"] / (h200.peak_tflops * 1e12)
    h200 = dataclasses.replace(h200, fused_attention_efficiency=eff)
    programs = {
        "llm_stage": (rec["llm_stage"]["none"]["stage_time_s"], _llm_price(rec["llm_stage"])),
        "vit_stage": (rec["vit_stage"]["none"]["stage_time_s"], _vit_price(rec["vit_stage"])),
        "plain_attention_8192": (fused["fused"]["plain_fwd_bwd_s"], _attention_price(shape)),
    }
    h200, errors = fit_efficiencies(h200, list(programs.values()))
    held_out = rec["vit_stage"]["full"]["stage_time_s"]
    full = _vit_price(rec["vit_stage"], "full")(h200) / held_out - 1
    h100 = dataclasses.replace(h200, name="h100", hbm_gib=80.0, hbm_tbps=h200.hbm_tbps * HBM_RATIO)
    fit = {name: err for name, err in zip(programs, errors, strict=True)}
    return h200, h100, {"fitted": fit, "held_out": {"vit_stage_full": full}}


def _plain(hw: Any) -> Any:
    return dataclasses.replace(hw, fused_attention_efficiency=0.0)


def _stage_price(shape: Any, samples: int, policy: str, vocab: int = 0) -> Any:
    from hetjax import Layout
    from hetjax.plan import ModulePlan
    from hetjax.plan.stage import module_stages

    def price(hw: Any) -> float:
        st = module_stages(
            shape,
            ModulePlan(Layout(), recompute=policy),
            samples=samples,
            microbatches=1,
            live=[1],
            hw=_plain(hw),
            vocab=vocab,
            fused_columns=False,
        )[0]
        calls = 1 if vocab else 2  # the loss stage's forward runs in its backward
        return st.forward_s + st.backward_s + calls * hw.dispatch_us * 1e-6

    return price


def _llm_price(section: dict) -> Any:
    from hetjax.plan.parts import llm_shape
    from models.config import PAPER_LLMS, PRESETS, MLLMConfig

    s = section["shape"]
    llm = dataclasses.replace(PAPER_LLMS["llm-14b"], depth=s["layers"])
    assert llm.width == s["width"], "the record's LLM is llm-14b"
    seq = s["tokens_per_sample"]
    cfg = MLLMConfig("gpu-check-llm", llm=llm, vision=PRESETS["tiny"].vision, seq_len=seq)
    return _stage_price(llm_shape(cfg, seq, True), s["batch"], "none", cfg.llm.vocab)


def _vit_price(section: dict, policy: str = "none") -> Any:
    from hetjax.plan.parts import encoder_shape
    from models.config import PRESETS, MLLMConfig

    vit = PRESETS["llava-1.5-7b"].vision
    assert vit.width == section["shape"]["width"], "the record's ViT is CLIP-L/336"
    cfg = MLLMConfig("gpu-check-vit", llm=PRESETS["tiny"].llm, vision=vit, seq_len=640)
    return _stage_price(encoder_shape(cfg), section["shape"]["batch"], policy)


def _attention_price(shape: dict) -> Any:
    """Plain attention fwd + bwd at the record's shape: the full square (XLA's attention
    computes the masked half), three passes' matmuls and score bytes (BF16)."""
    from hetjax.plan.stage import attention_kernel

    b, h, k, l = shape["batch"], shape["heads"], shape["dim"], shape["seq"]

    def price(hw: Any) -> float:
        rate, passes = attention_kernel(_plain(hw), 2, k, b * l)
        return 3 * (4 * b * h * k * l * l / rate + hw.memory_seconds(passes * b * h * l * l * 2))

    return price


def describe(hw: Any) -> str:
    """One line of a profile's fitted constants."""
    return (
        f"matmul {hw.peak_tflops * hw.matmul_efficiency * 1e3:.3g} GFLOP/s knee "
        f"{hw.matmul_knee:.0f}, memory {hw.hbm_tbps * hw.memory_efficiency * 1e3:.3g} GB/s, "
        f"link {hw.link_gbps(False):.3g} GB/s + {hw.latency_us:.0f} us, dispatch "
        f"{hw.dispatch_us:.0f} us per call, launch {hw.launch_us:.0f} us per block pass, "
        f"score passes {hw.score_passes:.3g}, element-wise x{hw.elementwise_scale:.3g}, MoE "
        f"buffer passes {hw.moe_buffer_passes:.3g} + {hw.moe_launch_us:.0f} us per block pass, "
        f"weight passes {hw.weight_passes:.3g}, fsdp {hw.fsdp_call_us:.0f} us per collective"
    )


def main(config: CalibrateConfig) -> dict:
    from experiments.cli import setup_devices, write_json
    from hetjax.plan.hardware import PROFILE_DIR, save_profile

    if config.gpu_record:
        h200, h100, errors = gpu_profiles(config.gpu_record)
        on = {
            "machine": "NVIDIA H200 (the record's device; h100: derived, see h100_hbm_ratio)",
            "devices": 1,
            "date": _now(),
            "jax": "the GPU machine's (the record does not say; DESIGN.md: 0.11.2)",
            "record": config.gpu_record,
            "errors": errors,
            "h100_hbm_ratio": HBM_RATIO,
        }
        for hw in (h200, h100):
            print(f"{hw.name}: {describe(hw)}, fused attention {hw.fused_attention_efficiency:.3f}")
        print(f"fitted programs, predicted / measured - 1: {errors}")
        profiles = {"h200": (h200, on), "h100": (h100, on)}
    else:
        hw, on = cpu_profile(setup_devices(config.devices))
        print(f"cpu: {describe(hw)}")
        print(f"worst point off its fit: {on['worst_point_error']}")
        profiles = {"cpu": (hw, on)}
    if config.write:
        for name, (hw, fitted_on) in profiles.items():
            save_profile(hw, os.path.join(PROFILE_DIR, f"{name}.json"), fitted_on)
    out = {
        name: {"profile": dataclasses.asdict(hw), "fitted_on": on}
        for name, (hw, on) in profiles.items()
    }
    write_json(config.json, out)
    return out


def parse_args(argv: list[str]) -> CalibrateConfig:
    from experiments.cli import OneLineParser, positive_int

    p = OneLineParser(prog="calibrate", description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=positive_int, default=8, help="simulated CPU devices")
    p.add_argument("--gpu-record", default=None, help="fit h200/h100 from a gpu_check record")
    p.add_argument("--write", action="store_true", help="write hetjax/plan/profiles/<name>.json")
    p.add_argument("--json", default=None, help="write the points and the fit")
    return CalibrateConfig(**vars(p.parse_args(argv)))


if __name__ == "__main__":
    from experiments.cli import run_cli
    from experiments.plan import one_line

    run_cli(one_line(main, parse_args), "calibrate")
