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

Shape key: B batch, L query length, S key length, H query heads, G kv heads (divides
``H``), K head dim, M segments per row.
"""

from __future__ import annotations

import os
from typing import Literal

import jax
import jax.numpy as jnp

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


def fused_attention(
    q_BxLxHxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxGxK: jax.Array,
    *,
    causal: bool,
    implementation: Implementation = "cudnn",
) -> jax.Array:
    """Causal (the kernel's own mask: query ``i`` sees keys ``<= i``) or unmasked GQA
    attention through ``jax.nn.dot_product_attention``; no bias.

    Any length: JAX refuses cuDNN training at an odd length (its check runs as if a bias
    were passed), so an odd sequence gets one padding token, kept out by cuDNN's padding
    mask (sequence lengths ``L`` and ``S``), and the padded query row is dropped.
    """
    l, s = q_BxLxHxK.shape[1], k_BxSxGxK.shape[1]
    if l % 2 == 0 and s % 2 == 0:
        out = jax.nn.dot_product_attention(
            q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, is_causal=causal, implementation=implementation
        )
        return out.astype(q_BxLxHxK.dtype)
    b = q_BxLxHxK.shape[0]
    even = lambda x: jnp.pad(x, ((0, 0), (0, x.shape[1] % 2), (0, 0), (0, 0)))
    out = jax.nn.dot_product_attention(
        even(q_BxLxHxK),
        even(k_BxSxGxK),
        even(v_BxSxGxK),
        is_causal=causal,
        query_seq_lengths=jnp.full((b,), l, jnp.int32),
        key_value_seq_lengths=jnp.full((b,), s, jnp.int32),
        implementation=implementation,
    )
    return out[:, :l].astype(q_BxLxHxK.dtype)


def masked_fused_attention(
    q_BxLxHxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxGxK: jax.Array,
    mask_Bx1xLxS: jax.Array,
    *,
    implementation: Implementation = "cudnn",
) -> jax.Array:
    """Any boolean mask, passed as cuDNN's additive bias: every tile is computed and the
    ``[B, 1, L, S]`` bias read, and cuDNN's training kernel wants even ``L`` and ``S``
    (:func:`bias_fused_applies`). The fallback where no mask type of the kernel fits."""
    out = jax.nn.dot_product_attention(
        q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask=mask_Bx1xLxS, implementation=implementation
    )
    return out.astype(q_BxLxHxK.dtype)


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
    lengths, offsets = packed_segments(jnp.asarray(segment_ids_BxL, jnp.int32), max_segments)
    if implementation == "xla":
        mask = _packed_mask_bx1xlxl(lengths, offsets, q_BxLxHxK.shape[1])
        return masked_fused_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, mask, implementation="xla")
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    h, g = q_BxLxHxK.shape[2], k_BxLxGxK.shape[2]
    if g != h and jax.__version_info__ < (0, 11, 1):
        # Before jax 0.11.1 the packed layout strode K/V offsets by the query heads
        # (jax-ml/jax be78ee0f15): repeat K/V to H heads there.
        k_BxLxGxK = jnp.repeat(k_BxLxGxK, h // g, axis=2)
        v_BxLxGxK = jnp.repeat(v_BxLxGxK, h // g, axis=2)
    out = cudnn.dot_product_attention(
        q_BxLxHxK,
        k_BxLxGxK,
        v_BxLxGxK,
        None,
        None,
        lengths,
        lengths,
        offsets,
        offsets,
        scale=float(q_BxLxHxK.shape[-1]) ** -0.5,
        mask_type=cudnn.MaskType.PADDING_CAUSAL,
    )
    return out.astype(q_BxLxHxK.dtype)
