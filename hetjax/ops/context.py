"""The parallel context: what a model's layers need to know about the mesh they run on.

Models stay mesh-agnostic (``models/`` never builds a mesh): a stage program enters
:func:`parallel_context` while it traces the stage, and layers that need explicit
collectives (context-parallel attention, expert-parallel MoE) read :func:`current`.
Outside any context (a single-device reference run, unit tests) they fall back to
their plain single-device form. This is the same idea as Flax's logical-axis-rules
context, applied to the few ops GSPMD cannot express on its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetjax.meshes.rules import activation_sharding, sequence_axes

_CURRENT: contextvars.ContextVar[ParallelContext | None] = contextvars.ContextVar(
    "hetjax_parallel_context", default=None
)


@dataclasses.dataclass(frozen=True)
class ParallelContext:
    """Mesh facts for the stage being traced."""

    mesh: Mesh | None  # the stage's submesh (axes dp, ep, cp, tp); None: no mesh ops
    batch_axes: tuple[str, ...] | None  # mesh axes the batch dim is split over here
    loss_scale: Any = None  # d(loss)/d(summed loss): 1 / global supervised-token count
    # Modality inputs delivered routed: each cp rank got only the tokens of the
    # placeholders it stores (``hetjax.ops.token_routing``), not the whole image.
    routed: frozenset[str] = frozenset()
    sequence_parallel: bool = False  # Megatron SP: residual stream split on sequence over tp

    def positions(self, seq_len: int) -> np.ndarray | jax.Array:
        """Original position of each stored sequence element. With ``cp > 1`` sequences
        are stored in the load-balanced zigzag order (see ``hetjax.meshes.sequence``).
        Inside a region manual over cp (:func:`cp_is_manual`) ``seq_len`` is this rank's
        block and the result is its slice of the zigzag order (a traced array)."""
        if self.cp == 1:
            return np.arange(seq_len)
        from hetjax.meshes.sequence import zigzag_permutation

        if not cp_is_manual():
            return zigzag_permutation(seq_len, self.cp)
        ranks = jnp.asarray(zigzag_permutation(seq_len * self.cp, self.cp)).reshape(self.cp, -1)
        return ranks[jax.lax.axis_index("cp")]

    def _size(self, axis: str) -> int:
        return 1 if self.mesh is None else self.mesh.shape[axis]

    def sequence_sharding(self, ndim: int, *, split: bool) -> NamedSharding | None:
        """Sequence parallelism's two activation layouts ``[B, L, ...]``: ``split`` - the
        sequence over (cp, tp), the residual stream between TP regions; not split - the
        sequence over cp only (whole over tp), the input of a column-parallel matmul.
        None when sequence parallelism is off or ``tp == 1``."""
        if not self.sp:
            return None
        seq = sequence_axes(self.mesh, tp=split)
        return region_activation_sharding(self.mesh, ndim, batch_axes=self.batch_axes, sequence=seq)

    @property
    def sp(self) -> bool:
        """Whether sequence parallelism is in effect here (switched on and ``tp > 1``)."""
        return self.sequence_parallel and self.tp > 1

    @property
    def cp(self) -> int:
        return self._size("cp")

    @property
    def ep(self) -> int:
        return self._size("ep")

    @property
    def tp(self) -> int:
        return self._size("tp")


@contextlib.contextmanager
def parallel_context(
    mesh: Mesh | None,
    *,
    batch_axes: tuple[str, ...] | None,
    loss_scale: Any = None,
    routed: frozenset[str] = frozenset(),
    sequence_parallel: bool = False,
) -> Iterator[ParallelContext]:
    """Makes a :class:`ParallelContext` of these fields current while tracing."""
    ctx = ParallelContext(mesh, batch_axes, loss_scale, frozenset(routed), sequence_parallel)
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def cp_is_manual(axis: str = "cp") -> bool:
    """Whether the code being traced runs per ``axis`` rank: inside a ``shard_map`` manual
    over it (the stage programs' once-per-step CP reduction, ``hetjax.runtime.replicas``).
    Ops that would ``shard_map`` over cp then call their per-rank kernels directly."""
    return axis in jax.sharding.get_abstract_mesh().manual_axes


def auto_axes(axes: str | tuple[str, ...] | None) -> str | tuple[str, ...] | None:
    """``axes`` less those the code being traced is manual over (a sharding constraint
    inside a ``shard_map`` names only the axes left to the partitioner); None if none
    are left."""
    if axes is None:
        return None
    manual = jax.sharding.get_abstract_mesh().manual_axes
    if isinstance(axes, str):
        return None if axes in manual else axes
    kept = tuple(a for a in axes if a not in manual)
    return kept or None


def region_activation_sharding(
    mesh: Mesh, ndim: int, *, batch_axes: Any, sequence: Any
) -> NamedSharding:
    """:func:`~hetjax.meshes.rules.activation_sharding` as a constraint where the code is
    traced: inside a ``shard_map`` (some axes manual) it names only the axes left
    automatic (:func:`auto_axes`), on the region's own abstract mesh; outside one, the
    plain sharding."""
    sharding = activation_sharding(
        mesh, ndim, batch_axes=auto_axes(batch_axes), sequence=auto_axes(sequence)
    )
    here = jax.sharding.get_abstract_mesh()
    if not here.manual_axes:
        return sharding
    return NamedSharding(here, sharding.spec)


def current() -> ParallelContext | None:
    """The innermost active context, or None outside any stage program."""
    return _CURRENT.get()


def _constrain(x: jax.Array, *, split: bool) -> jax.Array:
    ctx = current()
    sharding = None if ctx is None else ctx.sequence_sharding(x.ndim, split=split)
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def enter_tensor_parallel(x_BxLxD: jax.Array) -> jax.Array:
    """Call on the (normalised) input of a column-parallel region. With sequence
    parallelism it all-gathers the sequence over tp (Megatron's ``g``); else a no-op.

    Without this mark GSPMD may instead all-gather the tp-sharded WEIGHTS to meet a
    sequence-split input - correct, but not sequence parallelism."""
    return _constrain(x_BxLxD, split=False)


def tensor_parallel_activation(x: jax.Array, dim: int) -> jax.Array:
    """Call on an activation inside a TP region (heads or MLP hidden units on ``dim``).
    With sequence parallelism it pins ``dim`` over tp and the sequence whole over tp, so
    GSPMD keeps the weights local instead of re-sharding activations on sequence;
    else a no-op."""
    ctx = current()
    sharding = None if ctx is None else ctx.sequence_sharding(x.ndim, split=False)
    if sharding is None:
        return x
    spec = list(sharding.spec) + [None] * (x.ndim - len(sharding.spec))
    spec[dim] = "tp"
    return jax.lax.with_sharding_constraint(x, NamedSharding(sharding.mesh, PartitionSpec(*spec)))


def exit_tensor_parallel(y_BxLxD: jax.Array) -> jax.Array:
    """Call on the output of a row-parallel matmul (before the residual add). With
    sequence parallelism its partial sums are reduce-scattered over tp onto the sequence
    (Megatron's ``g-bar``) instead of all-reduced; else a no-op."""
    return _constrain(y_BxLxD, split=True)
