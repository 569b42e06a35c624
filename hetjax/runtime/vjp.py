"""A stage's forward and backward: ``jax.vjp`` of the stage function, and its residuals.

- **What the backward starts from is the module's activation policy**
  (``ModuleSpec.recompute``). ``none``: the forward runs ``jax.vjp`` of the stage (under
  the same replica vmap as the backward, so every residual carries the replica axis) and
  returns the residuals beside the output; the backward applies them to the cotangent
  and replays nothing. Residuals that ARE parameters (the stacked block weights a scan
  forwards) are not returned: the backward takes them from its own parameter argument,
  so a stash never holds a copy of the weights. ``selective``: the same, with the stage
  function under ``jax.checkpoint(policy=SELECTIVE_POLICY)``: it saves the outputs of
  the weight matmuls (dot_generals without batch dimensions, and dense layers' outputs
  by name: :func:`hetjax.ops.dense` is a custom_vjp, opaque to a policy) and
  recomputes the element-wise ops and the attention core (QK^T, softmax, PV, whose
  dot_generals batch over heads), as Megatron's selective recompute does. ``full``: the
  stage keeps only its input and the backward replays the forward (``jax.vjp`` on the
  stashed input): one input activation per in-flight microbatch, one more forward.
  The sink's last stage runs its forward inside its backward whatever the policy (its
  F only stashes the input), so there the policies differ only inside that one program
  (``selective`` applies the checkpoint policy there too).
- **Frozen parts are constants.** The backward differentiates (``jax.vjp``) only with
  respect to the stage's trainable parts and to the inputs whose gradient some trainable
  parameter upstream needs; frozen parameters are closed over, so XLA emits no
  weight-gradient matmuls for them (through a frozen LLM only activation gradients flow).
  Where a frozen encoder with nothing trainable upstream shares its last stage with a
  trained projector, the forward keeps the encoder's output and the backward starts
  there, so the encoder is not recomputed (``stash_frozen_output``).

Both run per data-parallel replica, and per cp rank where the stage does
(:mod:`hetjax.runtime.replicas`). The residuals' structure (the vjp's tree, which of its
leaves are parameters) is static data of the :class:`Residuals` pytree the traced
forward returns: nothing is written aside while tracing.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from hetjax.ops.dense import DENSE_OUTPUT
from hetjax.runtime.replicas import ReplicaMap
from hetjax.runtime.residuals import Residuals
from hetjax.runtime.stage_fn import StageFunction, split_parts
from hetjax.runtime.update import accumulate

# Checkpoint policy of `selective`: saves dot_generals without batch dimensions (x @ W,
# the weight matmuls) and recomputes the rest. `checkpoint_dots` would also save the
# attention scores (batched over heads: L^2 per head), which selective recompute is
# meant to drop. Dense layers' matmuls are custom_vjp calls (hetjax.ops.dense), which a
# policy does not see into: saved by their name.
SELECTIVE_POLICY = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    jax.checkpoint_policies.save_only_these_names(DENSE_OUTPUT),
)


class StageVjp:
    """The forward and backward programs' bodies of one stage.

    Args:
        fn: the stage function.
        replicas: its replica (and cp rank) mapping.
        trainable: names of the parts trained on this stage (the others are constants).
        backward: whether the stage has a backward at all.
        input_grad: which inputs the backward differentiates: later stages all or
            nothing; a first stage the link inputs named (True: all of them).
        stash_frozen_output: the forward also returns the frozen first part's output,
            which the backward starts from (``TrainGraph.stashes_frozen_output``).
    """

    def __init__(
        self,
        fn: StageFunction,
        replicas: ReplicaMap,
        *,
        trainable: tuple[str, ...],
        backward: bool,
        input_grad: bool | frozenset[str],
        stash_frozen_output: bool,
    ):
        self.fn, self.map, self.trainable = fn, replicas, trainable
        self.input_grad = input_grad
        self.stash_frozen_output = stash_frozen_output
        self.recompute = fn.spec.recompute
        self.loss_stage = fn.is_sink and fn.last
        # The forward returns vjp residuals (none / selective) that the backward consumes.
        # The loss stage's forward runs inside its backward, so it never does.
        self.keeps_residuals = backward and self.recompute != "full" and not self.loss_stage
        # The forward returns (output, what B starts from) instead of the output alone.
        self.forward_stashes = self.keeps_residuals or stash_frozen_output

    def forward(self, params, x, batch, normalizer):
        """The stage output; with :attr:`forward_stashes` also what the backward starts
        from: the frozen first part's output, or the residuals (:class:`Residuals`)."""
        start, m = x, self.map
        if self.stash_frozen_output:
            start = self.fn.apply(params, x, batch, segment="main")
            if not self.keeps_residuals:
                return self.fn.apply(params, start, batch, segment="rest"), start
        if not self.keeps_residuals:
            return self.fn.apply(params, x, batch)

        def replicas(trained, frozen, start, batch):
            own = jax.tree.leaves((trained, frozen))

            def per_replica(x_r, batch_r):
                y, vjp = self._stage_vjp(trained, frozen, x_r, batch_r, normalizer)
                return y, Residuals.of(vjp, own)

            y, res = m.vmap(per_replica)(*m.split((start, batch)))
            return m.merge(y), m.per_rank(res)

        data = (start, batch)
        return m.cp_map(replicas, data, (m.rank_spec, m.rank_spec), self.trainable)(
            *split_parts(params, self.trainable), *data
        )

    def backward(self, params, acc, x, batch, g_out, normalizer):
        """Runs the stage forward from its stashed input under ``jax.vjp`` (``full``: a
        replay; the loss stage in every policy: its only forward) and accumulates the
        per-replica parameter gradient into ``acc`` (None: the step's one backward of
        the stage, whose gradient is the step's: :func:`accumulate`)."""
        m = self.map

        def replicas(trained, frozen, x, batch, g_out):
            def per_replica(x_r, batch_r, g_r):
                y, vjp = self._stage_vjp(trained, frozen, x_r, batch_r, normalizer)
                cot = jnp.ones_like(y) if g_r is None else g_r
                gp, gx = vjp(cot)
                loss = y if self.loss_stage else jnp.zeros((), jnp.float32)
                return gp, gx, loss

            gp, gx, loss = m.vmap(per_replica)(*m.split((x, batch, g_out)))
            gx = m.sum_whole_over_cp(m.merge(gx))
            return m.per_rank(gp), gx, m.per_rank(jnp.sum(loss))

        data = (x, batch, g_out)
        x_diff = self._split_input(x)[0]
        out_specs = (m.grad_specs(self.trainable), m.seq_specs(x_diff), m.loss_spec)
        gp, gx, loss = m.cp_map(replicas, data, out_specs, self.trainable)(
            *split_parts(params, self.trainable), *data
        )
        return accumulate(acc, gp), gx, jnp.sum(loss)

    def backward_residuals(self, params, acc, res, batch, g_out, normalizer):
        """Applies the forward's residuals to the output cotangent (``none`` /
        ``selective``): nothing of the forward runs again. ``batch`` and ``normalizer``
        are unused (the residuals hold what they contributed); the signature is the
        other backward's."""
        del batch, normalizer
        m = self.map

        def replicas(trained, frozen, res, g_out):
            own = jax.tree.leaves((trained, frozen))

            def per_replica(res_r, g_r):
                return res_r.vjp(own)(g_r)

            (g_out,) = m.split((g_out,))
            gp, gx = m.vmap(per_replica)(m.of_rank(res), g_out)
            return m.per_rank(gp), m.sum_whole_over_cp(m.merge(gx))

        data = (res, g_out)
        out_specs = (m.grad_specs(self.trainable), m.rank_spec)
        gp, gx = m.cp_map(replicas, data, out_specs, self.trainable)(
            *split_parts(params, self.trainable), *data
        )
        return accumulate(acc, gp), gx, jnp.zeros((), jnp.float32)

    def _stage_vjp(self, trained, frozen, x_r, batch_r, normalizer):
        """``jax.vjp`` of one replica's stage function with respect to the trainable
        parameters and the differentiated inputs (frozen parameters and the other inputs
        are constants); on the sink's last stage of the loss over ``normalizer``."""
        x_diff, rebuild = self._split_input(x_r)

        def f(p, xd):
            y = self.fn.apply(
                {**frozen, **p},
                rebuild(xd),
                batch_r,
                per_replica=True,
                loss_scale=1.0 / normalizer,
                segment="rest" if self.stash_frozen_output else "all",
            )
            return y / normalizer if self.loss_stage else y

        if self.recompute == "selective":
            f = jax.checkpoint(f, policy=SELECTIVE_POLICY)
        return jax.vjp(f, trained, x_diff)

    def _split_input(self, x: Any) -> tuple[Any, Any]:
        """The stage input's parts to differentiate, and how to rebuild the input from
        them (the rest are constants of the backward)."""
        if isinstance(x, dict):
            names = set(x) if self.input_grad is True else set(self.input_grad or ())
            const = {k: v for k, v in x.items() if k not in names}
            return {k: v for k, v in x.items() if k in names}, lambda d: {**d, **const}
        if self.input_grad:
            return x, lambda d: d
        return None, lambda _: x
