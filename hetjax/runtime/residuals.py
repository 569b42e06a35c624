"""What a forward keeps for its backward: a ``jax.vjp`` function's leaves, less parameters.

``jax.vjp`` returns its residuals as the leaves of the vjp function. Some of them ARE
the parameters the function was differentiated at (a scan forwards its stacked weights,
:func:`hetjax.ops.dense` keeps its kernel as it came): a stash of them would copy the
weights per microbatch, although whoever runs the backward holds them anyway.
:class:`Residuals` keeps the other leaves only and puts the parameters back when the
backward rebuilds the vjp function. The stage programs stash them between a forward and
its backward (:mod:`hetjax.runtime.vjp`); fully sharded data parallelism keeps them
across a layer's gather (:mod:`hetjax.runtime.fsdp`: the gathered weights are put back
from a new gather, never stored).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Residuals:
    """What a ``none`` / ``selective`` forward keeps for its backward: the leaves of the
    stage's ``jax.vjp`` function, less those that are parameters (``slots``: position in
    the flattened vjp -> index into the stage's parameter leaves; the backward puts its
    own parameters back there)."""

    leaves: tuple[jax.Array, ...]  # [R, ...] per replica
    tree: Any = dataclasses.field(metadata=dict(static=True))  # the vjp's treedef
    slots: tuple[tuple[int, int], ...] = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def of(cls, vjp: Any, params: Sequence[Any]) -> Residuals:
        """The residuals of the vjp function ``vjp``, less the leaves in ``params`` (the
        stage's parameter leaves, matched by identity)."""
        leaves, tree = jax.tree.flatten(vjp)
        index = {id(p): i for i, p in enumerate(params)}
        slots = tuple((j, index[id(a)]) for j, a in enumerate(leaves) if id(a) in index)
        dropped = {j for j, _ in slots}
        kept = tuple(a for j, a in enumerate(leaves) if j not in dropped)
        return cls(kept, tree, slots)

    def vjp(self, params: Sequence[Any]) -> Callable:
        """The vjp function again, with ``params`` (the stage's parameter leaves) back in
        their slots."""
        leaves, rest = [None] * (len(self.leaves) + len(self.slots)), iter(self.leaves)
        for j, i in self.slots:
            leaves[j] = params[i]
        leaves = [next(rest) if a is None else a for a in leaves]
        return self.tree.unflatten(leaves)
