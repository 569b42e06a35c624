"""A kernel of independent rows under ``jax.vmap``: the mapped axis folded into the rows.

The executor maps every stage program over its data-parallel replicas with ``jax.vmap``
(:mod:`hetjax.runtime.replicas`), one replica included. JAX's batching rules for cuDNN's
attention primitives assume every operand is mapped and has the shape of the plain call:
an unmapped operand (a cotangent of a sum, sequence lengths built with ``jnp.full``) is
reshaped as if mapped, the packed layout's ``[B, M]`` segment lengths are reshaped to
``[B]``, a ``[B, 1, L, S]`` bias to ``[B, H, L, S]``; each is a ``TypeError`` at trace
time. A rule per primitive would follow JAX's internals; what the kernels share is
simpler: their rows are independent. So :func:`vmap_folded` gives such a function a vmap
rule of its own: unmapped arguments are broadcast, the mapped axis is folded into the
rows (``[n, B, ...] -> [n B, ...]``), the function runs once unmapped (one kernel launch
for all replicas), and its results are unfolded (``[n B', ...] -> [n, B', ...]``).
Nested vmaps fold one after the other (the rule calls the folded function again, which
the enclosing vmap folds in turn).

``custom_vmap`` has no transpose rule, so a folded function cannot be differentiated
through; :func:`folded_vjp` is a ``custom_vjp`` whose primal, forward and backward are
each folded.

Contract of the wrapped functions: every array argument and result has rows leading,
its leading axis the batch or a multiple of it (cuDNN's packed softmax statistics are
``[B M, H, L]``), and rows do not interact. A forward's residuals are only ever folded
back into the backward under the same vmap, so the order of their rows need not be per
row; where a residual arrives unmapped (the forward ran outside this vmap: ``jax.jacrev``
maps only the cotangents) the backward runs per replica instead (``lax.map``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap


def _fold(x: jax.Array, mapped: bool, n: int) -> jax.Array:
    """``[n, B, ...]`` (or ``[B, ...]`` unmapped, broadcast) -> ``[n B, ...]``."""
    if not mapped:
        x = jnp.broadcast_to(x, (n, *x.shape))
    return x.reshape(n * x.shape[1], *x.shape[2:])


def _unfold(x: jax.Array, n: int) -> jax.Array:
    return x.reshape(n, x.shape[0] // n, *x.shape[1:])


def vmap_folded(fn: Callable[..., Any], *, whole: Sequence[int] = ()) -> Callable[..., Any]:
    """``fn`` with a vmap rule that folds the mapped axis into its rows.

    Args:
        fn: a function of positional pytrees of arrays, each array's leading axis the
            rows (see the module docstring); it is called only unmapped.
        whole: positions of arguments whose rows are meaningful only as a whole, i.e. a
            forward's residuals: if any of their arrays is unmapped, ``fn`` runs once per
            replica (``lax.map``) instead of on the folded rows.

    Returns:
        ``fn``, unchanged outside ``jax.vmap``; every result is mapped under it.
    """
    folded = custom_vmap(fn)

    @folded.def_vmap
    def rule(n: int, in_batched: tuple, *args: Any):
        leaves, tree = jax.tree.flatten(args)
        mapped = jax.tree.leaves(in_batched)
        if all(jax.tree.leaves([in_batched[i] for i in whole])):
            out = folded(*tree.unflatten(map(_fold, leaves, mapped, [n] * len(leaves))))
            out = jax.tree.map(lambda y: _unfold(y, n), out)
        else:

            def one_replica(slices: list) -> Any:
                it = iter(slices)
                return folded(
                    *tree.unflatten(
                        [next(it) if m else x for x, m in zip(leaves, mapped, strict=True)]
                    )
                )

            out = jax.lax.map(one_replica, [x for x, m in zip(leaves, mapped, strict=True) if m])
        return out, jax.tree.map(lambda _: True, out)

    return folded


def folded_vjp(
    primal: Callable[..., Any],
    forward: Callable[..., tuple[Any, Any]],
    backward: Callable[[Any, Any], tuple],
    *,
    differentiable: int,
) -> Callable[..., Any]:
    """A ``custom_vjp`` function of row-major arrays whose three parts are folded under
    ``jax.vmap`` (:func:`vmap_folded`).

    Args:
        primal: ``primal(*args) -> out`` (what runs when nothing differentiates it).
        forward: ``forward(*args) -> (out, residuals)``.
        backward: ``backward(residuals, g) -> gradients`` of the first ``differentiable``
            arguments.
        differentiable: how many leading arguments get gradients; the others (lengths,
            offsets, masks) get none.

    Returns:
        ``f(*args)``: ``primal``'s values, ``forward``/``backward``'s gradients.
    """
    primal_f, forward_f = vmap_folded(primal), vmap_folded(forward)
    backward_f = vmap_folded(backward, whole=(0,))

    @jax.custom_vjp
    def f(diff: tuple, rest: tuple):
        return primal_f(*diff, *rest)

    def fwd(diff, rest):
        return forward_f(*diff, *rest)

    def bwd(res, g):
        return tuple(backward_f(res, g)), None  # nothing for the rest

    f.defvjp(fwd, bwd)
    return lambda *args: f(args[:differentiable], args[differentiable:])
