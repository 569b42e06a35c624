"""The K/V ring with cuDNN's fused kernel for every block (bf16/f16 on a GPU).

The plain ring (:mod:`hetjax.ops.ring_kernels`) folds each arriving K/V block into an
online softmax with XLA maths, so every step materialises a float32 ``[L/cp, L/cp]``
score block. Here each block is one call of cuDNN's flash kernel, which returns the
block's output and the log-sum-exp of its scores (cuDNN's float32 softmax statistics);
blocks are merged by their log-sum-exp:

    lse = logaddexp(lse_a, lse_b),  out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b.

The backward runs cuDNN's backward kernel per block with the *merged* output and
log-sum-exp (the scheme of ring flash attention): the kernel recomputes the block's
probabilities from the merged statistics, which are the block's share of the full
softmax, so the per-block ``dq, dk, dv`` add up to the full gradients. ``jax.nn``'s
public ``dot_product_attention`` returns the log-sum-exp only rounded to the output
dtype and does not differentiate it, so the blocks bind JAX's cuDNN primitives
(``jax._src.cudnn.fused_attention_stablehlo``, unchanged from jax 0.10 to 0.11) directly.

A block is fused only where its mask is one of the kernel's: the zigzag ring's diagonal
block is causal by storage index (each rank's two chunks are in position order) and its
off-diagonal half-blocks are unmasked; a non-causal (encoder) ring is unmasked
throughout. Rings with other positions or with packed rows keep the plain blocks.

``implementation="xla"`` runs the same block contract in XLA maths, so the merge and the
zigzag half-blocks are tested on CPU against the plain ring in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hetjax.ops.fused_attention import Implementation, block_attention, block_gradients
from hetjax.ops.ring_kernels import _block_backward, _block_forward, _halves, _ring_loop, _ring_perm


def _xla_positions(lq: int, s: int, causal: bool) -> tuple[jax.Array, jax.Array]:
    """Positions whose mask ``q_pos >= k_pos`` is the kernel's: causal by index, or none."""
    if causal:
        return jnp.arange(lq), jnp.arange(s)
    return jnp.zeros(lq, jnp.int32), jnp.zeros(s, jnp.int32)


def block_forward(
    q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, implementation: Implementation
) -> tuple[jax.Array, jax.Array]:
    """One block: ``(out [b, lq, H, K]`` in q's dtype, ``lse [b, lq, H]`` float32)."""
    b, lq, h, d = q.shape
    if implementation == "cudnn":
        out, stats_BxHxL = block_attention(q, k, v, causal=causal)
        return out, jnp.transpose(stats_BxHxL, (0, 2, 1))
    g = k.shape[2]
    r = h // g
    m = jnp.full((b, g, r, lq), -jnp.inf, jnp.float32)
    acc = jnp.zeros((b, g, r, lq, d), jnp.float32)
    qpos, kpos = _xla_positions(lq, k.shape[1], causal)
    q5 = q.reshape(b, lq, g, r, d)
    m, l, acc = _block_forward(q5, k, v, qpos, kpos, m, jnp.zeros_like(m), acc)
    out = jnp.transpose(acc / l[..., None], (0, 3, 1, 2, 4)).reshape(b, lq, h, d)
    return out.astype(q.dtype), jnp.transpose(m + jnp.log(l), (0, 3, 1, 2)).reshape(b, lq, h)


def block_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    dout: jax.Array,
    *,
    causal: bool,
    implementation: Implementation,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One block's ``(dq, dk, dv)`` given the merged ``out`` and ``lse`` of its queries."""
    if implementation == "cudnn":
        stats_BxHxL = jnp.transpose(lse, (0, 2, 1))
        return block_gradients(q, k, v, out, stats_BxHxL, dout, causal=causal)
    b, lq, h, d = q.shape
    g = k.shape[2]
    r = h // g
    to5 = lambda x: x.reshape(b, lq, g, r, d)
    lse_bxgxrxl = jnp.transpose(lse.reshape(b, lq, g, r), (0, 2, 3, 1))
    do5 = to5(dout).astype(jnp.float32)
    delta = jnp.transpose(jnp.sum(do5 * to5(out).astype(jnp.float32), -1), (0, 2, 3, 1))
    qpos, kpos = _xla_positions(lq, k.shape[1], causal)
    dq5, dk, dv = _block_backward(to5(q), k, v, qpos, kpos, do5, lse_bxgxrxl, delta)
    return dq5.reshape(q.shape), dk, dv


def _merge(state, out_b, lse_b):
    """Folds a block's ``(out, lse)`` into the running ``(out f32, lse)`` of its queries."""
    out_a, lse_a = state
    lse = jnp.logaddexp(lse_a, lse_b)
    w_a, w_b = jnp.exp(lse_a - lse)[..., None], jnp.exp(lse_b - lse)[..., None]
    return out_a * w_a + out_b.astype(jnp.float32) * w_b, lse


def _upper(x):
    return _halves(x, 1)[1]


def fused_ring_forward(q, k, v, qpos, kpos, *, axis, cp, zigzag, causal, implementation):
    """Per-rank forward of the fused ring: ``out [b, lq, H, K]``, ``lse [b, lq, H]``.

    Same contract as :func:`hetjax.ops.ring_kernels._ring_forward_kernel`; the positions
    are not read (the masks are the kernel's, see the module docstring)."""
    del qpos, kpos
    b, lq, h, d = q.shape
    state = (jnp.zeros((b, lq, h, d), jnp.float32), jnp.full((b, lq, h), -jnp.inf, jnp.float32))
    rank = jax.lax.axis_index(axis)
    blk = lambda q, k, v, causal=False: block_forward(
        q, k, v, causal=causal, implementation=implementation
    )

    def earlier(args):  # an earlier rank's block: every query sees its first half
        k_s, v_s, state = args
        return _merge(state, *blk(q, _halves(k_s, 1)[0], _halves(v_s, 1)[0]))

    def later(args):  # a later rank's block: only the second local chunk sees it, whole
        k_s, v_s, (out, lse) = args
        out_hi, lse_hi = _merge((_upper(out), _upper(lse)), *blk(_upper(q), k_s, v_s))
        lo = lq // 2
        return out.at[:, lo:].set(out_hi), lse.at[:, lo:].set(lse_hi)

    def step_fn(step, block, state):
        k_s, v_s, _ = block
        if isinstance(step, int) and step == 0:
            return _merge(state, *blk(q, k_s, v_s, causal))
        if not zigzag:
            return _merge(state, *blk(q, k_s, v_s))
        return jax.lax.cond((rank - step) % cp < rank, earlier, later, (k_s, v_s, state))

    out, lse = _ring_loop(step_fn, (k, v, None), state, axis=axis, cp=cp)
    return out.astype(q.dtype), lse


def fused_ring_backward(
    q, k, v, qpos, kpos, out, lse, dout, *, axis, cp, zigzag, causal, implementation
):
    """Per-rank backward of the fused ring (the contract of
    :func:`hetjax.ops.ring_kernels._ring_backward_kernel`): K/V travel the ring again and
    their float32 gradient accumulators follow one hop behind, back to their owner."""
    del qpos, kpos
    rank = jax.lax.axis_index(axis)
    perm = _ring_perm(cp)
    blk = lambda q, k, v, out, lse, dout, causal=False: block_backward(
        q, k, v, out, lse, dout, causal=causal, implementation=implementation
    )
    f32 = lambda *xs: tuple(x.astype(jnp.float32) for x in xs)

    def earlier(args):
        k_s, v_s = args
        dq, dk_lo, dv_lo = f32(*blk(q, _halves(k_s, 1)[0], _halves(v_s, 1)[0], out, lse, dout))
        zeros = jnp.zeros_like(dk_lo)
        return dq, jnp.concatenate([dk_lo, zeros], 1), jnp.concatenate([dv_lo, zeros], 1)

    def later(args):
        k_s, v_s = args
        dq_hi, dk, dv = f32(*blk(_upper(q), k_s, v_s, _upper(out), _upper(lse), _upper(dout)))
        return jnp.concatenate([jnp.zeros_like(dq_hi), dq_hi], 1), dk, dv

    def step_fn(step, block, state):
        k_s, v_s, _ = block
        dq, dk, dv = state
        if isinstance(step, int) and step == 0:
            dq_s, dk_s, dv_s = f32(*blk(q, k_s, v_s, out, lse, dout, causal))
        elif not zigzag:
            dq_s, dk_s, dv_s = f32(*blk(q, k_s, v_s, out, lse, dout))
        else:
            dq_s, dk_s, dv_s = jax.lax.cond((rank - step) % cp < rank, earlier, later, (k_s, v_s))
        dk, dv = jax.lax.ppermute((dk + dk_s, dv + dv_s), axis, perm)
        return dq + dq_s, dk, dv

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
    dq, dk, dv = _ring_loop(step_fn, (k, v, None), (zeros(q), zeros(k), zeros(v)), axis=axis, cp=cp)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
