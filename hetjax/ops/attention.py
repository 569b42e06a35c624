"""Self-attention as the models' blocks call it: one entry point that picks the kernel.

:func:`self_attention` is what ``models/`` calls with a block's projected ``q``/``k``/``v``:
under context parallelism (``cp > 1``) the K/V ring of :func:`ring_attention`; for packed
rows (segment ids) the position/segment mask of :func:`causal_attention`; otherwise the
plain (or, on a GPU, fused) :func:`attention`. Keeping the choice here, not in each block,
lets the kernels change without touching the models.

Shape key: B batch, L query length, S key length, H query heads, G kv heads (``G``
divides ``H``), K head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hetjax.ops import context as parallel
from hetjax.ops.ring_attention import ring_attention
from hetjax.ops.ring_kernels import causal_attention, fused_attention_applies


def attention(
    q_BxLxHxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxGxK: jax.Array,
    *,
    causal: bool,
) -> jax.Array:
    """Grouped-query scaled dot-product attention; ``H`` must be a multiple of ``G``.

    With ``G == H`` this is plain multi-head attention. Causal attention on a GPU, where
    cuDNN's fused kernel applies, runs through :func:`causal_attention`'s fused path (see
    there: the scores are never materialised).
    """
    b, l, h, k = q_BxLxHxK.shape
    if causal and fused_attention_applies(q_BxLxHxK, k_BxSxGxK):
        s_pos = jnp.arange(k_BxSxGxK.shape[1])
        return causal_attention(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, jnp.arange(l), s_pos, fused=True)
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
) -> jax.Array:
    """A block's attention under the current stage context (:mod:`hetjax.ops.context`).

    Args:
        q_BxLxHxK, k_BxLxGxK, v_BxLxGxK: the projected (and rotated) heads.
        causal: decoder (True) or encoder (False) attention.
        positions: ``[L]`` or ``[B, L]`` original positions of the tokens (causal only;
            under cp the sequence is stored permuted and the mask reads these).
        segment_ids: ``[B, L]`` packed rows' sample ids (causal only).

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
    if causal and segment_ids is not None:
        return causal_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, positions, segment_ids=segment_ids)
    return attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, causal=causal)
