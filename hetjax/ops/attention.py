"""Self-attention as the models' blocks call it: one entry point that picks the kernel.

:func:`self_attention` is what ``models/`` calls with a block's projected ``q``/``k``/``v``:
under context parallelism (``cp > 1``) the K/V ring of :func:`ring_attention`; for packed
rows (segment ids) the position/segment mask of :func:`causal_attention`; otherwise
:func:`attention`. Keeping the choice here, not in each block, lets the kernels change
without touching the models.

Each of them runs cuDNN's fused kernel for bf16/f16 on a GPU and the plain XLA maths
otherwise (:mod:`hetjax.ops.fused_attention`): decoders with the kernel's causal mask,
encoders unmasked at any length, packed rows in cuDNN's packed layout (given
``max_segments``), ring blocks merged by their log-sum-exp. Float32 and CPUs keep the
plain path, so the FP32 parity tests compare the same maths as before.

Shape key: B batch, L query length, S key length, H query heads, G kv heads (``G``
divides ``H``), K head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hetjax.ops import context as parallel
from hetjax.ops.fused_attention import Kernel, fused_attention, pick_kernel
from hetjax.ops.ring_attention import ring_attention
from hetjax.ops.ring_kernels import causal_attention


def attention(
    q_BxLxHxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxGxK: jax.Array,
    *,
    causal: bool,
    kernel: Kernel | None = None,
) -> jax.Array:
    """Grouped-query scaled dot-product attention; ``H`` must be a multiple of ``G``.

    With ``G == H`` this is plain multi-head attention; ``causal``: query ``i`` sees keys
    ``0 .. i``. ``kernel`` (see :data:`hetjax.ops.fused_attention.Kernel`; None picks):
    ``"cudnn"`` runs cuDNN's flash kernel with its own causal mask, or none, at any length
    (the scores are never materialised); ``"plain"`` the float32 softmax below.
    """
    kernel = pick_kernel(kernel, q_BxLxHxK, k_BxSxGxK)
    if kernel != "plain":
        return fused_attention(
            q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal=causal, implementation=kernel
        )
    b, l, h, k = q_BxLxHxK.shape
    g = k_BxSxGxK.shape[2]
    q_BxLxGxRxK = q_BxLxHxK.reshape(b, l, g, h // g, k)
    scores = jnp.einsum("blgrk,bsgk->bgrls", q_BxLxGxRxK, k_BxSxGxK).astype(jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(k))
    if causal:
        s = k_BxSxGxK.shape[1]
        mask_LxS = jnp.arange(l)[:, None] >= jnp.arange(s)[None, :]
        scores = jnp.where(mask_LxS, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BxSxGxK.dtype)
    out = jnp.einsum("bgrls,bsgk->blgrk", probs, v_BxSxGxK)
    return out.reshape(b, l, h, k)


def self_attention(
    q_BxLxHxK: jax.Array,
    k_BxLxGxK: jax.Array,
    v_BxLxGxK: jax.Array,
    *,
    causal: bool,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    max_segments: int | None = None,
) -> jax.Array:
    """A block's attention under the current stage context (:mod:`hetjax.ops.context`).

    Args:
        q_BxLxHxK, k_BxLxGxK, v_BxLxGxK: the projected (and rotated) heads.
        causal: decoder (True) or encoder (False) attention.
        positions: ``[L]`` or ``[B, L]`` original positions of the tokens (causal only;
            under cp the sequence is stored permuted and the mask reads these).
        segment_ids: ``[B, L]`` packed rows' sample ids (causal only).
        max_segments: a bound on the samples in any packed row; with it, packed rows
            take cuDNN's packed layout on a GPU (without, its mask is a bias there).

    Returns:
        ``[B, L, H, K]``.
    """
    ctx = parallel.current()
    if ctx is not None and ctx.cp > 1:
        # The tokens are split over cp: every query needs K/V blocks of other ranks.
        if not causal:
            return ring_attention(
                q_BxLxHxK,
                k_BxLxGxK,
                v_BxLxGxK,
                None,
                mesh=ctx.mesh,
                batch_axes=ctx.batch_axes,
                causal=False,
            )
        return ring_attention(
            q_BxLxHxK,
            k_BxLxGxK,
            v_BxLxGxK,
            positions,
            mesh=ctx.mesh,
            batch_axes=ctx.batch_axes,
            zigzag=True,
            segment_ids=segment_ids,
        )
    qkv = (q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)
    if causal and segment_ids is not None:
        return causal_attention(*qkv, positions, segment_ids=segment_ids, max_segments=max_segments)
    return attention(*qkv, causal=causal)
