"""cuDNN's fused attention paths, checked on CPU.

Two halves. Values: every fused call's ``implementation="xla"`` twin (the kernel's exact
semantics in XLA maths: its causal mask, the packed layout's lengths and offsets, the
ring blocks merged by log-sum-exp) equals the plain path in FP32, values and gradients
(rtol 1e-5 / atol 1e-6, as the ring tests). Structure: with JAX's cuDNN presence and
compute-capability probes stubbed and the backend reported as a GPU, each entry point is
lowered for CUDA (lowering needs no GPU) and the cuDNN custom calls of the forward and
backward are read off the StableHLO: which kernel each case dispatches to, its mask type,
and that no bias operand is passed where the kernel's own mask applies.

Shape key: B batch, L sequence, H query heads, G kv heads, K head dim, M segments per row.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.cudnn import fused_attention_stablehlo as cudnn
from jax.sharding import NamedSharding, PartitionSpec

from hetjax.ops import causal_attention, ring_attention, zigzag_permutation
from hetjax.ops.attention import attention, self_attention
from hetjax.ops.fused_attention import bias_fused_applies, fused_attention_applies, packed_segments
from tests.ops.test_ring_attention import (
    assert_matches_reference,
    cotangent_weights,
    packed_rows,
    permuted,
    qkv,
    qkv_and_reference,
    stage_mesh,
    value_and_grads,
)


@pytest.fixture
def fake_gpu(monkeypatch):
    """The default backend reads as a GPU with cuDNN 9.10 on a Hopper card (the probes
    JAX's cuDNN wrapper runs at trace time); programs are then lowered for CUDA."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: True)
    monkeypatch.delenv("HETJAX_FUSED_ATTENTION", raising=False)


def bf16(*xs):
    return [x.astype(jnp.bfloat16) for x in xs]


def cudnn_calls(attn, q, k, v, replicas: int | None = None) -> list[tuple[str, int, str, int]]:
    """``(target, operand count, mask type, max segments per row)`` of every cuDNN custom
    call in ``attn``'s forward and backward, lowered for CUDA; with ``replicas``, the
    backward mapped over them as the executor maps it (``jax.vmap``), the cotangent of
    each replica's sum unmapped (an operand JAX's own cuDNN batching rules cannot take)."""

    def loss(q, k, v):
        return jnp.sum(attn(q, k, v).astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    if replicas is not None:
        grad = jax.vmap(grad)
        q, k, v = (x.reshape(replicas, x.shape[0] // replicas, *x.shape[1:]) for x in (q, k, v))
    text = jax.jit(grad).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    return cudnn_calls_in(text)


def cudnn_calls_in(text: str) -> list[tuple[str, int, str, int]]:
    """The :func:`cudnn_calls` tuples of a program's StableHLO text."""
    calls = []
    for m in re.finditer(
        r'custom_call @(__cudnn\$\w+)\(([^)]*)\)[^\n]*?backend_config = "([^"]*)"', text
    ):
        config = json.loads(m.group(3).replace("\\22", '"'))["cudnn_fmha_backend_config"]
        n = len(m.group(2).split(","))
        calls.append((m.group(1), n, config["mask_type"], int(config["max_seg_per_batch"])))
    return calls


FWD, BWD = "__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"
BIAS_FWD, BIAS_BWD = "__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"


# -- which kernel applies ---------------------------------------------------------------


def test_fused_attention_applies(fake_gpu, monkeypatch):
    q, k, _ = qkv(l=9, k=8)
    assert fused_attention_applies(*bf16(q, k))  # odd length: no bias, no limit
    assert fused_attention_applies(q.astype(jnp.float16), k.astype(jnp.float16))
    assert not bias_fused_applies(*bf16(q, k))  # a bias wants even lengths
    assert not fused_attention_applies(q, k)  # float32 keeps the plain maths
    q12, k12, _ = qkv(k=12)
    assert not fused_attention_applies(*bf16(q12, k12))  # head dim not a multiple of 8
    monkeypatch.setenv("HETJAX_FUSED_ATTENTION", "0")
    assert not fused_attention_applies(*bf16(q, k))
    monkeypatch.delenv("HETJAX_FUSED_ATTENTION")
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert not fused_attention_applies(*bf16(q, k))


# -- what each case lowers to on a GPU --------------------------------------------------


def _packed_seg(b=2, l=16):
    """Segment ids and positions of ``b`` packed rows (one replica's rows of two)."""
    seg, pos = packed_rows([[5, 7, 4], [9, 3]][:b], l)
    return jnp.asarray(seg), jnp.asarray(pos)


def _ring(**kw):
    mesh = stage_mesh(cp=2)
    pos = jnp.asarray(zigzag_permutation(16, 2))
    return lambda q, k, v: ring_attention(q, k, v, pos, mesh=mesh, batch_axes=("dp",), **kw)


@pytest.mark.parametrize(
    "case, attn, dtype, want",
    [
        (
            "decoder: the kernel's causal mask, q/k/v only",
            lambda q, k, v: self_attention(q, k, v, causal=True),
            jnp.bfloat16,
            [(FWD, 3, "CAUSAL", 1), (BWD, 6, "CAUSAL", 1)],
        ),
        (
            "encoder",
            lambda q, k, v: self_attention(q, k, v, causal=False),
            jnp.float16,
            [(FWD, 3, "NO_MASK", 1), (BWD, 6, "NO_MASK", 1)],
        ),
        (
            "packed rows, M=3: lengths and offsets, no bias",
            lambda q, k, v: self_attention(
                q,
                k,
                v,
                causal=True,
                positions=_packed_seg(len(q))[1],
                segment_ids=_packed_seg(len(q))[0],
                max_segments=3,
            ),
            jnp.bfloat16,
            [(FWD, 7, "PADDING_CAUSAL", 3), (BWD, 10, "PADDING_CAUSAL", 3)],
        ),
        (
            "packed rows, no bound: the mask as a bias",
            lambda q, k, v: self_attention(
                q,
                k,
                v,
                causal=True,
                positions=_packed_seg(len(q))[1],
                segment_ids=_packed_seg(len(q))[0],
            ),
            jnp.bfloat16,
            [(BIAS_FWD, 4, "NO_MASK", 1), (BIAS_BWD, 7, "NO_MASK", 1)],
        ),
        (
            "zigzag ring: causal diagonal, unmasked half-blocks (one per cond branch)",
            _ring(zigzag=True),
            jnp.bfloat16,
            [(FWD, 3, "CAUSAL", 1)]
            + [(FWD, 3, "NO_MASK", 1)] * 2
            + [(BWD, 6, "CAUSAL", 1)]
            + [(BWD, 6, "NO_MASK", 1)] * 2,
        ),
        (
            "encoder ring",
            lambda q, k, v: ring_attention(
                q, k, v, None, mesh=stage_mesh(cp=2), batch_axes=("dp",), causal=False
            ),
            jnp.bfloat16,
            [(FWD, 3, "NO_MASK", 1)] * 2 + [(BWD, 6, "NO_MASK", 1)] * 2,
        ),
        (
            "ring of packed rows: plain blocks",
            lambda q, k, v: _ring(zigzag=True, segment_ids=_packed_seg(len(q))[0])(q, k, v),
            jnp.bfloat16,
            [],
        ),
        ("float32: plain", lambda q, k, v: self_attention(q, k, v, causal=True), jnp.float32, []),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
@pytest.mark.parametrize("replicas", [None, 2], ids=["", "under the replica vmap"])
def test_cuda_lowering(fake_gpu, case, attn, dtype, want, replicas):
    """One kernel call per attention, mapped over replicas or not (the mapped axis is
    folded into the batch: :mod:`hetjax.ops.vmap_fold`)."""
    q, k, v = (x.astype(dtype) for x in qkv())
    assert sorted(cudnn_calls(attn, q, k, v, replicas)) == sorted(want), case


@pytest.mark.parametrize("replicas", [None, 2])
@pytest.mark.parametrize("causal, mask", [(False, "PADDING"), (True, "PADDING_CAUSAL")])
def test_odd_length_is_fused_with_a_padding_mask(fake_gpu, causal, mask, replicas):
    """CLIP ViT-L/14-336's 577 tokens: one padding token, kept out by cuDNN's padding mask
    (the sequence lengths are the two operands after q/k/v), no bias."""
    q, k, v = bf16(*qkv(b=2, l=577, h=2, g=2))
    attn = lambda q, k, v: self_attention(q, k, v, causal=causal)
    assert cudnn_calls(attn, q, k, v, replicas) == [(FWD, 5, mask, 1), (BWD, 8, mask, 1)]


def test_fusion_switched_off(fake_gpu, monkeypatch):
    monkeypatch.setenv("HETJAX_FUSED_ATTENTION", "0")
    q, k, v = bf16(*qkv())
    assert cudnn_calls(lambda q, k, v: self_attention(q, k, v, causal=True), q, k, v) == []


# -- the fused calls' semantics equal the plain path (FP32, CPU) ------------------------


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("l, heads", [(16, (4, 2)), (9, (4, 4))])
def test_fused_attention_matches_plain(causal, l, heads):
    q, k, v = qkv(l=l, h=heads[0], g=heads[1], seed=2)
    want = value_and_grads(lambda q, k, v: attention(q, k, v, causal=causal, kernel="plain"))
    fused = lambda q, k, v: attention(q, k, v, causal=causal, kernel="xla")
    assert_matches_reference(fused, q, k, v, want(q, k, v))


def test_packed_segments_layout():
    seg, _ = packed_rows([[5, 7, 4], [9, 3]], 16)  # row 2 ends in 4 padding tokens
    lengths, offsets = packed_segments(jnp.asarray(seg), 4)
    np.testing.assert_array_equal(lengths, [[5, 7, 4, -1], [9, 3, 4, -1]])
    np.testing.assert_array_equal(offsets, [[0, 5, 12, -1, -1], [0, 9, 12, -1, -1]])


@pytest.mark.parametrize("max_segments", [3, 5])
def test_packed_fused_attention_matches_plain(max_segments):
    """Rows covered by their samples (the padding's positions would restart at 0)."""
    q, k, v = qkv(seed=5)
    seg, pos = (jnp.asarray(a) for a in packed_rows([[5, 7, 4], [9, 3, 4]], q.shape[1]))
    plain = lambda q, k, v: causal_attention(q, k, v, pos, segment_ids=seg, kernel="plain")
    fused = lambda q, k, v: causal_attention(
        q, k, v, pos, segment_ids=seg, kernel="xla", max_segments=max_segments
    )
    assert_matches_reference(fused, q, k, v, value_and_grads(plain)(q, k, v))


@pytest.mark.parametrize("packed", [False, True], ids=["positions", "packed"])
def test_bias_fallback_takes_the_same_mask(packed):
    """Where no mask type of the kernel fits (arbitrary positions; packed rows without a
    bound) the mask goes in as a bias: same values and gradients as the plain path."""
    q, k, v = qkv(seed=5)
    if packed:
        seg, pos = (jnp.asarray(a) for a in packed_rows([[5, 7, 4], [9, 3]], q.shape[1]))
    else:
        seg, pos = None, jnp.asarray(np.random.default_rng(3).permutation(q.shape[1]))
    run = lambda kernel: (
        lambda q, k, v: causal_attention(q, k, v, pos, segment_ids=seg, kernel=kernel)
    )
    assert_matches_reference(run("xla"), q, k, v, value_and_grads(run("plain"))(q, k, v))


def _rows_grads(attn):
    """``(out, d(sum(sin(out) * w))/d(q, k, v))`` of ``attn(q, k, v, *per_row)``."""

    def f(q, k, v, *per_row):
        out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, *per_row), q, k, v)
        return out, vjp(jnp.cos(out) * cotangent_weights(out.shape))

    return f


_SEG4, _POS4 = (jnp.asarray(a) for a in packed_rows([[5, 7, 4], [9, 3], [16], [2, 14]], 16))


@pytest.mark.parametrize("lead", [(1,), (2,), (2, 2)], ids=["1 replica", "2", "2x2 nested"])
@pytest.mark.parametrize(
    "attn, l, per_row",
    [
        (lambda q, k, v: attention(q, k, v, causal=True, kernel="xla"), 16, ()),
        (lambda q, k, v: attention(q, k, v, causal=False, kernel="xla"), 9, ()),
        (
            lambda q, k, v, s, p: causal_attention(
                q, k, v, p, segment_ids=s, kernel="xla", max_segments=3
            ),
            16,
            (_SEG4, _POS4),
        ),
        (
            lambda q, k, v, s, p: causal_attention(q, k, v, p, segment_ids=s, kernel="xla"),
            16,
            (_SEG4, _POS4),
        ),
    ],
    ids=["causal", "encoder, odd length", "packed", "bias"],
)
def test_fused_calls_under_the_replica_vmap_equal_each_replica(attn, l, per_row, lead):
    """The fused calls' twins (float32) folded under ``jax.vmap`` over replicas (nested
    too): each replica's values and gradients are those of the call on its rows alone."""
    q, k, v = qkv(b=4, l=l, seed=3)
    args = (q, k, v, *per_row)
    split = lambda x: x.reshape(*lead, 4 // np.prod(lead), *x.shape[1:])
    f = _rows_grads(attn)
    mapped = f
    for _ in lead:
        mapped = jax.vmap(mapped)
    got = jax.jit(mapped)(*map(split, args))
    rows = 4 // np.prod(lead)
    each = [jax.jit(f)(*(x[i : i + rows] for x in args)) for i in range(0, 4, rows)]
    want = jax.tree.map(lambda *xs: split(jnp.concatenate(xs)), *each)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_packed_kernel_under_gspmd_gets_its_devices_rows(fake_gpu, monkeypatch):
    """The executor's replica map under GSPMD (``vmap(spmd_axis_name="dp")``, replicas
    split over dp): cuDNN's custom partitioner hands each device its own rows' segment
    lengths with its queries. The kernel's implementation is replaced by XLA maths that
    writes each query row's sum of segment lengths (``L`` where the lengths are the row's
    own), so the partitioned program compiles and runs on CPU."""
    seen = []

    def row_tokens(q, lengths_BxM):  # -1 marks no segment
        tokens_B = jnp.sum(jnp.maximum(lengths_BxM, 0), 1).astype(q.dtype)
        return jnp.broadcast_to(tokens_B[:, None, None, None], q.shape)

    def fwd(q, k, v, bias, lengths, kv_lengths, *rest, is_training, **params):
        seen.append((q.shape[0], lengths.shape[0]))
        out = row_tokens(q, lengths)
        b, l, h, _ = q.shape
        return [out, jnp.zeros((lengths.size, h, l), jnp.float32)][: 1 + is_training]

    def bwd(q, k, v, bias, lengths, *rest, **params):
        return [row_tokens(q, lengths), jnp.zeros_like(k), jnp.zeros_like(v)]

    monkeypatch.setattr(cudnn, "_dot_product_attention_fwd_impl", fwd)
    monkeypatch.setattr(cudnn, "_dot_product_attention_bwd_impl", bwd)
    q, k, v = bf16(*qkv(b=4))
    seg, pos = _SEG4, _POS4

    def replica(q, k, v, seg, pos):
        attn = lambda q: causal_attention(q, k, v, pos, segment_ids=seg, max_segments=3)
        out, vjp = jax.vjp(attn, q)
        return out, vjp(out)[0]

    mesh = stage_mesh(dp=2)
    split = NamedSharding(mesh, PartitionSpec("dp"))
    args = [jax.device_put(x.reshape(2, 2, *x.shape[1:]), split) for x in (q, k, v, seg, pos)]
    out, dq = jax.jit(jax.vmap(replica, spmd_axis_name="dp"))(*args)
    assert seen == [(2, 2)]  # two devices of two rows, each with its two rows' lengths
    np.testing.assert_array_equal(out, jnp.full(out.shape, 16.0))
    np.testing.assert_array_equal(dq, jnp.full(dq.shape, 16.0))


@pytest.mark.parametrize(
    "layout, heads",
    [
        (dict(cp=4), (4, 2)),
        (dict(dp=2, cp=2, tp=2), (4, 2)),
        (dict(cp=2, tp=2), (4, 1)),  # G < tp: kv heads repeated
    ],
    ids=str,
)
def test_fused_ring_matches_reference(layout, heads):
    """Fused blocks merged by log-sum-exp, zigzag half-blocks, backward from the merged
    statistics: the plain single-device attention's values and gradients."""
    h, g = heads
    q, k, v, want = qkv_and_reference(h=h, g=g)
    perm = zigzag_permutation(q.shape[1], layout["cp"])
    f = permuted(perm, mesh=stage_mesh(**layout), zigzag=True, kernel="xla")
    assert_matches_reference(f, q, k, v, want)


def test_fused_encoder_ring_matches_bidirectional_attention():
    q, k, v = qkv(seed=11)
    want = value_and_grads(lambda q, k, v: attention(q, k, v, causal=False))(q, k, v)
    mesh = stage_mesh(dp=2, cp=4)
    f = lambda q, k, v: ring_attention(
        q, k, v, None, mesh=mesh, causal=False, batch_axes=("dp",), kernel="xla"
    )
    assert_matches_reference(f, q, k, v, want)


def test_fused_ring_one_rank():
    """``dense_at_cp1=False`` runs the fused diagonal block alone (what gpu_check times)."""
    q, k, v, want = qkv_and_reference()
    perm = np.arange(q.shape[1])
    f = permuted(perm, mesh=stage_mesh(dp=2), zigzag=True, kernel="xla", dense_at_cp1=False)
    assert_matches_reference(f, q, k, v, want)


def test_fused_ring_refuses_masks_it_cannot_take():
    q, k, v = qkv()
    mesh, pos = stage_mesh(cp=2), jnp.arange(16)
    with pytest.raises(ValueError, match="zigzag=True or causal=False"):
        ring_attention(q, k, v, pos, mesh=mesh, kernel="cudnn")
    seg = jnp.ones((2, 16), jnp.int32)
    with pytest.raises(ValueError, match="no segment_ids"):
        ring_attention(q, k, v, pos, mesh=mesh, zigzag=True, segment_ids=seg, kernel="xla")


def _replica_grads(kernel, q, k, v):
    """The executor's per-replica backward (``vmap(grad, spmd_axis_name="dp")``) of a
    zigzag ring on dp=2, ep=2, cp=2."""
    mesh = stage_mesh(dp=2, ep=2, cp=2)
    pos = jnp.asarray(zigzag_permutation(q.shape[1], 2))
    ring = lambda *a: ring_attention(
        *a, pos, mesh=mesh, batch_axes=("ep",), zigzag=True, kernel=kernel
    )
    loss = lambda *a: jnp.sum(jnp.sin(ring(*a).astype(jnp.float32)))
    replicas = lambda x: x.reshape(2, x.shape[0] // 2, *x.shape[1:])
    per_replica = jax.grad(loss, argnums=(0, 1, 2))
    return jax.jit(lambda *a: jax.vmap(per_replica, spmd_axis_name="dp")(*map(replicas, a)))


def test_fused_ring_under_replica_vmap(fake_gpu):
    q, k, v = qkv(b=4, seed=10)
    got = _replica_grads("xla", q, k, v)(q, k, v)
    want = _replica_grads("plain", q, k, v)(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    q, k, v = bf16(q, k, v)  # and cuDNN's batching rules lower it for CUDA
    text = _replica_grads(None, q, k, v).trace(q, k, v).lower(lowering_platforms=("cuda",))
    assert text.as_text().count(f"custom_call @{BWD}(") == 3


def test_fused_ring_in_a_region_manual_over_cp():
    """Inside a ``shard_map`` manual over cp (the stage programs' per-rank backward) the
    ring runs its per-rank kernels directly: the fused ones agree with the plain ones."""
    from jax.sharding import PartitionSpec as P

    q, k, v = qkv(seed=13)
    mesh = stage_mesh(cp=2)
    perm = zigzag_permutation(q.shape[1], 2)
    q, k, v = q[:, perm], k[:, perm], v[:, perm]

    def run(kernel):
        rank = lambda q, k, v, p: ring_attention(
            q, k, v, p, mesh=mesh, zigzag=True, batch_axes=None, kernel=kernel
        )
        spec = P(None, "cp")
        region = jax.shard_map(
            rank,
            mesh=mesh,
            in_specs=(spec,) * 3 + (P("cp"),),
            out_specs=spec,
            axis_names={"cp"},
            check_vma=False,
        )
        return lambda q, k, v: region(q, k, v, jnp.asarray(perm))

    assert_matches_reference(run("xla"), q, k, v, value_and_grads(run("plain"))(q, k, v))
