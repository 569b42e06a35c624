"""Routing modality tokens to the context-parallel ranks that own their positions.

An LLM with ``cp > 1`` stores each sequence load-balanced (zigzag, see
:mod:`hetjax.ops.ring_attention`): rank ``r`` holds chunks ``r`` and ``2*cp-1-r``. A
sample's image tokens replace its placeholder tokens, so a rank needs exactly the image
tokens whose placeholders sit at positions it owns - not the whole image. Which ones
depends on where the placeholders are in each sample, so the routing is computed on the
host from the token ids of every microbatch (the executor has them anyway):

* :func:`token_routes` -> ``idx[B, cp, K]``: the image-token index that rank ``r``'s
  ``k``-th owned slot takes, in the order the rank stores its slots, ``-1`` = padding.
  ``K`` (slots per rank) is the largest per-rank count rounded up to a multiple of
  ``ceil(N / (4 * cp))`` (at most ``4 * cp`` different shapes, so few compiles), and
  never more than ``N``.
* :func:`gather_routes` (source side): ``[B, N, D]`` -> ``[B, cp*K, D]``; sharded over
  cp on dim 1, each rank receives its ``K`` slots and nothing else. Padding is zero.
* :func:`merge_routed` (destination side, inside the LLM's ``pre``): each rank numbers
  its LOCAL placeholders ``0, 1, ...`` in storage order - the same order the host used -
  and takes its ``k``-th routed token, inside ``shard_map`` (no communication).

Bytes: ``cp * K * D`` per sample delivered instead of ``cp * N * D`` when every rank
gets the whole image. With one image per sample inside one chunk ``K = N`` (one rank
needs it all) and routing saves nothing, so the executor routes only when ``K < N`` and
otherwise delivers replicated over cp as before (:class:`Routed` marks which form a
stage received; both compile once). The saving grows with images spread over the
sequence (multi-image, video or packed samples: the long-context regime CP exists for).
Across islands, the routed form sends ``cp * K`` tokens per sample where the replicated
form sends ``N`` once and broadcasts inside the destination island, so with islands
routing trades cross-island bytes (at most ``cp`` times more, equal at perfect balance)
for no intra-island broadcast. The gradient is the exact transpose: each image token is
sent to exactly one rank, so its gradient comes back from exactly one place.

Shape key: B batch, L sequence, N modality tokens per sample, D width, R = cp ranks,
K routed slots per rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

__all__ = [
    "Routed",
    "gather_routes",
    "merge_routed",
    "owner_rank",
    "scatter_routes",
    "token_routes",
]


@jax.tree_util.register_pytree_node_class
class Routed:
    """Marks tokens delivered routed (``[B, cp*K, D]``, split over cp by position).

    A pytree node, so a stage program traced with it differs from one traced with plain
    ``[B, N, D]`` tokens (jit keys on the tree structure) and the cotangent of a routed
    input comes back routed.
    """

    def __init__(self, tokens):
        self.tokens = tokens

    def tree_flatten(self):
        return (self.tokens,), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)

    def __repr__(self) -> str:
        return f"Routed({self.tokens!r})"


def owner_rank(seq_len: int, cp: int) -> np.ndarray:
    """``[L]``: the cp rank that stores each ORIGINAL position in the zigzag layout."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2*cp = {2 * cp}")
    chunk = np.arange(seq_len) // (seq_len // (2 * cp))
    return np.where(chunk < cp, chunk, 2 * cp - 1 - chunk)


def token_routes(is_slot_BxL: np.ndarray, num_tokens: int, cp: int) -> np.ndarray:
    """Host-side routing of one microbatch (or step): ``idx[B, cp, K]`` (int32).

    Args:
        is_slot_BxL: placeholder mask in ORIGINAL order (not zigzag-permuted).
        num_tokens: ``N``, modality tokens per sample (the ``k``-th placeholder of a
            sample takes token ``k``).
        cp: context-parallel ranks of the destination.

    Raises:
        ValueError: a sample has more placeholders than ``num_tokens``.
    """
    is_slot_BxL = np.asarray(is_slot_BxL, bool)
    b, seq = is_slot_BxL.shape
    counts = is_slot_BxL.sum(1)
    if (counts > num_tokens).any():
        bad = int(np.argmax(counts > num_tokens))
        raise ValueError(
            f"sample {bad} has {counts[bad]} placeholders but the encoder gives {num_tokens}"
            " tokens; every sample needs exactly one placeholder per modality token"
        )
    owner = owner_rank(seq, cp)
    token_BxL = np.cumsum(is_slot_BxL, axis=1) - 1  # modality token at each placeholder
    per_rank_BxR = np.stack([(is_slot_BxL & (owner == r)).sum(1) for r in range(cp)], 1)
    quantum = math.ceil(num_tokens / (4 * cp))
    k = max(1, math.ceil(int(per_rank_BxR.max(initial=0)) / quantum) * quantum)
    k = min(k, max(num_tokens, 1))
    idx = np.full((b, cp, k), -1, np.int32)
    for r in range(cp):
        mine = is_slot_BxL & (owner == r)
        for i in range(b):
            # Original order == the rank's storage order (its two chunks are increasing).
            owned = token_BxL[i][mine[i]]
            idx[i, r, : len(owned)] = owned
    return idx


def _take(x_BxNxD: jax.Array, idx_BxRxK: jax.Array) -> jax.Array:
    b, r, k = idx_BxRxK.shape
    flat = idx_BxRxK.reshape(b, r * k)
    got = jnp.take_along_axis(x_BxNxD, jnp.maximum(flat, 0)[..., None], axis=1)
    return jnp.where((flat >= 0)[..., None], got, jnp.zeros((), x_BxNxD.dtype))


def gather_routes(x_BxNxD: jax.Array, idx_BxRxK: jax.Array) -> jax.Array:
    """``[B, N, D]`` -> ``[B, R*K, D]``: rank ``r``'s slots at ``[r*K, (r+1)*K)``."""
    return _take(x_BxNxD, idx_BxRxK)


def scatter_routes(g_BxRKxD: jax.Array, idx_BxRxK: jax.Array, num_tokens: int) -> jax.Array:
    """Transpose of :func:`gather_routes`: routed cotangents back to ``[B, N, D]``."""
    b, _, d = g_BxRKxD.shape
    zeros = jnp.zeros((b, num_tokens, d), g_BxRKxD.dtype)
    _, vjp = jax.vjp(lambda x: _take(x, idx_BxRxK), zeros)
    return vjp(g_BxRKxD)[0]


def _merge_local(h_BxLxD, is_slot_BxL, routed_BxKxD):
    order = jnp.cumsum(is_slot_BxL, axis=1) - 1
    idx = jnp.clip(order, 0, routed_BxKxD.shape[1] - 1)
    got = jnp.take_along_axis(routed_BxKxD, idx[..., None], axis=1)
    return jnp.where(is_slot_BxL[..., None], got.astype(h_BxLxD.dtype), h_BxLxD)


def merge_routed(
    h_BxLxD: jax.Array,
    is_slot_BxL: jax.Array,
    routed_BxRKxD: jax.Array,
    *,
    mesh: Mesh,
    batch_axes: Sequence[str] | None,
    cp_axis: str = "cp",
) -> jax.Array:
    """Writes routed modality tokens into the placeholders, rank-locally.

    ``h_BxLxD`` and ``is_slot_BxL`` are in storage (zigzag) order, sharded over
    ``cp_axis`` on dim 1; ``routed_BxRKxD`` comes from :func:`gather_routes` and is
    sharded over ``cp_axis`` on dim 1 too. No collective: every rank reads its own block.
    """
    batch = tuple(batch_axes) if batch_axes else None
    x_spec = PartitionSpec(batch, cp_axis, None)
    fn = jax.shard_map(
        _merge_local,
        mesh=mesh,
        in_specs=(x_spec, PartitionSpec(batch, cp_axis), x_spec),
        out_specs=x_spec,
    )
    return fn(h_BxLxD, is_slot_BxL, routed_BxRKxD)
