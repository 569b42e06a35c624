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

import numpy as np
from jax.sharding import Mesh

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

    def positions(self, seq_len: int) -> np.ndarray:
        """Original position of each stored sequence element. With ``cp > 1`` sequences
        are stored in the load-balanced zigzag order (see ``hetjax.ops.ring_attention``)."""
        if self.cp == 1:
            return np.arange(seq_len)
        from hetjax.ops.ring_attention import zigzag_permutation

        return zigzag_permutation(seq_len, self.cp)

    def _size(self, axis: str) -> int:
        return 1 if self.mesh is None else self.mesh.shape[axis]

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
) -> Iterator[ParallelContext]:
    """Makes ``ParallelContext(mesh, batch_axes, loss_scale, routed)`` current while
    tracing."""
    ctx = ParallelContext(mesh, batch_axes, loss_scale, frozenset(routed))
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def current() -> ParallelContext | None:
    """The innermost active context, or None outside any stage program."""
    return _CURRENT.get()
