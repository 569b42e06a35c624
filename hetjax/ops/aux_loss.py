"""Auxiliary losses that live inside blocks (MoE load balancing) without changing carries.

A block stack is a ``scan`` whose carry is the activation; a per-block auxiliary loss has
no way out of it, and pipeline stages would have to ship it between stages. Instead, as
Megatron's ``MoEAuxLossAutoScaler``, :func:`attach_aux_loss` returns the activation
unchanged and, in the backward pass, seeds the auxiliary loss with the gradient it would
have had if it had been added to the training loss: ``d loss / d aux = loss_scale``
(``1 / global supervised-token count``, from the parallel context). The reported loss
is the language-model loss; the aux term shapes only the gradients.

For results that do not depend on how the batch is split, an aux loss must be a SUM over
samples (like the token-summed cross-entropy): then microbatches, data-parallel
replicas and pipeline stages each add their own part.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hetjax.ops import context as parallel


@jax.custom_vjp
def _attach(x: jax.Array, aux: jax.Array, scale: jax.Array) -> jax.Array:
    return x


def _attach_fwd(x, aux, scale):
    return x, (aux, scale)


def _attach_bwd(res, g):
    aux, scale = res
    return g, jnp.ones_like(aux) * scale.astype(aux.dtype), jnp.zeros_like(scale)


_attach.defvjp(_attach_fwd, _attach_bwd)


def attach_aux_loss(x: jax.Array, aux: jax.Array) -> jax.Array:
    """``x`` unchanged; the backward adds ``aux`` (a scalar SUM over samples) to the loss.

    Outside a parallel context with a loss scale (e.g. plain ``jax.grad`` of a model),
    the scale is 1: the aux term is added to whatever the caller differentiates.
    """
    ctx = parallel.current()
    scale = 1.0 if ctx is None or ctx.loss_scale is None else ctx.loss_scale
    return _attach(x, aux, jnp.asarray(scale, jnp.float32))


def load_balance_loss_per_sample(
    x_BxLxD: jax.Array, router_DxE: jax.Array, top_k: int
) -> jax.Array:
    """Switch/GShard balance loss ``E * sum_e f_e * P_e`` computed per SAMPLE: ``[B]``.

    ``f_e``: fraction of the sample's ``L * top_k`` routing slots sent to expert ``e``;
    ``P_e``: the sample's mean router probability of ``e``. Per-sample (rather than per
    call) so that its sum over samples does not depend on the microbatch or replica split.
    """
    probs_BxLxE = jax.nn.softmax(
        jnp.einsum("bld,de->ble", x_BxLxD.astype(jnp.float32), router_DxE.astype(jnp.float32)),
        axis=-1,
    )
    e = probs_BxLxE.shape[-1]
    _, top_BxLxK = jax.lax.top_k(probs_BxLxE, top_k)
    counts_BxE = jnp.sum(jax.nn.one_hot(top_BxLxK, e, dtype=jnp.float32), axis=(1, 2))
    f_BxE = counts_BxE / (x_BxLxD.shape[1] * top_k)
    p_BxE = jnp.mean(probs_BxLxE, axis=1)
    return e * jnp.sum(f_BxE * p_BxE, axis=-1)
