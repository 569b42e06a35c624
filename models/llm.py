"""Llama-style decoder LLM as a stage-sliceable module.

``pre`` embeds text tokens and writes each sample's modality tokens (projected image /
audio embeddings) into the placeholder positions of the sequence; ``blocks`` are Llama
decoder blocks; ``post`` is the final RMSNorm, the untied LM head and the summed
next-token cross-entropy over supervised positions. Returning a SUM (not a mean) lets the
trainer divide by the supervised-token count of the global batch, so the loss does not
depend on how the batch is split into microbatches or data-parallel shards.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from hetjax.modules import StagedModule
from hetjax.ops import context as parallel
from hetjax.ops import (
    merge_modality_tokens,
    merge_routed,
    merge_whole_per_rank,
    vocab_parallel_lookup,
)
from models.config import LLMConfig
from models.layers import DecoderBlock, Dense, RMSNorm, normal_param


class TokenEmbed(nnx.Module):
    """Text embedding (vocabulary-parallel) + modality-token merge."""

    def __init__(
        self, cfg: LLMConfig, placeholders: Mapping[str, int], *, rngs: nnx.Rngs, dtype: Any
    ):
        self.table = normal_param(rngs, (cfg.vocab, cfg.width), ("vocab", "embed"))
        self.placeholders = dict(placeholders)
        self.dtype = dtype

    def __call__(self, tokens_BxL: jax.Array, **modality_BxNxD: jax.Array) -> jax.Array:
        ctx = parallel.current()
        if ctx is not None and ctx.sp:
            # Sequence parallelism: GSPMD would gather the whole table; look up in place.
            h_BxLxD = vocab_parallel_lookup(
                self.table[...],
                tokens_BxL,
                mesh=ctx.mesh,
                batch_axes=ctx.batch_axes,
                seq_axis="cp" if ctx.cp > 1 else None,
            ).astype(self.dtype)
        else:
            h_BxLxD = jnp.take(self.table[...], tokens_BxL, axis=0).astype(self.dtype)
        for modality, tokens_BxNxD in sorted(modality_BxNxD.items()):
            if modality not in self.placeholders:
                raise ValueError(
                    f"LLM has no placeholder token for modality {modality!r}; known: "
                    f"{sorted(self.placeholders)}"
                )
            is_slot_BxL = tokens_BxL == self.placeholders[modality]
            ctx = parallel.current()
            if ctx is not None and modality in ctx.routed:
                # Context parallelism: each cp rank received only its own slots' tokens.
                h_BxLxD = merge_routed(
                    h_BxLxD, is_slot_BxL, tokens_BxNxD, mesh=ctx.mesh, batch_axes=ctx.batch_axes
                )
                continue
            if ctx is not None and ctx.cp > 1 and parallel.cp_is_manual():
                # Per cp rank, the tokens whole on every rank (the homogeneous baseline).
                h_BxLxD = merge_whole_per_rank(h_BxLxD, is_slot_BxL, tokens_BxNxD, cp=ctx.cp)
                continue
            positions = None if ctx is None or ctx.cp == 1 else ctx.positions(tokens_BxL.shape[1])
            h_BxLxD = merge_modality_tokens(h_BxLxD, is_slot_BxL, tokens_BxNxD, positions)
        return h_BxLxD


class LMHeadLoss(nnx.Module):
    """Final norm + untied LM head + summed masked cross-entropy (float32).

    Only supervised positions carry loss, so with a ``capacity`` (supervised tokens per
    row, a static bound the data guarantees: ``MLLM(loss_tokens_per_row=...)``) the head
    runs on those positions alone: each row's supervised positions are gathered, in
    order, up to ``capacity`` (padded with unsupervised ones, whose weight is zero) and
    the norm, the ``[C, V]`` logits and the float32 log-softmax are computed there, not
    over the ``[L, V]`` row. The sum is the same sum of the same terms (a reordering of
    float adds). A row is gathered per stored block: the whole row, or with context
    parallelism each cp rank's block (zigzag order; the loss is order-free), so the
    gather never crosses ranks; a block's capacity is ``min(capacity, its length)``.
    ``capacity=None`` (or at least the block's length): every position, as before.

    Shape key: K stored blocks of a row, T positions a block, C the capacity.
    """

    def __init__(self, cfg: LLMConfig, *, rngs: nnx.Rngs, dtype: Any, capacity: int | None = None):
        self.norm = RMSNorm(cfg.width, eps=cfg.norm_eps, dtype=dtype)
        self.head = Dense(cfg.width, cfg.vocab, axes=("embed", "vocab"), rngs=rngs, dtype=dtype)
        self.capacity = capacity

    def logits(self, h_BxLxD: jax.Array) -> jax.Array:
        """Float32 logits at every position of ``h`` (inference and the HF export pass
        whole rows; the loss, with a capacity, its gathered positions)."""
        h_BxLxD = parallel.enter_tensor_parallel(self.norm(h_BxLxD))
        logits_BxLxV = self.head(h_BxLxD).astype(jnp.float32)
        return parallel.tensor_parallel_activation(logits_BxLxV, 2)  # vocab over tp

    def __call__(
        self, h_BxLxD: jax.Array, targets_BxL: jax.Array, mask_BxL: jax.Array
    ) -> jax.Array:
        blocks = _stored_blocks()
        block_len = h_BxLxD.shape[1] // blocks
        if self.capacity is not None and self.capacity < block_len:
            return self._gathered(h_BxLxD, targets_BxL, mask_BxL, blocks, self.capacity)
        return _masked_nll(self.logits(h_BxLxD), targets_BxL, mask_BxL)

    def _gathered(self, h_BxLxD, targets_BxL, mask_BxL, blocks: int, capacity: int):
        """The loss over each block's first ``capacity`` supervised positions; NaN if a
        block has more (never a silently smaller sum: the data pipeline bounds rows by
        the capacity, so this only flags a batch that bypassed it)."""
        b, length = mask_BxL.shape
        # Sequence parallelism: the sequence gathered over tp here, as the dense path
        # does before the head (the block's rows may lie on any tp rank).
        h_BxLxD = parallel.enter_tensor_parallel(h_BxLxD)
        h_BxKxTxD = h_BxLxD.reshape(b, blocks, length // blocks, h_BxLxD.shape[-1])
        mask_BxKxT = mask_BxL.reshape(b, blocks, -1)
        # Supervised positions first, in order (a stable sort of "unsupervised").
        idx_BxKxC = jnp.argsort(mask_BxKxT == 0, axis=-1, stable=True)[..., :capacity]
        h_BxCxD = jnp.take_along_axis(h_BxKxTxD, idx_BxKxC[..., None], axis=2)
        h_BxCxD = h_BxCxD.reshape(b, blocks * capacity, -1)

        def take(x_BxL):
            x_BxKxC = jnp.take_along_axis(x_BxL.reshape(b, blocks, -1), idx_BxKxC, axis=2)
            return x_BxKxC.reshape(b, blocks * capacity)

        loss = _masked_nll(self.logits(h_BxCxD), take(targets_BxL), take(mask_BxL))
        overflow = jnp.any(jnp.sum(mask_BxKxT != 0, axis=-1) > capacity)
        return jnp.where(overflow, jnp.nan, loss)


def _stored_blocks() -> int:
    """Blocks a row is stored in where the head runs: the cp ranks' blocks under GSPMD
    context parallelism (the sequence axis split over cp), else one (no cp, or code
    traced per cp rank, which sees its own block only)."""
    ctx = parallel.current()
    if ctx is None or ctx.cp == 1 or parallel.cp_is_manual():
        return 1
    return ctx.cp


def _masked_nll(logits_BxLxV: jax.Array, targets_BxL: jax.Array, mask_BxL: jax.Array):
    """Summed ``mask``-weighted next-token cross-entropy (float32 log-softmax)."""
    logp_BxLxV = jax.nn.log_softmax(logits_BxLxV, axis=-1)
    nll_BxL = -jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
    return jnp.sum(nll_BxL * mask_BxL.astype(jnp.float32))


def make_llm(
    cfg: LLMConfig,
    placeholders: Mapping[str, int],
    dtype: Any = jnp.float32,
    name: str = "llm",
    *,
    loss_capacity: int | None = None,
    max_segments: int | None = None,
) -> StagedModule:
    """The decoder; ``placeholders`` maps modality name (``"image"``) to its token id;
    ``loss_capacity``: supervised tokens per row the head computes (:class:`LMHeadLoss`);
    ``max_segments``: a bound on packed rows' segments (:class:`models.layers.DecoderBlock`)."""
    return StagedModule(
        name,
        pre=lambda rngs: TokenEmbed(cfg, placeholders, rngs=rngs, dtype=dtype),
        block=lambda rngs: DecoderBlock(
            cfg.width,
            cfg.heads,
            cfg.kv_heads,
            cfg.mlp,
            rope_theta=cfg.rope_theta,
            eps=cfg.norm_eps,
            rngs=rngs,
            dtype=dtype,
            moe=cfg.moe,
            max_segments=max_segments,
        ),
        post=lambda rngs: LMHeadLoss(cfg, rngs=rngs, dtype=dtype, capacity=loss_capacity),
        num_layers=cfg.depth,
    )
