"""Context-parallel causal attention: a ring of K/V blocks over the ``"cp"`` mesh axis.

Each context-parallel (CP) rank holds ``L/cp`` of the queries, keys and values. The ring
implementation keeps the local queries in place and passes the K/V block (and the
original positions of its tokens) to the next rank ``cp - 1`` times with
``jax.lax.ppermute``; every arriving block is folded into a flash-style online softmax in
float32 (running max, running denominator, rescaled accumulator). The causal mask comes
from ``positions`` (the original index of every stored token), not from the storage order,
so any permutation of the sequence works; the default one is the zigzag layout below.
Packed rows (several samples per row) add ``segment_ids``: their blocks travel with the
K/V blocks, a query sees only keys of its own segment, and ``positions`` are then the
positions within each sample (their order within a segment is the original one).

Why a ring and not an all-gather of K/V (``impl="allgather"``, also offered):

* memory: a rank never holds more than two K/V blocks of ``L/cp`` tokens and one
  ``[L/cp, L/cp]`` score block (the loop is a ``lax.scan``), and the backward pass (a
  custom VJP that passes K/V and their gradient accumulators around the ring again)
  saves only ``O(L/cp)`` residuals; an all-gather materialises the full ``L``-token K/V
  and ``[L/cp, L]`` scores on every rank, and autodiff keeps them for the backward.
  On a GPU in bf16/f16 each block is cuDNN's flash kernel instead, which tiles the score
  block too (:mod:`hetjax.ops.ring_fused`: blocks merged by their log-sum-exp; zigzag and
  encoder rings); the plain blocks are XLA maths, so they run and are tested on CPU.
* overlap: the ``ppermute`` of the next block does not depend on the current block's
  maths, so XLA can run the transfer under the compute.

The all-gather is one collective instead of ``cp - 1`` and is simpler; for short
sequences or small ``cp`` its latency is lower and the memory it costs is small. The ring
is the default because CP exists for long sequences, where memory is the constraint.

Load balancing (zigzag): split the sequence into ``2 * cp`` chunks; rank ``r`` holds
chunks ``r`` and ``2*cp - 1 - r``, so every rank has the same number of causal
``(q, k)`` pairs. Sequences are stored in that permuted order; sharding the stored
sequence evenly over ``"cp"`` gives each rank its two mirrored chunks. With
``zigzag=True`` the ring also skips the half of each off-diagonal block that the causal
mask hides (it is exactly half for every rank and step in the zigzag layout), halving the
attention FLOPs; without it every block is computed densely and masked.

Shape key: B batch, L sequence, H query heads, G kv heads (divides H), K head dim.
Inside ``shard_map`` kernels, ``b``/``lq``/``s`` are rank-local sizes, ``r = H/G``, and
``q5`` is the query viewed as ``[b, lq, G, r, K]``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from hetjax.meshes.sequence import inverse_permutation, zigzag_permutation
from hetjax.ops.context import cp_is_manual
from hetjax.ops.fused_attention import Kernel, pick_kernel
from hetjax.ops.ring_fused import fused_ring_backward, fused_ring_forward
from hetjax.ops.ring_kernels import (
    _allgather_kernel,
    _ring_backward_kernel,
    _ring_forward_kernel,
    causal_attention,
    tag,
)

__all__ = [
    "causal_attention",
    "inverse_permutation",
    "ring_attention",
    "zigzag_permutation",
]

Impl = Literal["ring", "allgather"]


# -- public entry point -----------------------------------------------------------------


def _axis_size(mesh: Mesh, axis: str | None) -> int:
    return 1 if axis is None else int(mesh.shape[axis])


def _check_axes(mesh: Mesh, axes: Sequence[str | None], what: str) -> None:
    for a in axes:
        if a is not None and a not in mesh.axis_names:
            raise ValueError(
                f"ring_attention: {what} axis {a!r} is not a mesh axis {mesh.axis_names};"
                " pass an axis of the mesh (or None)"
            )


def ring_attention(
    q_BxLxHxK: jax.Array,
    k_BxLxGxK: jax.Array,
    v_BxLxGxK: jax.Array,
    positions: jax.Array | None,
    *,
    mesh: Mesh | None,
    cp_axis: str = "cp",
    batch_axes: Sequence[str] | None = ("dp", "ep"),
    head_axis: str | None = "tp",
    impl: Impl = "ring",
    zigzag: bool = False,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    dense_at_cp1: bool = True,
    kernel: Kernel | None = None,
    max_segments: int | None = None,
) -> jax.Array:
    """GQA attention with the sequence sharded over the ``cp_axis`` of ``mesh``.

    Inputs and output are global-view arrays in stored (e.g. zigzag) order; the result
    equals :func:`causal_attention` of the same arrays, i.e. plain causal attention of
    the un-permuted sequence, permuted. Differentiable; the ring has a custom VJP.

    Args:
        q_BxLxHxK: queries. k_BxLxGxK, v_BxLxGxK: keys/values; ``G`` divides ``H``.
        positions: ``[L]`` or ``[B, L]`` integer original position of every stored token
            (for the zigzag layout, ``zigzag_permutation(L, cp)``); RoPE must have been
            applied with the same positions. The mask is ``q_pos >= k_pos``. Ignored
            (pass None) when ``causal=False``.
        mesh: the module or stage mesh; ``None`` or ``cp == 1`` runs
            :func:`causal_attention` directly (no ``shard_map``; GSPMD shards dp/tp).
        cp_axis: mesh axis that shards the sequence.
        batch_axes: mesh axes that shard the batch dimension (None: unsharded). Inside
            ``jax.vmap(..., spmd_axis_name="dp")`` (the executor's per-replica backward)
            pass the remaining axes only, e.g. ``("ep",)``: vmap adds ``"dp"`` itself.
        head_axis: mesh axis that shards heads (tensor parallelism) or None. If ``G``
            is not a multiple of its size, K/V are repeated to ``H`` heads first.
        impl: ``"ring"`` (ppermute K/V ``cp - 1`` times; ``O(L/cp)`` memory) or
            ``"allgather"`` (one all-gather of K/V; ``O(L)`` memory, lower latency).
        zigzag: ring only: skip the causally hidden half of each off-diagonal block.
            Only valid when every row of ``positions`` is ``zigzag_permutation(L, cp)``,
            or, with ``segment_ids``, the zigzag storage of packed rows (positions restart
            per segment; segments are contiguous runs of the original order), whose
            visible keys are a subset of the zigzag ones.
        causal: False for bidirectional attention (encoders): every key is visible,
            so the sequence may be split in plain contiguous order.
        segment_ids: ``[B, L]`` sample id of every stored token of packed rows (stored
            like the tokens), or None: a query then sees only keys of its own segment,
            and ``positions`` are the tokens' positions within their samples. Their
            blocks travel the ring with the K/V blocks. With ``causal=False`` the mask
            is the segments' alone (an encoder's packed images or windows).
        dense_at_cp1: with ``cp == 1``, run :func:`causal_attention` (the default);
            False runs ``impl``'s per-rank kernel on the one rank anyway - the ring's
            online-softmax block with its custom backward, or the all-gather's dense
            maths - to time the kernels themselves on one device.
        kernel: the ring's blocks: ``"plain"`` (online softmax in XLA), ``"cudnn"``
            (cuDNN's fused kernel per block, :mod:`hetjax.ops.ring_fused`) or ``"xla"``
            (the fused blocks' contract in XLA maths, for tests); the fused blocks need
            ``zigzag=True`` or ``causal=False`` and no ``segment_ids``. None: ``"cudnn"``
            where that holds and :func:`~hetjax.ops.fused_attention.fused_attention_applies`,
            else ``"plain"``. With ``cp == 1`` and ``dense_at_cp1`` it goes to
            :func:`causal_attention`, as does ``max_segments``.

    Returns:
        ``[B, L, H, K]`` attention output, in the dtype of ``q``, sharded like ``q``.

    Raises:
        ValueError: unknown axis, or a dimension not divisible by its mesh axes, or fused
            blocks asked for where their masks do not apply.
    """
    if impl not in ("ring", "allgather"):
        raise ValueError(f"ring_attention: impl={impl!r}; use 'ring' or 'allgather'")
    b, seq, h, d = q_BxLxHxK.shape
    g = k_BxLxGxK.shape[2]
    if h % g:
        raise ValueError(f"ring_attention: {h} query heads is not a multiple of {g} kv heads")
    if not causal:
        if zigzag:
            raise ValueError("ring_attention: zigzag block skipping needs causal=True")
        # Equal positions make the mask ``q_pos >= k_pos`` all-true: bidirectional.
        positions = jnp.zeros((seq,), jnp.int32)
    elif positions is None:
        raise ValueError("ring_attention: causal attention needs the tokens' positions")
    positions = jnp.asarray(positions, jnp.int32)
    if positions.shape not in ((seq,), (b, seq)):
        raise ValueError(
            f"ring_attention: positions has shape {positions.shape}; expected ({seq},) or"
            f" ({b}, {seq})"
        )
    if segment_ids is not None:  # non-causal: equal positions leave the segment mask alone
        segment_ids = jnp.asarray(segment_ids, jnp.int32)
        if segment_ids.shape != (b, seq):
            raise ValueError(
                f"ring_attention: segment_ids has shape {segment_ids.shape}; expected ({b}, {seq})"
            )
        positions = jnp.broadcast_to(positions, (b, seq))
    cp = 1 if mesh is None or cp_axis not in mesh.axis_names else int(mesh.shape[cp_axis])
    if cp == 1 and (dense_at_cp1 or mesh is None or cp_axis not in mesh.axis_names):
        return causal_attention(
            q_BxLxHxK,
            k_BxLxGxK,
            v_BxLxGxK,
            positions,
            segment_ids=segment_ids,
            kernel=kernel,
            max_segments=max_segments,
        )
    # Inside a region already manual over cp (the stage programs' per-rank backward) the
    # arrays are this rank's block: the kernels run directly, with no shard_map.
    manual = cp_is_manual(cp_axis)
    batch_axes = () if manual else tuple(batch_axes or ())
    _check_axes(mesh, (*batch_axes, head_axis), "batch/head")
    n_batch = math.prod(_axis_size(mesh, a) for a in batch_axes)
    tp = _axis_size(mesh, head_axis)
    problems = []
    if seq % cp and not manual:
        problems.append(f"sequence length {seq} over {cp_axis}={cp}")
    if zigzag and manual and seq % 2:
        problems.append(f"zigzag needs this rank's block of {seq} tokens to be even")
    if zigzag and not manual and seq % (2 * cp):
        problems.append(f"zigzag needs sequence length {seq} divisible by 2*cp={2 * cp}")
    if b % n_batch:
        problems.append(f"batch {b} over {batch_axes}={n_batch}")
    if h % tp and not manual:
        problems.append(f"{h} query heads over {head_axis}={tp}")
    if problems:
        raise ValueError(
            "ring_attention: cannot shard "
            + "; ".join(problems)
            + ". Change the layout or pad the arrays."
        )
    block = (seq if manual else seq // cp) // (2 if zigzag else 1)
    fusable = (zigzag or not causal) and segment_ids is None and impl == "ring"
    kernel = _ring_kernel(kernel, q_BxLxHxK, k_BxLxGxK, fusable=fusable, block=block)
    if g % tp:
        # Megatron replicates kv heads when tp > G; repeating to H keeps heads aligned.
        k_BxLxGxK = jnp.repeat(k_BxLxGxK, h // g, axis=2)
        v_BxLxGxK = jnp.repeat(v_BxLxGxK, h // g, axis=2)

    batch = batch_axes if batch_axes else None
    x_spec = PartitionSpec(batch, cp_axis, head_axis, None)
    lse_spec = PartitionSpec(batch, cp_axis, head_axis)
    pos_spec = PartitionSpec(cp_axis) if positions.ndim == 1 else PartitionSpec(batch, cp_axis)
    if segment_ids is not None:  # segment ids are split like the (per-row) positions
        pos_spec = (pos_spec, pos_spec)
    in_specs = (x_spec, x_spec, x_spec, pos_spec, pos_spec)
    positions = tag(positions, segment_ids)

    kw = dict(axis=cp_axis, cp=cp, zigzag=zigzag)
    fwd_kernel, bwd_kernel = _ring_forward_kernel, _ring_backward_kernel
    if kernel != "plain":
        kw.update(causal=causal, implementation=kernel)
        fwd_kernel, bwd_kernel = fused_ring_forward, fused_ring_backward
    if manual:
        if impl == "allgather":
            return _allgather_kernel(
                q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, positions, positions, axis=cp_axis
            )
        fwd = functools.partial(fwd_kernel, **kw)
        bwd = functools.partial(bwd_kernel, **kw)
        return _ring_vjp(fwd, bwd)(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, positions)

    if impl == "allgather":
        fn = jax.shard_map(
            functools.partial(_allgather_kernel, axis=cp_axis),
            mesh=mesh,
            in_specs=in_specs,
            out_specs=x_spec,
        )
        return fn(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, positions, positions)

    # check_vma=False: both kernels are differentiated by the custom VJP below, never by
    # shard_map's transpose, so the varying-axes types serve no purpose here; and under
    # ``jax.vmap(..., spmd_axis_name="dp")`` (the executor's per-replica backward) the
    # type check rejects the zigzag ``lax.cond`` mixing dp-batched and unbatched operands.
    fwd = jax.shard_map(
        functools.partial(fwd_kernel, **kw),
        mesh=mesh,
        in_specs=in_specs,
        out_specs=(x_spec, lse_spec),
        check_vma=False,
    )
    bwd = jax.shard_map(
        functools.partial(bwd_kernel, **kw),
        mesh=mesh,
        in_specs=(*in_specs, x_spec, lse_spec, x_spec),
        out_specs=(x_spec,) * 3,
        check_vma=False,
    )
    return _ring_vjp(fwd, bwd)(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, positions)


def _ring_kernel(kernel: Kernel | None, q, k, *, fusable: bool, block: int) -> Kernel:
    """The ring's blocks: fused only where their masks are the kernel's (causal diagonal,
    unmasked half-blocks) and, as JAX's cuDNN training call wants, of even length."""
    fusable = fusable and block % 2 == 0
    if kernel is None:
        return pick_kernel(None, q, k) if fusable else "plain"
    if kernel != "plain" and not fusable:
        raise ValueError(
            f"ring_attention: kernel={kernel!r} needs impl='ring' with zigzag=True or"
            f" causal=False, no segment_ids and even blocks (here {block} tokens); use"
            " kernel='plain' (or None)"
        )
    return kernel


def _ring_vjp(fwd, bwd):
    """The ring as a function with its custom VJP (K/V and their gradients go round
    again in the backward), from its forward and backward kernels."""

    @jax.custom_vjp
    def ring(q, k, v, pos):
        return fwd(q, k, v, pos, pos)[0]

    def ring_fwd(q, k, v, pos):
        out, lse = fwd(q, k, v, pos, pos)
        return out, (q, k, v, pos, out, lse)

    def ring_bwd(res, dout):
        q, k, v, pos, out, lse = res
        dq, dk, dv = bwd(q, k, v, pos, pos, out, lse, dout)
        return dq, dk, dv, jax.tree.map(lambda _: None, pos)

    ring.defvjp(ring_fwd, ring_bwd)
    return ring
