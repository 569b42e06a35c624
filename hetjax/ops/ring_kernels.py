"""The maths of context-parallel attention: single-device causal attention and the
per-rank kernels ``ring_attention`` runs inside ``shard_map`` (online-softmax blocks, the
zigzag half-block steps, the K/V ring loop and its backward, the all-gather variant).

Split from :mod:`hetjax.ops.ring_attention`, which holds the public entry point, its
argument checks and the custom VJP; the shape key is the one documented there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hetjax.ops.fused_attention import (
    Kernel,
    bias_fused_applies,
    fused_attention_applies,
    masked_fused_attention,
    packed_fused_attention,
)

# A token's mask tag: its position ``[L]``/``[B, L]``, or for packed rows the pair
# ``(positions, segment_ids)``; K/V blocks travel the ring with their keys' tags.
Tag = jax.Array | tuple[jax.Array, jax.Array]

# -- single-device maths ----------------------------------------------------------------


def _batched_positions(pos: jax.Array) -> jax.Array:
    """``[L]`` or ``[B, L]`` -> ``[B or 1, L]``."""
    return pos[None] if pos.ndim == 1 else pos


def _mask_bx1x1xlxs(qtag: Tag, ktag: Tag) -> jax.Array:
    """Which keys each query sees: ``q_pos >= k_pos``, and for packed rows (a tag
    ``(positions, segment_ids)``) only keys of the query's own segment."""
    if not isinstance(qtag, tuple):
        q, k = _batched_positions(qtag), _batched_positions(ktag)
        return q[:, None, None, :, None] >= k[:, None, None, None, :]
    (qpos, qseg), (kpos, kseg) = qtag, ktag
    qs, ks = _batched_positions(qseg), _batched_positions(kseg)
    same = qs[:, None, None, :, None] == ks[:, None, None, None, :]
    return _mask_bx1x1xlxs(qpos, kpos) & same


def tag(positions: jax.Array, segment_ids: jax.Array | None) -> Tag:
    """What the mask reads per token: its position, or ``(position, segment id)``."""
    return positions if segment_ids is None else (positions, segment_ids)


def causal_attention(
    q_BxLxHxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxGxK: jax.Array,
    q_positions: Tag,
    k_positions: Tag | None = None,
    *,
    segment_ids: jax.Array | None = None,
    kernel: Kernel | None = None,
    max_segments: int | None = None,
) -> jax.Array:
    """Causal GQA attention with the mask taken from positions (``q_pos >= k_pos``).

    The single-device path of :func:`ring_attention` (``cp == 1``), packed rows' attention
    and the local maths of the all-gather ring; differentiated by autodiff. Softmax in
    float32.

    On a GPU, bf16/f16 inputs take cuDNN's fused kernel (:mod:`hetjax.ops.fused_attention`),
    which never materialises the ``[H, L, S]`` scores (the plain path's float32 scores are
    10.7 GB per layer at 40 heads and sequence 8192): packed rows with a ``max_segments``
    bound through cuDNN's packed layout (each sample causal on its own, no bias); other
    positions as an additive bias (the full square is computed; even lengths only).
    Attention whose positions are ``0 .. L-1`` is :func:`hetjax.ops.attention.attention`'s
    job (the kernel's own causal mask). ``HETJAX_FUSED_ATTENTION=0`` turns fusion off;
    float32 inputs (the parity tests) and CPUs always take the plain path.

    Args:
        q_BxLxHxK: queries. k_BxSxGxK, v_BxSxGxK: keys and values, ``G`` divides ``H``.
        q_positions: ``[L]`` or ``[B, L]`` original positions of the queries (or their
            :func:`tag`, ``(positions, segment_ids)``).
        k_positions: the same for the keys; defaults to ``q_positions``.
        segment_ids: ``[B, L]`` packed rows' sample ids (queries and keys alike): a query
            sees only keys of its own segment. Positions then restart per segment.
        kernel: ``"plain"``, ``"cudnn"`` or ``"xla"`` (the fused call in XLA maths, for
            tests); None: ``"cudnn"`` where it applies, else ``"plain"``.
        max_segments: a bound on every row's segments (the packer's samples per row):
            lets packed rows use cuDNN's packed layout instead of a bias.

    Returns:
        ``[B, L, H, K]`` in the dtype of ``q``.
    """
    packed = segment_ids is not None and max_segments is not None and k_positions is None
    if kernel is None:
        fits = fused_attention_applies if packed else bias_fused_applies
        kernel = "cudnn" if fits(q_BxLxHxK, k_BxSxGxK) else "plain"
    if kernel != "plain" and packed:
        return packed_fused_attention(
            q_BxLxHxK,
            k_BxSxGxK,
            v_BxSxGxK,
            segment_ids,
            max_segments=max_segments,
            implementation=kernel,
        )
    q_positions = tag(q_positions, segment_ids)
    k_positions = q_positions if k_positions is None else k_positions
    mask_Bx1x1xLxS = _mask_bx1x1xlxs(q_positions, k_positions)
    if kernel != "plain":
        return masked_fused_attention(
            q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_Bx1x1xLxS[:, 0], implementation=kernel
        )
    b, l, h, d = q_BxLxHxK.shape
    g = k_BxSxGxK.shape[2]
    q_BxLxGxRxK = q_BxLxHxK.reshape(b, l, g, h // g, d)
    s = jnp.einsum("blgrk,bsgk->bgrls", q_BxLxGxRxK, k_BxSxGxK, preferred_element_type=jnp.float32)
    s = s / jnp.sqrt(jnp.float32(d))
    s = jnp.where(mask_Bx1x1xLxS, s, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(s, axis=-1).astype(v_BxSxGxK.dtype)
    out = jnp.einsum("bgrls,bsgk->blgrk", probs, v_BxSxGxK)
    return out.reshape(b, l, h, d).astype(q_BxLxHxK.dtype)


# -- ring kernels (run per rank inside shard_map) ---------------------------------------


def _block_forward(q5, k, v, qpos, kpos, m, l, acc):
    """Folds one K/V block into the online-softmax state ``(m, l, acc)`` of ``q5``.

    q5 ``[b, lq, g, r, K]``; k, v ``[b, s, g, K]``; m, l ``[b, g, r, lq]``;
    acc ``[b, g, r, lq, K]`` (float32). Masked scores are ``-inf`` so they add exactly 0.
    """
    d = q5.shape[-1]
    s = jnp.einsum("blgrk,bsgk->bgrls", q5, k, preferred_element_type=jnp.float32)
    s = jnp.where(_mask_bx1x1xlxs(qpos, kpos), s / jnp.sqrt(jnp.float32(d)), -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # rows with nothing visible yet
    p = jnp.exp(s - m_safe[..., None])
    corr = jnp.exp(m - m_safe)
    l = l * corr + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bgrls,bsgk->bgrlk", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, l, acc * corr[..., None] + pv


def _block_backward(q5, k, v, qpos, kpos, do5, lse, delta):
    """Gradients of one block: ``(dq5, dk, dv)`` in float32 given the final ``lse``.

    do5 ``[b, lq, g, r, K]``; lse, delta ``[b, g, r, lq]``.
    """
    d = q5.shape[-1]
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    s = jnp.einsum("blgrk,bsgk->bgrls", q5, k, preferred_element_type=jnp.float32) * scale
    p = jnp.where(_mask_bx1x1xlxs(qpos, kpos), jnp.exp(s - lse[..., None]), 0.0)
    f32 = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
    dv = f32("bgrls,blgrk->bsgk", p, do5)
    dp = f32("blgrk,bsgk->bgrls", do5, v)
    ds = p * (dp - delta[..., None]) * scale
    dq5 = f32("bgrls,bsgk->blgrk", ds, k)
    dk = f32("bgrls,blgrk->bsgk", ds, q5)
    return dq5, dk, dv


def _halves(x, axis):
    n = x.shape[axis] // 2
    return jax.lax.slice_in_dim(x, 0, n, axis=axis), jax.lax.slice_in_dim(x, n, 2 * n, axis=axis)


def _pos_halves(pos: Tag) -> tuple[Tag, Tag]:
    if isinstance(pos, tuple):
        (p_lo, p_hi), (s_lo, s_hi) = (_pos_halves(p) for p in pos)
        return (p_lo, s_lo), (p_hi, s_hi)
    return _halves(pos, pos.ndim - 1)


def _zigzag_forward_step(src, rank, q5, k, v, qpos, kpos, m, l, acc):
    """Off-diagonal zigzag step: only the visible half of the block is computed.

    Source rank ``src < rank``: its first chunk precedes both local chunks and its second
    follows both, so all queries see only the first half of the keys. ``src > rank``:
    only the second local chunk sees anything, and it sees all keys.
    """

    def earlier(args):
        q5, k, v, qpos, kpos, m, l, acc = args
        return _block_forward(
            q5, _halves(k, 1)[0], _halves(v, 1)[0], qpos, _pos_halves(kpos)[0], m, l, acc
        )

    def later(args):
        q5, k, v, qpos, kpos, m, l, acc = args
        q_hi, m_hi, l_hi, acc_hi = (
            _halves(q5, 1)[1],
            _halves(m, 3)[1],
            _halves(l, 3)[1],
            _halves(acc, 3)[1],
        )
        m_hi, l_hi, acc_hi = _block_forward(
            q_hi, k, v, _pos_halves(qpos)[1], kpos, m_hi, l_hi, acc_hi
        )
        return (
            jnp.concatenate([_halves(m, 3)[0], m_hi], axis=3),
            jnp.concatenate([_halves(l, 3)[0], l_hi], axis=3),
            jnp.concatenate([_halves(acc, 3)[0], acc_hi], axis=3),
        )

    return jax.lax.cond(src < rank, earlier, later, (q5, k, v, qpos, kpos, m, l, acc))


def _zigzag_backward_step(src, rank, q5, k, v, qpos, kpos, do5, lse, delta):
    """Backward of :func:`_zigzag_forward_step`; zero gradients where nothing is visible."""

    def earlier(args):
        q5, k, v, qpos, kpos, do5, lse, delta = args
        dq5, dk_lo, dv_lo = _block_backward(
            q5, _halves(k, 1)[0], _halves(v, 1)[0], qpos, _pos_halves(kpos)[0], do5, lse, delta
        )
        zeros = jnp.zeros_like(dk_lo)
        return dq5, jnp.concatenate([dk_lo, zeros], 1), jnp.concatenate([dv_lo, zeros], 1)

    def later(args):
        q5, k, v, qpos, kpos, do5, lse, delta = args
        dq_hi, dk, dv = _block_backward(
            _halves(q5, 1)[1],
            k,
            v,
            _pos_halves(qpos)[1],
            kpos,
            _halves(do5, 1)[1],
            _halves(lse, 3)[1],
            _halves(delta, 3)[1],
        )
        return jnp.concatenate([jnp.zeros_like(dq_hi), dq_hi], 1), dk, dv

    return jax.lax.cond(src < rank, earlier, later, (q5, k, v, qpos, kpos, do5, lse, delta))


def _ring_perm(cp: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % cp) for i in range(cp)]


def _ring_loop(step_fn, block, state, *, axis: str, cp: int):
    """Runs ``state = step_fn(step, block, state)`` for ``step = 0 .. cp-1``, where
    ``block`` at step ``s`` came from rank ``rank - s``; ``cp - 1`` ppermutes in all.

    Steps ``1 .. cp-2`` are a ``lax.scan``: a loop keeps at most two K/V blocks and one
    step's scores live on any backend (an unrolled loop lets XLA's scheduler hoist every
    hop and every block's maths, i.e. ``O(L)`` K/V and ``O(cp)`` score blocks per rank).
    Inside one iteration the transfer of the next block is independent of this block's
    maths, so they can overlap. Step 0 (the diagonal block) and step ``cp-1`` (whose
    block is not passed on) are peeled, so exactly ``cp - 1`` hops are made.
    """
    if cp == 1:  # the diagonal block is all there is
        return step_fn(0, block, state)
    perm = _ring_perm(cp)
    nxt = jax.lax.ppermute(block, axis, perm)
    state = step_fn(0, block, state)

    def body(carry, step):
        block, state = carry
        nxt = jax.lax.ppermute(block, axis, perm)
        return (nxt, step_fn(step, block, state)), None

    if cp > 2:
        (nxt, state), _ = jax.lax.scan(body, (nxt, state), jnp.arange(1, cp - 1))
    return step_fn(cp - 1, nxt, state)


def _ring_forward_kernel(q, k, v, qpos, kpos, *, axis: str, cp: int, zigzag: bool):
    """Per-rank forward: returns ``out [b, lq, H, K]`` and ``lse [b, lq, H]`` (float32)."""
    b, lq, h, d = q.shape
    g = k.shape[2]
    q5 = q.reshape(b, lq, g, h // g, d)
    m = jnp.full((b, g, h // g, lq), -jnp.inf, jnp.float32)
    l = jnp.zeros((b, g, h // g, lq), jnp.float32)
    acc = jnp.zeros((b, g, h // g, lq, d), jnp.float32)
    rank = jax.lax.axis_index(axis)

    def step_fn(step, block, state):
        k_s, v_s, kpos_s = block
        if zigzag and not (isinstance(step, int) and step == 0):
            src = (rank - step) % cp
            return _zigzag_forward_step(src, rank, q5, k_s, v_s, qpos, kpos_s, *state)
        return _block_forward(q5, k_s, v_s, qpos, kpos_s, *state)

    m, l, acc = _ring_loop(step_fn, (k, v, kpos), (m, l, acc), axis=axis, cp=cp)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    lse = m + jnp.log(l)
    out_bxlxhxk = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, lq, h, d).astype(q.dtype)
    return out_bxlxhxk, jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, lq, h)


def _ring_backward_kernel(q, k, v, qpos, kpos, out, lse, dout, *, axis: str, cp: int, zigzag: bool):
    """Per-rank backward: K/V travel the ring as in the forward, and their gradient
    accumulators travel with them, one hop behind, arriving back at the owner rank after
    the last step (``cp`` hops)."""
    b, lq, h, d = q.shape
    g = k.shape[2]
    r = h // g
    q5 = q.reshape(b, lq, g, r, d)
    do5 = dout.reshape(b, lq, g, r, d).astype(jnp.float32)
    delta = jnp.sum(do5 * out.reshape(b, lq, g, r, d).astype(jnp.float32), axis=-1)
    delta = jnp.transpose(delta, (0, 2, 3, 1))
    lse = jnp.transpose(lse.reshape(b, lq, g, r), (0, 2, 3, 1))
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows that see nothing have p == 0
    rank = jax.lax.axis_index(axis)
    perm = _ring_perm(cp)

    def step_fn(step, block, state):
        k_s, v_s, kpos_s = block
        dq5, dk, dv = state
        if zigzag and not (isinstance(step, int) and step == 0):
            src = (rank - step) % cp
            dq_s, dk_s, dv_s = _zigzag_backward_step(
                src, rank, q5, k_s, v_s, qpos, kpos_s, do5, lse, delta
            )
        else:
            dq_s, dk_s, dv_s = _block_backward(q5, k_s, v_s, qpos, kpos_s, do5, lse, delta)
        dk, dv = jax.lax.ppermute((dk + dk_s, dv + dv_s), axis, perm)
        return dq5 + dq_s, dk, dv

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
    dq5, dk, dv = _ring_loop(
        step_fn, (k, v, kpos), (zeros(q5), zeros(k), zeros(v)), axis=axis, cp=cp
    )
    return dq5.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _allgather_kernel(q, k, v, qpos, kpos, *, axis: str):
    k_all = jax.lax.all_gather(k, axis, axis=1, tiled=True)
    v_all = jax.lax.all_gather(v, axis, axis=1, tiled=True)
    kpos_all = jax.tree.map(
        lambda p: jax.lax.all_gather(p, axis, axis=p.ndim - 1, tiled=True), kpos
    )
    return causal_attention(q, k_all, v_all, qpos, kpos_all)
