"""Qwen2.5-VL's rotary positions: 2D in the vision tower, 3D (mRoPE) in the LLM.

Both rotate the pairs ``(x[i], x[i + K/2])`` of a head, as Llama's RoPE does
(:func:`models.layers.apply_rope`); only the angle of each pair differs:

- vision: the first ``K/4`` pairs turn with the patch's row, the next ``K/4`` with its
  column, at the frequencies of a ``K/2``-dimensional RoPE;
- LLM (mRoPE): pair ``j`` takes the temporal, height or width position by which of the
  ``mrope_section`` consecutive ranges it falls in (16/24/24 pairs of 64 for a 128 head).

Inverse frequencies are ``1 / theta^(2i/d)`` in float32, as transformers computes them.
Shape key: B batch, L tokens, H heads, K head dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def inverse_frequencies(dim: int, theta: float) -> jax.Array:
    """``1 / theta^(2i / dim)`` for ``i < dim / 2`` (float32)."""
    return 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))


def rotate(x_BxLxHxK: jax.Array, angles_BxLxJ: jax.Array) -> jax.Array:
    """Rotates pair ``j = (x[j], x[j + K/2])`` of every head by ``angles[..., j]`` (float32
    maths, the input's dtype out)."""
    k = x_BxLxHxK.shape[-1]
    cos, sin = jnp.cos(angles_BxLxJ)[:, :, None], jnp.sin(angles_BxLxJ)[:, :, None]
    x = x_BxLxHxK.astype(jnp.float32)
    x1, x2 = x[..., : k // 2], x[..., k // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_BxLxHxK.dtype)


def vision_angles(positions_BxNx2: jax.Array, head_dim: int, theta: float) -> jax.Array:
    """Angles ``[B, N, K/2]`` of the tower's 2D rotary from ``(row, column)`` positions."""
    inv = inverse_frequencies(head_dim // 2, theta)
    pos = positions_BxNx2.astype(jnp.float32)
    return jnp.concatenate([pos[..., 0:1] * inv, pos[..., 1:2] * inv], axis=-1)


def mrope_angles(
    positions_BxLx3: jax.Array, head_dim: int, theta: float, section: Sequence[int]
) -> jax.Array:
    """Angles ``[B, L, K/2]`` of the LLM's mRoPE from (temporal, height, width) positions:
    pair ``j`` in the ``s``-th range of ``section`` turns with position ``s % 3``."""
    if sum(section) != head_dim // 2:
        raise ValueError(
            f"mrope_section={tuple(section)} sums to {sum(section)}, the head has "
            f"{head_dim // 2} rotary pairs; make them equal"
        )
    which = np.concatenate([np.full(n, s % 3) for s, n in enumerate(section)])
    inv = inverse_frequencies(head_dim, theta)
    pos_BxLxJ = jnp.take(positions_BxLx3.astype(jnp.float32), jnp.asarray(which), axis=-1)
    return pos_BxLxJ * inv
