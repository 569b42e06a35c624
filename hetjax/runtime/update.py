"""A stage's once-per-step work: the gradient accumulator, its one reduction, the
optimizer update.

The backward keeps gradients per replica (and per cp rank: :mod:`hetjax.runtime.replicas`);
:meth:`StageUpdate.reduce` sums them once per step, so each parameter is reduced once
whatever the microbatch count. Accumulators, the reduction and the optimizer state cover
the trainable parts only; a frozen part's parameters pass through the update unchanged
(their norm is still reported, so ``param_norm/<part>`` stays constant). Under ZeRO-1 the
reduced gradients and optimizer moments are split over dp (x cp): the reduction is then a
reduce-scatter and the update's output an all-gather. With fsdp the accumulator, the
gradients and the moments keep the parameters' fsdp split, and ZeRO-1 splits them further
over the remaining dp (:func:`~hetjax.runtime.placement.zero1_sharding` skips the mesh
axes a leaf is already split over).

A stage with one backward per step (one microbatch) has no accumulator: that backward's
gradient is the step's (:func:`accumulate` with ``acc`` None), so nothing is zero-filled
and nothing added. With several, :meth:`StageUpdate.zeros` starts a float32 accumulator
that every backward adds into (donated, so in place).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hetjax.meshes import BATCH_AXES
from hetjax.runtime.optim import AdamWConfig, make_optimizer
from hetjax.runtime.placement import zero1_sharding
from hetjax.runtime.stage_fn import split_parts


def accumulate(acc: dict[str, Any] | None, grads: dict[str, Any]) -> dict[str, Any]:
    """A backward's per-replica parameter gradient added to the float32 accumulator.

    ``acc`` None: the stage runs one backward per step (one microbatch), so its gradient
    IS the step's: returned as it is, with no zero-filled accumulator and no add (the
    executor passes None then). The trainable parameters are float32 and their weight
    matmuls write float32 cotangents (:func:`hetjax.ops.dense`), so the cast below is
    the identity there; with several microbatches the add takes each matmul's output as
    it is, no converted copy.
    """
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    return grads if acc is None else jax.tree.map(jnp.add, acc, grads)


def sqnorms_by_key(tree: dict[str, Any]) -> dict[str, jax.Array]:
    """The squared norm of each entry of ``tree`` (e.g. per part)."""
    # In float32: a frozen part's bfloat16 matrices (state.stored_params) as well.
    return {
        k: sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(v))
        for k, v in tree.items()
    }


class StageUpdate:
    """The accumulator, reduction and optimizer update of one stage's trainable parts.

    Args:
        optimizer: an optax transformation, or AdamW settings (then built with the
            weight-decay mask of the trainable parts' logical axes).
        mesh: the stage's submesh.
        trainable: names of the parts trained on this stage.
        axes: the stage's logical axes (a stage-shaped tree).
        abstract: the stage's parameters as ``ShapeDtypeStruct`` s.
        param_shardings: the stage's parameter shardings.
        acc_axes: the accumulator's axes before each parameter's own
            (:attr:`hetjax.runtime.replicas.ReplicaMap.acc_axes`).
        zero1: split the reduced gradients and the optimizer moments over dp (x cp).
        skip_nonfinite: a step whose global gradient norm is NaN/inf leaves the
            parameters and the optimizer state as they were.
    """

    def __init__(
        self,
        optimizer: AdamWConfig | optax.GradientTransformation,
        *,
        mesh: Mesh,
        trainable: tuple[str, ...],
        axes: dict[str, Any],
        abstract: dict[str, Any],
        param_shardings: dict[str, Any],
        acc_axes: tuple[str, ...],
        zero1: bool = False,
        skip_nonfinite: bool = False,
    ):
        self.mesh, self.trainable, self.acc_axes = mesh, trainable, acc_axes
        self.skip_nonfinite = skip_nonfinite
        self.abstract_trainable = split_parts(abstract, trainable)[0]
        if isinstance(optimizer, AdamWConfig):
            optimizer = make_optimizer(optimizer, logical_axes=split_parts(axes, trainable)[0])
        self.optimizer = optax.with_extra_args_support(optimizer)
        trained_shardings = split_parts(param_shardings, trainable)[0]
        self.acc_shardings = jax.tree.map(
            lambda s: NamedSharding(mesh, P(*acc_axes, *s.spec)), trained_shardings
        )
        # ZeRO-1: reduced gradients and optimiser moments split over dp (x cp, with
        # cp_local), so the one reduction is a reduce-scatter and the update's output an
        # all-gather.
        self.grad_shardings = trained_shardings
        if zero1:
            self.grad_shardings = jax.tree.map(
                lambda sh, a: zero1_sharding(sh, a.shape, BATCH_AXES + acc_axes[1:]),
                self.grad_shardings,
                self.abstract_trainable,
            )
        # Optimiser moments are sharded like their gradients; counters are replicated. A
        # stage that trains nothing keeps no optimizer state at all (an empty tuple).
        self.state_shardings = ()
        if trainable:
            self.state_shardings = optax.tree_map_params(
                self.optimizer,
                lambda _, sharding: sharding,
                jax.eval_shape(self.optimizer.init, self.abstract_trainable),
                self.grad_shardings,
                transform_non_params=lambda _: NamedSharding(mesh, P()),
            )

    def opt_init(self, trainable: dict[str, Any]) -> Any:
        """The optimizer state of the trainable parts ``trainable`` (none: ``()``)."""
        return self.optimizer.init(trainable) if self.trainable else ()

    def zeros(self) -> dict[str, Any]:
        """An empty gradient accumulator: ``[R, (cp,) ...]`` zeros per trainable leaf."""
        lead = tuple(self.mesh.shape[a] for a in self.acc_axes)
        return jax.tree.map(
            lambda s: jnp.zeros((*lead, *s.shape), jnp.float32), self.abstract_trainable
        )

    def reduce(self, acc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, jax.Array]]:
        """The step's gradients from the accumulator, and their squared norms per part."""
        # The one DP (x CP) reduction of the step. [R, cp, ...] is first viewed as
        # [R * cp, ...] (split over dp x cp: no data moves), so the sum is one collective
        # over the dp x cp group, not one over cp and another over dp.
        n = len(self.acc_axes)
        grads = jax.tree.map(lambda a: jnp.sum(a.reshape(-1, *a.shape[n:]), axis=0), acc)
        return grads, sqnorms_by_key(grads)

    def update(self, params, opt_state, grads, global_norm):
        """The optimizer step on the trainable parts; returns the new parameters (frozen
        parts unchanged), optimizer state and the parameters' squared norms per part."""
        if not self.trainable:  # nothing to update; the norms are still reported
            return params, opt_state, sqnorms_by_key(params)
        old_state, trained = opt_state, split_parts(params, self.trainable)[0]
        # hetjax.clip_by_global_norm in the chain clips with the norm of ALL stages.
        updates, opt_state = self.optimizer.update(
            grads, opt_state, trained, global_norm=global_norm
        )
        new = optax.apply_updates(trained, updates)
        if self.skip_nonfinite:  # every stage sees the same global norm
            keep = ~jnp.isfinite(global_norm)
            new, opt_state = jax.tree.map(
                lambda n, o: jnp.where(keep, o, n), (new, opt_state), (trained, old_state)
            )
        new = {**params, **new}  # frozen parts pass through unchanged
        return new, opt_state, sqnorms_by_key(new)
