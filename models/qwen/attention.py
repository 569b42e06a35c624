"""Bidirectional attention within segments: the vision tower's packed images and windows.

A row of the tower holds several images' (and videos') patches one after another; a
query sees only keys with its own segment id (a frame in the full-attention layers, a
window in the others), in any order and both ways. ``hetjax.ops``' packed attention
(:func:`hetjax.ops.ring_kernels.causal_attention`) is causal by position; a non-causal
segment mask is this file's one addition (its float32 maths are the plain path's).
Under context parallelism (the tower's patches split over cp) the keys of other ranks
come round :func:`hetjax.ops.ring_attention.ring_attention`'s ring, its segment ids with
them, non-causal: the same mask, a block at a time.

On a GPU in bf16/f16 the mask goes to cuDNN as a bias
(:func:`hetjax.ops.fused_attention.masked_fused_attention`); the scores are then never
materialised, but every tile of the row is computed. Packing windows contiguously and
using cuDNN's packed layout instead is left for the GPU path.

Shape key: B rows, N patches, H heads, K head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hetjax.ops import context as parallel
from hetjax.ops.fused_attention import Kernel, bias_fused_applies, masked_fused_attention
from hetjax.ops.ring_attention import ring_attention


def segment_attention(
    q_BxNxHxK: jax.Array,
    k_BxNxHxK: jax.Array,
    v_BxNxHxK: jax.Array,
    segment_ids_BxN: jax.Array,
    *,
    kernel: Kernel | None = None,
) -> jax.Array:
    """Multi-head attention where query ``i`` sees key ``j`` iff their segment ids are
    equal (no causal mask). Softmax in float32.

    Args:
        q_BxNxHxK, k_BxNxHxK, v_BxNxHxK: the rotated heads.
        segment_ids_BxN: per token its segment; padding shares one id (e.g. ``-1``) so its
            rows stay finite and never reach real tokens.
        kernel: ``"plain"``, ``"cudnn"`` or ``"xla"``; None: cuDNN where it applies.

    Returns:
        ``[B, N, H, K]`` in the dtype of ``q``.
    """
    ctx = parallel.current()
    if ctx is not None and ctx.cp > 1:
        ring = dict(mesh=ctx.mesh, batch_axes=ctx.batch_axes, segment_ids=segment_ids_BxN)
        return ring_attention(q_BxNxHxK, k_BxNxHxK, v_BxNxHxK, None, causal=False, **ring)
    mask_Bx1xNxN = segment_ids_BxN[:, None, :, None] == segment_ids_BxN[:, None, None, :]
    if kernel is None:
        kernel = "cudnn" if bias_fused_applies(q_BxNxHxK, k_BxNxHxK) else "plain"
    if kernel != "plain":
        return masked_fused_attention(
            q_BxNxHxK, k_BxNxHxK, v_BxNxHxK, mask_Bx1xNxN, implementation=kernel
        )
    d = q_BxNxHxK.shape[-1]
    s = jnp.einsum("bnhk,bmhk->bhnm", q_BxNxHxK, k_BxNxHxK, preferred_element_type=jnp.float32)
    s = jnp.where(mask_Bx1xNxN, s / jnp.sqrt(jnp.float32(d)), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(s, axis=-1).astype(v_BxNxHxK.dtype)
    return jnp.einsum("bhnm,bmhk->bnhk", probs, v_BxNxHxK).astype(q_BxNxHxK.dtype)
