"""A dense layer's matmul whose weight gradient is written in the weight's dtype.

``x @ W`` in a mixed-precision model casts the float32 master kernel to the compute
dtype (bf16) first. Differentiated by ``jax.vjp``, the kernel's cotangent is then a bf16
matmul (the transpose of a bf16 ``dot_general`` keeps its output type) followed by a
convert to float32: the weight gradient is rounded to bf16, and the convert is a pass
over a weight-sized array that XLA cannot fold into the matmul. :func:`dense` computes the
same forward, but its backward writes the kernel's cotangent from the bf16 operands
straight into float32 (``preferred_element_type``, what cuBLAS does with a float32
output and bf16 inputs): no rounding, no convert, and a gradient accumulator in float32
can take the matmul's output as it is (XLA:GPU folds ``acc + dot`` into the gemm's
``beta = 1`` where the two meet in one computation).

Its residuals are the (cast) input and the float32 kernel itself, not the kernel's bf16
copy that ``jax.vjp`` of the plain form keeps: a stage's stash drops residuals that are
its own parameters (:class:`hetjax.runtime.vjp.Residuals`), so no per-microbatch copy of
the weights is held; the backward casts the kernel again. In float32 the maths is the
plain form's (every cast is the identity).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

__all__ = ["DENSE_OUTPUT", "dense"]


# The checkpoint name of every dense output. A remat policy sees a custom_vjp as one
# opaque call, not as the matmul inside (``dots_with_no_batch_dims_saveable`` would
# recompute it): selective recompute saves this name as well
# (:data:`hetjax.runtime.vjp.SELECTIVE_POLICY`).
DENSE_OUTPUT = "hetjax_dense"


def dense(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """``x @ kernel`` in ``x``'s dtype, contracting ``x``'s last axis with ``kernel``'s
    first (``kernel`` is ``[d_in, *d_out]``, the output ``[..., *d_out]``).

    Args:
        x: activations ``[..., d_in]``, already in the compute dtype.
        kernel: weights ``[d_in, *d_out]``, any floating dtype (float32 master weights).

    Returns:
        ``[..., *d_out]`` in ``x``'s dtype, named :data:`DENSE_OUTPUT` for remat
        policies. The kernel's cotangent comes out in ``kernel``'s dtype directly from
        the matmul.
    """
    return checkpoint_name(_dense(x, kernel), DENSE_OUTPUT)


@jax.custom_vjp
def _dense(x, kernel):
    return jnp.tensordot(x, kernel.astype(x.dtype), axes=1)


def _dense_fwd(x, kernel):
    return _dense(x, kernel), (x, kernel)


def _dense_bwd(res, g):
    x, kernel = res
    w = kernel.astype(x.dtype)
    lead, out = x.ndim - 1, kernel.ndim - 1
    # dx [..., d_in]: g's output axes against the kernel's.
    dx = lax.dot_general(
        g, w, ((tuple(range(lead, lead + out)), tuple(range(1, 1 + out))), ((), ()))
    )
    # dW [d_in, *d_out]: g's and x's leading (token) axes contracted, written in the
    # kernel's dtype by the matmul itself. Operands in the order jax.vjp's transpose
    # puts them ([*d_out, d_in], then transposed): float32 gradients are bit-identical.
    tokens = tuple(range(lead))
    dw = lax.dot_general(g, x, ((tokens, tokens), ((), ())), preferred_element_type=kernel.dtype)
    return dx.astype(x.dtype), jnp.moveaxis(dw, -1, 0)


_dense.defvjp(_dense_fwd, _dense_bwd)
