"""cuDNN's fused (flash) attention, in the forms hetjax's attention paths call it.

The plain path (:mod:`hetjax.ops.attention`, :mod:`hetjax.ops.ring_kernels`) builds the
float32 ``[H, L, S]`` scores and a boolean mask; it is the FP32 reference and runs on any
backend. On a GPU, bf16/f16 attention runs through cuDNN's fused kernel instead, which
never materialises the scores, with the mask given the way the kernel skips work:

* causal rows (decoders): cuDNN's own causal mask, ``is_causal=True``; no bias tensor, and
  the tiles above the diagonal are never computed;
* encoders (no mask): any length, CLIP's 577 tokens included (an odd length is padded
  by one token that cuDNN's padding mask keeps out);
* packed rows (segment ids, positions restarting per sample): cuDNN's packed
  (variable-length) layout, each sample a causal sequence of its own, given by segment
  lengths and offsets (:func:`packed_fused_attention`; needs a static bound on the
  samples per row);
* anything else (arbitrary positions): the mask as an additive bias, the one form that
  computes the full square (:func:`masked_fused_attention`).

Each form has an ``implementation="xla"`` twin with the kernel's exact semantics in plain
XLA maths, which the tests compare with the plain path on CPU (values and gradients in
float32); on a GPU the ``"cudnn"`` form is checked structurally on the program lowered
for CUDA (the custom call, its mask type, no bias operand).

Every form is one :func:`hetjax.ops.vmap_fold.folded_vjp` call binding JAX's cuDNN
primitives (``jax._src.cudnn.fused_attention_stablehlo``, as its public
``dot_product_attention`` does), not the public function: under the executor's replica
``jax.vmap`` JAX's batching rules for those primitives fail (an unmapped operand, the
packed layout's ``[B, M]`` lengths, a one-head bias), so the mapped axis is folded into
the batch and the kernel runs once per call. The twin takes the same fold, so the CPU
tests check it.

Shape key: B batch, L query length, S key length, H query heads, G kv heads (divides
``H``), K head dim, M segments per row.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Literal

import jax
import jax.numpy as jnp

from hetjax.ops.vmap_fold import folded_vjp, vmap_folded

# Which kernel an attention call runs: "plain" (einsum maths, the FP32 reference),
# "cudnn" (the fused kernel, GPU only) or "xla" (the fused kernel's semantics in XLA, to
# test the fused call's arguments on CPU). None picks "cudnn" where
# :func:`fused_attention_applies`, else "plain".
Kernel = Literal["plain", "cudnn", "xla"]
Implementation = Literal["cudnn", "xla"]


def fused_attention_applies(q_BxLxHxK: jax.Array, k_BxSxGxK: jax.Array) -> bool:
    """Whether attention on these inputs runs cuDNN's fused kernel: the default backend
    is a GPU, ``HETJAX_FUSED_ATTENTION`` is not ``0``, the inputs are bf16 or f16 (float32
    keeps the plain path, so the FP32 parity tests compare the same maths), and the head
    dimension is a multiple of 8 up to 128. Any sequence length."""
    d = q_BxLxHxK.shape[-1]
    return (
        os.environ.get("HETJAX_FUSED_ATTENTION", "1") != "0"
        and jax.default_backend() == "gpu"
        and q_BxLxHxK.dtype in (jnp.bfloat16, jnp.float16)
        and k_BxSxGxK.dtype == q_BxLxHxK.dtype
        and d % 8 == 0
        and d <= 128
    )


def pick_kernel(kernel: Kernel | None, q_BxLxHxK: jax.Array, k_BxSxGxK: jax.Array) -> Kernel:
    """``kernel``, or for None the fused kernel where it applies and the plain path else."""
    if kernel is not None:
        return kernel
    return "cudnn" if fused_attention_applies(q_BxLxHxK, k_BxSxGxK) else "plain"


# -- one fused call, folded under vmap -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Mask:
    """The kernel's mask for one call (static), and the per-row operands it reads.

    ``valid``: the unpadded ``(L, S)`` of queries and keys (cuDNN's padding mask);
    ``packed``: the operands ``lengths [B, M], offsets [B, M + 1]`` (packed layout,
    causal per segment); ``bias``: the operand ``mask [B, 1, L, S]`` (bool, passed as an
    additive bias)."""

    causal: bool
    valid: tuple[int, int] | None = None
    packed: bool = False
    bias: bool = False


def _cudnn_static(q: jax.Array, mask: _Mask) -> dict:
    """The static parameters of JAX's cuDNN attention primitives."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    padding = mask.valid is not None or mask.packed
    kinds = cudnn.MaskType
    if padding:
        mask_type = kinds.PADDING_CAUSAL if mask.causal else kinds.PADDING
    else:
        mask_type = kinds.CAUSAL if mask.causal else kinds.NO_MASK
    return dict(
        scale=float(q.shape[-1]) ** -0.5,
        seed=42,
        dropout_rate=0.0,
        variadic_args=(mask.bias, mask.bias),  # (has bias, has bias gradient), as JAX's
        mask_type=mask_type,
        layout=cudnn.AttentionLayout.BTNH.value,
        sliding_window_length=None,
    )


def _cudnn_operands(mask: _Mask, q: jax.Array, extras: tuple) -> tuple:
    """The primitives' seven optional operands: bias, q/kv lengths, q/kv offsets and the
    (unused) page tables; zero-size where a call has none."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    unused = jnp.zeros(0, q.dtype)
    bias = lengths = offsets = unused
    if mask.bias:
        neg = cudnn.get_large_negative_number(q.dtype)
        bias = jnp.where(extras[0], jnp.zeros((), q.dtype), neg)
    if mask.valid is not None:
        lengths = (jnp.full(q.shape[:1], n, jnp.int32) for n in mask.valid)
        return (bias, *lengths, unused, unused, unused, unused)
    if mask.packed:
        lengths, offsets = extras
    return (bias, lengths, lengths, offsets, offsets, unused, unused)


def _cudnn_forward(mask, q, k, v, *extras, training=True):
    """One unmapped kernel call: ``(out, softmax statistics [B M, H, L] float32)``, or
    ``(out,)`` with ``training=False``."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    return cudnn._dot_product_attention_fwd_p_wrapper.bind(
        q, k, v, *_cudnn_operands(mask, q, extras), **_cudnn_static(q, mask), is_training=training
    )


def _cudnn_backward(mask, q, k, v, *extras, out, stats, dout):
    """``(dq, dk, dv)`` of one unmapped call from its output and statistics."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    grads = cudnn._dot_product_attention_bwd_p_wrapper.bind(
        q, k, v, *_cudnn_operands(mask, q, extras), stats, out, dout, **_cudnn_static(q, mask)
    )
    return tuple(grads[:3])  # a bias's gradient (JAX always asks for one) is dropped


def _xla_attention(mask: _Mask, q, k, v, *extras):
    """The call's semantics in XLA maths (``jax.nn``'s ``"xla"`` implementation)."""
    kw = dict(is_causal=mask.causal, implementation="xla")
    if mask.valid is not None:
        l, s = (jnp.full(q.shape[:1], n, jnp.int32) for n in mask.valid)
        kw.update(query_seq_lengths=l, key_value_seq_lengths=s)
    elif mask.packed:
        kw.update(is_causal=False, mask=_packed_mask_bx1xlxl(*extras, q.shape[1]))
    elif mask.bias:
        kw.update(mask=extras[0])
    return jax.nn.dot_product_attention(q, k, v, **kw)


@functools.cache
def _fused_call(mask: _Mask, implementation: Implementation):
    """``f(q, k, v, *extras)`` for this mask: differentiable in q/k/v, folded under vmap.
    cuDNN's backward reads the forward's output and statistics; the twin's recomputes."""
    if implementation == "cudnn":

        def forward(q, k, v, *extras):
            out, stats = _cudnn_forward(mask, q, k, v, *extras)
            return out, (q, k, v, extras, out, stats)

        def backward(res, g):
            q, k, v, extras, out, stats = res
            return _cudnn_backward(mask, q, k, v, *extras, out=out, stats=stats, dout=g)

        primal = lambda *a: _cudnn_forward(mask, *a, training=False)[0]
        return folded_vjp(primal, forward, backward, differentiable=3)

    attend = functools.partial(_xla_attention, mask)

    def twin_backward(res, g):
        q, k, v, extras = res
        return jax.vjp(lambda q, k, v: attend(q, k, v, *extras), q, k, v)[1](g)

    twin_forward = lambda q, k, v, *extras: (attend(q, k, v, *extras), (q, k, v, extras))
    return folded_vjp(attend, twin_forward, twin_backward, differentiable=3)


def _fused(mask: _Mask, implementation: Implementation, q, k, v, *extras) -> jax.Array:
    if implementation == "cudnn":
        from jax._src.cudnn import fused_attention_stablehlo as cudnn

        cudnn.check_cudnn_version()  # "cuDNN is not detected" at trace time, not in XLA
        if mask.packed and not cudnn.check_compute_capability("9.0"):
            raise NotImplementedError("cuDNN's packed attention layout needs Hopper or later")
    return _fused_call(mask, implementation)(q, k, v, *extras).astype(q.dtype)


def block_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool
) -> tuple[jax.Array, jax.Array]:
    """cuDNN's training forward of a ring block, causal or unmasked, folded under vmap:
    ``(out, softmax statistics [B, H, L] float32)``."""
    return vmap_folded(functools.partial(_cudnn_forward, _Mask(causal)))(q, k, v)


def block_gradients(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    stats: jax.Array,
    dout: jax.Array,
    *,
    causal: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """cuDNN's backward of a ring block from given (merged) output and statistics,
    folded under vmap: ``(dq, dk, dv)``."""
    mask = _Mask(causal)
    fn = lambda q, k, v, out, stats, dout: _cudnn_backward(
        mask, q, k, v, out=out, stats=stats, dout=dout
    )
    return vmap_folded(fn)(q, k, v, out, stats, dout)


# -- the forms ---------------------------------------------------------------------------


def fused_attention(
    q_BxLxHxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxGxK: jax.Array,
    *,
    causal: bool,
    implementation: Implementation = "cudnn",
) -> jax.Array:
    """Causal (the kernel's own mask: query ``i`` sees keys ``<= i``) or unmasked GQA
    attention; no bias.

    Any length: JAX's wrapper refuses cuDNN training at an odd length (its check runs as
    if a bias were passed), so an odd sequence gets one padding token, kept out by cuDNN's
    padding mask (sequence lengths ``L`` and ``S``), and the padded query row is dropped.
    """
    l, s = q_BxLxHxK.shape[1], k_BxSxGxK.shape[1]
    if l % 2 == 0 and s % 2 == 0:
        mask = _Mask(causal)
        return _fused(mask, implementation, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK)
    even = lambda x: jnp.pad(x, ((0, 0), (0, x.shape[1] % 2), (0, 0), (0, 0)))
    qkv = (even(q_BxLxHxK), even(k_BxSxGxK), even(v_BxSxGxK))
    return _fused(_Mask(causal, valid=(l, s)), implementation, *qkv)[:, :l]


def masked_fused_attention(
    q_BxLxHxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxGxK: jax.Array,
    mask_Bx1xLxS: jax.Array,
    *,
    implementation: Implementation = "cudnn",
) -> jax.Array:
    """Any boolean mask (``[B or 1, 1, L, S]``), passed as cuDNN's additive bias: every
    tile is computed and the ``[B, 1, L, S]`` bias read, and cuDNN's training kernel wants
    even ``L`` and ``S`` (:func:`bias_fused_applies`). The fallback where no mask type of
    the kernel fits."""
    b, l = q_BxLxHxK.shape[:2]
    mask = jnp.broadcast_to(mask_Bx1xLxS, (b, 1, l, k_BxSxGxK.shape[1]))  # per row
    return _fused(_Mask(False, bias=True), implementation, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask)


def bias_fused_applies(q_BxLxHxK: jax.Array, k_BxSxGxK: jax.Array) -> bool:
    """:func:`fused_attention_applies`, and both lengths even (cuDNN's backward with a bias)."""
    l, s = q_BxLxHxK.shape[1], k_BxSxGxK.shape[1]
    return fused_attention_applies(q_BxLxHxK, k_BxSxGxK) and l % 2 == 0 and s % 2 == 0


# -- packed rows ------------------------------------------------------------------------


def packed_segments(segment_ids_BxL: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array]:
    """cuDNN's description of packed rows: each row's runs of equal segment ids.

    Returns ``(lengths [B, M], offsets [B, M + 1])`` (int32): the length and first index
    of every run, ``-1`` past the row's last run (the layout of
    ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``). A row with more
    than ``M`` runs would merge its last ones, so ``M`` must bound them (the packer's
    samples per row).
    """
    b, l = segment_ids_BxL.shape
    starts_BxL = jnp.concatenate(
        [jnp.ones((b, 1), bool), segment_ids_BxL[:, 1:] != segment_ids_BxL[:, :-1]], axis=1
    )
    first_BxM = jax.vmap(lambda s: jnp.nonzero(s, size=max_segments, fill_value=-1)[0])(starts_BxL)
    first_BxM = first_BxM.astype(jnp.int32)
    following = jnp.concatenate([first_BxM[:, 1:], jnp.full((b, 1), -1, jnp.int32)], axis=1)
    end_BxM = jnp.where(following >= 0, following, l)
    lengths_BxM = jnp.where(first_BxM >= 0, end_BxM - first_BxM, -1)
    offsets = jnp.concatenate([first_BxM, jnp.full((b, 1), -1, jnp.int32)], axis=1)
    return lengths_BxM, offsets


def _packed_mask_bx1xlxl(lengths_BxM: jax.Array, offsets: jax.Array, l: int) -> jax.Array:
    """The mask cuDNN's packed causal kernel applies: same run, key not after the query."""
    idx = jnp.arange(l)
    first, length = offsets[:, None, :-1], lengths_BxM[:, None, :]
    at = idx[None, :, None]
    inside_BxLxM = (first >= 0) & (at >= first) & (at < first + length)
    run_BxL = jnp.where(jnp.any(inside_BxLxM, -1), jnp.argmax(inside_BxLxM, -1), -1)
    same = (run_BxL[:, :, None] == run_BxL[:, None, :]) & (run_BxL[:, :, None] >= 0)
    return (same & (idx[:, None] >= idx[None, :]))[:, None]


def packed_fused_attention(
    q_BxLxHxK: jax.Array,
    k_BxLxGxK: jax.Array,
    v_BxLxGxK: jax.Array,
    segment_ids_BxL: jax.Array,
    *,
    max_segments: int,
    implementation: Implementation = "cudnn",
) -> jax.Array:
    """Causal self-attention of packed rows, each run of equal segment ids a sequence of
    its own, through cuDNN's packed layout (Hopper or later): no bias and no cross-sample
    tile is computed.

    It equals the positions-and-segments mask of
    :func:`hetjax.ops.ring_kernels.causal_attention` wherever a segment's positions count
    up in storage order (a packed row's samples; the trailing padding's tokens, all at
    position 0, then see only the padding before them, and nothing reads them).
    ``max_segments`` must bound every row's segment count (see :func:`packed_segments`).
    """
    if jnp.shape(segment_ids_BxL) != q_BxLxHxK.shape[:2]:
        raise ValueError(
            f"packed_fused_attention: segment_ids {jnp.shape(segment_ids_BxL)} must be the "
            f"queries' [B, L] {q_BxLxHxK.shape[:2]} (one id per token)"
        )
    lengths, offsets = packed_segments(jnp.asarray(segment_ids_BxL, jnp.int32), max_segments)
    h, g = q_BxLxHxK.shape[2], k_BxLxGxK.shape[2]
    if implementation == "cudnn" and g != h and jax.__version_info__ < (0, 11, 1):
        # Before jax 0.11.1 the packed layout strode K/V offsets by the query heads
        # (jax-ml/jax be78ee0f15): repeat K/V to H heads there.
        k_BxLxGxK = jnp.repeat(k_BxLxGxK, h // g, axis=2)
        v_BxLxGxK = jnp.repeat(v_BxLxGxK, h // g, axis=2)
    mask = _Mask(True, packed=True)
    return _fused(mask, implementation, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, lengths, offsets)
