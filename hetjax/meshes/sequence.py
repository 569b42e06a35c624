"""The load-balanced (zigzag) sequence layout of context parallelism.

With causal attention split over ``cp`` ranks, an even split in order gives the last
rank the most work; zigzag storage gives rank ``r`` chunks ``r`` and ``2*cp-1-r`` of
``2*cp``, so every rank does the same work. It is a layout of a logical array (like a
sharding), so it lives with the layouts: the executor stores sequence inputs in it, ring
attention reads positions from it, token routing maps positions to ranks with it.
"""

from __future__ import annotations

import numpy as np


def zigzag_permutation(seq_len: int, cp: int) -> np.ndarray:
    """Storage order of a sequence for load-balanced causal context parallelism.

    Args:
        seq_len: full sequence length ``L``; must be a multiple of ``2 * cp``.
        cp: number of context-parallel ranks.

    Returns:
        ``perm`` of shape ``[L]``: ``x_stored = x[:, perm]`` and ``perm`` is also the
        ``positions`` array (original position of each stored token) for RoPE and the
        causal mask. Rank ``r`` of an even split holds chunks ``r`` and ``2*cp-1-r``.

    Raises:
        ValueError: ``seq_len`` is not a multiple of ``2 * cp``.

    Example:
        >>> zigzag_permutation(8, 2)
        array([0, 1, 6, 7, 2, 3, 4, 5])
    """
    if cp < 1 or seq_len % (2 * cp):
        raise ValueError(
            f"zigzag layout: sequence length {seq_len} must be a multiple of 2*cp = {2 * cp};"
            " pad the sequence or change cp"
        )
    chunk = seq_len // (2 * cp)
    order = [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in order])


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    """``inv`` with ``x[:, perm][:, inv] == x``: takes stored order back to the original."""
    perm = np.asarray(perm)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size, dtype=perm.dtype)
    return inv
