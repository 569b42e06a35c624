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
gets the whole image; never more (``K <= N``). With one image per sample inside one
chunk ``K = N`` (one rank needs it all) and the saving is nil; it grows with images
spread over the sequence (multi-image, video or packed samples: the long-context regime
CP exists for). Across islands the tokens first cross split evenly over the cp ranks
(each crosses once) and :func:`exchange_routed` then moves each to its owner with one
all-to-all, so padding never crosses islands. The gradient is the exact transpose: each
image token is sent to exactly one rank, so its gradient comes back from exactly one
place.

Shape key: B batch, L sequence, N modality tokens per sample, D width, R = cp ranks,
K routed slots per rank.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from hetjax.meshes.sequence import inverse_permutation, zigzag_permutation
from hetjax.ops.context import cp_is_manual

__all__ = [
    "Routed",
    "exchange_routed",
    "exchange_routes",
    "gather_routes",
    "merge_modality_tokens",
    "merge_routed",
    "merge_whole_per_rank",
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
    # Every placeholder, sample-major then by position (np.nonzero's order): its sample,
    # its token (k-th placeholder of the sample) and the rank storing its position.
    sample, pos = np.nonzero(is_slot_BxL)
    token = np.arange(len(sample)) - np.concatenate([[0], np.cumsum(counts)[:-1]])[sample]
    group = sample * cp + owner[pos]
    # A stable sort by (sample, rank) keeps position order inside each group - and the
    # original order is the rank's storage order (its two chunks are increasing).
    order = np.argsort(group, kind="stable")
    sizes = np.bincount(group, minlength=b * cp)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    slot = np.arange(len(order)) - starts[group[order]]
    quantum = math.ceil(num_tokens / (4 * cp))
    k = max(1, math.ceil(int(sizes.max(initial=0)) / quantum) * quantum)
    k = min(k, max(num_tokens, 1))
    idx = np.full((b * cp, k), -1, np.int32)
    idx[group[order], slot] = token[order]
    return idx.reshape(b, cp, k)


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


def merge_modality_tokens(
    h_BxLxD: jax.Array,
    is_slot_BxL: jax.Array,
    tokens_BxNxD: jax.Array,
    positions_L: np.ndarray | None = None,
) -> jax.Array:
    """Replaces the placeholder positions of each sample with its N modality tokens, in order.

    Every sample must have exactly N placeholder positions (the data pipeline ensures it).
    ``positions_L``: original position of each stored element when the sequence is stored
    permuted (context parallelism); slots are numbered in ORIGINAL order. Only the integer
    slot mask is reordered for that, never the activations. A cp rank's routed block
    (:func:`merge_routed`) is the same merge of its local slots, in storage order.
    """
    return _place(h_BxLxD, is_slot_BxL, tokens_BxNxD, _slot_numbers(is_slot_BxL, positions_L))


def _slot_numbers(is_slot_BxL: jax.Array, positions_L: np.ndarray | None) -> jax.Array:
    """1-based number of each placeholder among its sample's, counted in original order
    (``positions_L``: the original position of each stored element; None: stored in
    original order)."""
    if positions_L is None:
        return jnp.cumsum(is_slot_BxL, axis=1)
    inverse = inverse_permutation(positions_L)  # stored index of each original position
    return jnp.cumsum(is_slot_BxL[:, inverse], axis=1)[:, positions_L]


def _place(
    h_BxLxD: jax.Array, is_slot_BxL: jax.Array, tokens_BxNxD: jax.Array, numbers_BxL: jax.Array
) -> jax.Array:
    """``h`` with placeholder ``i`` (by :func:`_slot_numbers`) replaced by token ``i``."""
    idx_BxL = jnp.clip(numbers_BxL - 1, 0, tokens_BxNxD.shape[1] - 1)
    gathered_BxLxD = jnp.take_along_axis(tokens_BxNxD, idx_BxL[..., None], axis=1)
    return jnp.where(is_slot_BxL[..., None], gathered_BxLxD.astype(h_BxLxD.dtype), h_BxLxD)


def merge_whole_per_rank(
    h_BxLxD: jax.Array,
    is_slot_BxL: jax.Array,
    tokens_BxNxD: jax.Array,
    *,
    cp: int,
    cp_axis: str = "cp",
) -> jax.Array:
    """Inside a region manual over ``cp_axis`` (:func:`hetjax.ops.context.cp_is_manual`):
    this rank's block of :func:`merge_modality_tokens` when the modality tokens arrive
    WHOLE on every rank (not routed: the homogeneous baseline, whose encoder shares the
    LLM's devices and layout). ``h_BxLxD`` and ``is_slot_BxL`` are the rank's block of
    the zigzag-stored sequence. Slots are numbered in original order over the whole
    sequence, so the slot mask (``[B, L]`` booleans, not the activations) is
    all-gathered over cp first. The tokens' cotangent from one rank covers only its own
    slots: the caller sums it over cp."""
    block = is_slot_BxL.shape[1]
    whole_BxL = jax.lax.all_gather(is_slot_BxL, cp_axis, axis=1, tiled=True)  # storage order
    numbers = _slot_numbers(whole_BxL, zigzag_permutation(block * cp, cp))
    start = jax.lax.axis_index(cp_axis) * block
    mine_BxL = jax.lax.dynamic_slice_in_dim(numbers, start, block, axis=1)
    return _place(h_BxLxD, is_slot_BxL, tokens_BxNxD, mine_BxL)


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
    Inside a region manual over cp (:func:`hetjax.ops.context.cp_is_manual`) the arrays
    are that block already and the merge runs directly.
    """
    if cp_is_manual(cp_axis):
        return merge_modality_tokens(h_BxLxD, is_slot_BxL, routed_BxRKxD)
    batch = tuple(batch_axes) if batch_axes else None
    x_spec = PartitionSpec(batch, cp_axis, None)
    fn = jax.shard_map(
        merge_modality_tokens,
        mesh=mesh,
        in_specs=(x_spec, PartitionSpec(batch, cp_axis), x_spec),
        out_specs=x_spec,
    )
    return fn(h_BxLxD, is_slot_BxL, routed_BxRKxD)


# -- across islands: split evenly, then exchange inside the destination ----------------------


def exchange_routes(idx_BxRxK: np.ndarray, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Host-side plan of :func:`exchange_routed` for the routing ``idx`` of
    :func:`token_routes`, when the tokens arrive split EVENLY over the ``cp`` ranks
    (rank ``s`` holds tokens ``[s*N/cp, (s+1)*N/cp)``).

    Returns:
        ``send[B, cp, cp, K2]``: for holder ``s`` and owner ``r``, the holder-local
        positions of the tokens ``r`` needs from ``s``, in ``r``'s slot order (-1 pad);
        ``recv[B, cp, K]``: for owner ``r``'s slot ``k``, the index ``s * K2 + i`` of that
        token among everything ``r`` receives (-1 for padding slots). ``K2`` is rounded up
        to a multiple of ``ceil(N / (4 * cp**2))`` and at most ``N / cp``.

    Raises:
        ValueError: ``N`` is not divisible by ``cp``.
    """
    b, cp, k = idx_BxRxK.shape
    if num_tokens % cp:
        raise ValueError(f"{num_tokens} tokens do not split evenly over cp={cp}")
    held = num_tokens // cp
    holder = np.where(idx_BxRxK >= 0, idx_BxRxK // held, -1)
    counts = np.stack([(holder == s).sum(-1) for s in range(cp)], 1)  # [B, S, R]
    quantum = max(1, math.ceil(num_tokens / (4 * cp * cp)))
    k2 = max(1, math.ceil(int(counts.max(initial=0)) / quantum) * quantum)
    k2 = min(k2, max(held, 1))
    send = np.full((b * cp * cp, k2), -1, np.int32)
    recv = np.full((b, cp, k), -1, np.int32)
    # Every routed slot in (sample, owner, slot) order; grouped by (sample, holder, owner)
    # with a stable sort, so each group keeps the owner's slot order.
    sample, owner, slot = np.nonzero(idx_BxRxK >= 0)
    token = idx_BxRxK[sample, owner, slot]
    source = token // held
    group = (sample * cp + source) * cp + owner
    order = np.argsort(group, kind="stable")
    sizes = np.bincount(group, minlength=b * cp * cp)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    at = np.empty(len(order), np.int64)
    at[order] = np.arange(len(order)) - starts[group[order]]  # place within its group
    send[group, at] = token % held
    recv[sample, owner, slot] = source * k2 + at
    return send.reshape(b, cp, cp, k2), recv


def _exchange_local(x_bxHxD, send_bx1xRxK2, recv_bx1xK, *, cp_axis):
    b, _, r, k2 = send_bx1xRxK2.shape
    got = _take(x_bxHxD, send_bx1xRxK2[:, 0])  # [b, R*K2, D]: what each owner needs from me
    out_Rxbxk2xD = jnp.moveaxis(got.reshape(b, r, k2, -1), 1, 0)
    # After the all-to-all, row s holds what holder s sent me.
    back = jax.lax.all_to_all(out_Rxbxk2xD, cp_axis, 0, 0, tiled=True)
    return _take(jnp.moveaxis(back, 0, 1).reshape(b, r * k2, -1), recv_bx1xK)


def exchange_routed(
    x_BxNxD: jax.Array,
    send_BxRxRxK2: jax.Array,
    recv_BxRxK: jax.Array,
    *,
    mesh: Mesh,
    batch_axes: Sequence[str] | None,
    cp_axis: str = "cp",
) -> jax.Array:
    """Tokens split evenly over ``cp_axis`` (dim 1) -> the routed ``[B, cp*K, D]`` layout
    of :func:`gather_routes`, with one ``all_to_all`` over cp: each token moves at most
    once, from the rank that holds it to the rank that owns its position. Used after a
    cross-island transfer, so each token crosses islands exactly once (``N`` per sample)
    and nothing is broadcast inside the destination island."""
    batch = tuple(batch_axes) if batch_axes else None
    fn = jax.shard_map(
        functools.partial(_exchange_local, cp_axis=cp_axis),
        mesh=mesh,
        in_specs=(
            PartitionSpec(batch, cp_axis, None),
            PartitionSpec(batch, cp_axis),
            PartitionSpec(batch, cp_axis),
        ),
        out_specs=PartitionSpec(batch, cp_axis, None),
    )
    return fn(x_BxNxD, send_BxRxRxK2, recv_BxRxK)
