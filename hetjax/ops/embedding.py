"""Vocabulary-parallel embedding lookup (Megatron's ``VocabParallelEmbedding``).

With the table split over tp on its vocabulary axis, each tp rank looks up only the ids
in its own row range (others read zero) and the partial results are summed over tp.
GSPMD finds this form by itself for plain tensor parallelism, but once the activations
around it are sequence-sharded (sequence parallelism) it prefers to all-gather the whole
TABLE - ``V x D`` per step, the largest weight of an LLM. This op writes the Megatron
form explicitly with ``shard_map``. The result is whole over tp (an all-reduce, once per
microbatch): the modality-token merge that follows needs whole sequences, and the first
block's carry constraint then keeps only this rank's sequence part.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from hetjax.ops.context import auto_axes

__all__ = ["vocab_parallel_lookup"]


def vocab_parallel_lookup(
    table_VxD: jax.Array,
    ids_BxL: jax.Array,
    *,
    mesh: Mesh,
    batch_axes: Sequence[str] | None,
    seq_axis: str | None = None,
    tp_axis: str = "tp",
) -> jax.Array:
    """``table[ids]`` with the table's vocabulary split over ``tp_axis``.

    Args:
        table_VxD: embedding table; ``V`` divisible by the tp size.
        ids_BxL: token ids, batch over ``batch_axes``, sequence over ``seq_axis``.

    Returns:
        ``[B, L, D]`` in the table's dtype, whole over ``tp_axis``.
    """
    tp = mesh.shape[tp_axis]
    vocab = table_VxD.shape[0]
    if vocab % tp:
        raise ValueError(f"vocabulary {vocab} is not divisible by {tp_axis}={tp}")
    # Inside a region already manual over some axes (a stage run per cp rank, manual
    # over dp and cp): the ids are this device's block along those, so only the other
    # axes are named, on the region's own (abstract) mesh.
    manual = jax.sharding.get_abstract_mesh().manual_axes
    if manual:
        mesh = jax.sharding.get_abstract_mesh()
    batch = auto_axes(tuple(batch_axes) if batch_axes else None)
    seq_axis = auto_axes(seq_axis)
    rows = vocab // tp

    def local(table, ids):
        first = jax.lax.axis_index(tp_axis) * rows
        mine = (ids >= first) & (ids < first + rows)
        got = jnp.take(table, jnp.where(mine, ids - first, 0), axis=0)
        got = jnp.where(mine[..., None], got, jnp.zeros((), got.dtype))
        return jax.lax.psum(got, tp_axis)

    fn = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(PartitionSpec(tp_axis, None), PartitionSpec(batch, seq_axis)),
        out_specs=PartitionSpec(batch, seq_axis, None),
        axis_names=frozenset(mesh.axis_names) - frozenset(manual),
    )
    return fn(table_VxD, ids_BxL)
