"""The reference trainer: one mesh, plain data parallelism, gradient accumulation.

Every heterogeneous layout is checked against this trainer, so its loss is exactly
defined: the model's summed cross-entropy over the supervised tokens of each
microbatch, divided by the supervised-token count of the GLOBAL batch, summed over
microbatches. That is the mean over all supervised tokens of the step, independent of
the microbatch count and the data-parallel degree (up to float reordering).

The whole step (microbatch scan, gradient reduction, clipping, AdamW) is one jit on a
1-D ``("dp",)`` mesh; with one device it is the single-device reference.

Frozen modules (``frozen``) are constants of the gradient and the optimizer sees only
the trainable subtree: its state, its clipping norm and its updates are those of the
executor with the same parts frozen, so both give the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hetjax.ops.context import parallel_context
from hetjax.runtime.optim import tree_norm
from hetjax.runtime.reduce import StepMetrics

Batch = Mapping[str, jax.Array]
LossSumFn = Callable[[Any, Batch], jax.Array]


def tree_norms(tree: Mapping[str, Any], prefix: str) -> dict[str, jax.Array]:
    """``{prefix/<top-level key>: global L2 norm of that subtree}``."""
    return {f"{prefix}/{k}": optax.global_norm(v) for k, v in tree.items()}


def split_microbatches(batch: Batch, microbatches: int) -> Batch:
    """``[B, ...]`` -> ``[M, B / M, ...]``; microbatch ``m`` is samples ``[m*B/M, (m+1)*B/M)``."""
    return {
        k: v.reshape(microbatches, v.shape[0] // microbatches, *v.shape[1:])
        for k, v in batch.items()
    }


def check_batch_split(global_batch: int, microbatches: int, dp: int) -> None:
    if microbatches < 1 or global_batch % microbatches:
        raise ValueError(
            f"global_batch={global_batch} is not divisible by microbatches={microbatches}; "
            "pick a microbatch count that divides the batch"
        )
    if (global_batch // microbatches) % dp:
        raise ValueError(
            f"microbatch size {global_batch // microbatches} (global batch {global_batch} / "
            f"{microbatches} microbatches) is not divisible by {dp} data-parallel devices; "
            f"use a global batch that is a multiple of {microbatches * dp}"
        )


class ReferenceTrainer:
    """Data-parallel training of ``params`` under ``loss_sum_fn`` with ``optimizer``.

    Args:
        loss_sum_fn: ``(params, microbatch) -> summed loss`` over its supervised tokens.
        params: initial parameters, a dict keyed by module name.
        optimizer: an optax transformation.
        devices: devices of the 1-D data-parallel mesh (one device: no parallelism).
        microbatches: gradient-accumulation steps per global batch.
        mask_key: batch key whose sum over the global batch is the loss normaliser.
        frozen: top-level keys of ``params`` not trained (no gradient, no optimizer
            state; ``optimizer`` is applied to the other keys' subtree only).
        compiler_options: XLA options for the step's compile, as ``jax.jit``'s (e.g.
            ``{"xla_backend_optimization_level": 1}``); None: the process's defaults.
    """

    def __init__(
        self,
        loss_sum_fn: LossSumFn,
        params: Mapping[str, Any],
        optimizer: optax.GradientTransformation,
        *,
        devices: Sequence[jax.Device],
        microbatches: int = 1,
        mask_key: str = "loss_mask",
        frozen: Collection[str] = (),
        compiler_options: Mapping[str, Any] | None = None,
    ):
        unknown = sorted(set(frozen) - set(params))
        if unknown:
            raise ValueError(f"frozen names {unknown}, which are not keys of params {list(params)}")
        self.trainable_keys = tuple(k for k in params if k not in frozen)
        if not self.trainable_keys:
            raise ValueError("frozen names every module, so nothing would train; unfreeze one")
        self.mesh = Mesh(np.asarray(devices), ("dp",))
        self.microbatches = microbatches
        self.optimizer = optimizer
        replicated = NamedSharding(self.mesh, P())
        self._batch_sharding = NamedSharding(self.mesh, P(None, "dp"))
        # A copy: the step donates its parameters, and the caller may still hold `params`.
        # (`device_put(..., may_alias=False)` is not enough: onto a multi-device mesh it
        # still reuses the caller's buffer for the shard on the array's own device.)
        self.params = jax.device_put(
            jax.tree.map(lambda a: jnp.array(a, copy=True), params), replicated
        )
        self.opt_state = jax.jit(optimizer.init, out_shardings=replicated)(
            self.trainable(self.params)
        )

        def train_step(params, opt_state, batch_MxB):
            normalizer = jnp.maximum(jnp.sum(batch_MxB[mask_key]), 1.0)
            trained = self.trainable(params)
            constants = {k: v for k, v in params.items() if k not in trained}

            def loss_fn(p, mb):
                # Aux losses inside blocks (MoE balancing) take their gradient scale here.
                with parallel_context(None, batch_axes=None, loss_scale=1.0 / normalizer):
                    return loss_sum_fn({**constants, **p}, mb) / normalizer

            grad_fn = jax.value_and_grad(loss_fn)

            def accumulate(carry, mb):
                loss, grads = carry
                mb_loss, mb_grads = grad_fn(trained, mb)
                return (loss + mb_loss, jax.tree.map(jnp.add, grads, mb_grads)), None

            zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, trained))
            (loss, grads), _ = jax.lax.scan(accumulate, zeros, batch_MxB)
            updates, opt_state = optimizer.update(grads, opt_state, trained)
            params = {**params, **optax.apply_updates(trained, updates)}
            metrics = {
                "loss": loss,
                "grad_norm": tree_norm(grads),
                **tree_norms(grads, "grad_norm"),
                **tree_norms(params, "param_norm"),
                "supervised_tokens": normalizer,
            }
            return params, opt_state, metrics

        self._step = jax.jit(train_step, donate_argnums=(0, 1), compiler_options=compiler_options)

    def trainable(self, tree: Mapping[str, Any]) -> dict[str, Any]:
        """The trainable modules' subtree of a ``params``-shaped tree."""
        return {k: tree[k] for k in self.trainable_keys}

    @property
    def num_devices(self) -> int:
        return self.mesh.size

    def shard_batch(self, batch: Mapping[str, np.ndarray]) -> Batch:
        """Host batch ``[B, ...]`` -> device arrays ``[M, B/M, ...]`` sharded over ``dp``."""
        b = next(iter(batch.values())).shape[0]
        check_batch_split(b, self.microbatches, self.num_devices)
        return jax.device_put(split_microbatches(batch, self.microbatches), self._batch_sharding)

    def lower(self, batch: Mapping[str, np.ndarray]) -> jax.stages.Lowered:
        """The fused step lowered for ``batch`` (what benchmarks compare FLOPs with)."""
        return self._step.lower(self.params, self.opt_state, self.shard_batch(batch))

    def step(self, batch: Mapping[str, np.ndarray]) -> StepMetrics:
        """One optimiser step; returns its metrics (read from the device when first used)."""
        self.params, self.opt_state, metrics = self._step(
            self.params, self.opt_state, self.shard_batch(batch)
        )
        return StepMetrics(metrics)
