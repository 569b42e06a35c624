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
    """Final norm + untied LM head + summed masked cross-entropy (float32)."""

    def __init__(self, cfg: LLMConfig, *, rngs: nnx.Rngs, dtype: Any):
        self.norm = RMSNorm(cfg.width, eps=cfg.norm_eps, dtype=dtype)
        self.head = Dense(cfg.width, cfg.vocab, axes=("embed", "vocab"), rngs=rngs, dtype=dtype)

    def logits(self, h_BxLxD: jax.Array) -> jax.Array:
        h_BxLxD = parallel.enter_tensor_parallel(self.norm(h_BxLxD))
        logits_BxLxV = self.head(h_BxLxD).astype(jnp.float32)
        return parallel.tensor_parallel_activation(logits_BxLxV, 2)  # vocab over tp

    def __call__(
        self, h_BxLxD: jax.Array, targets_BxL: jax.Array, mask_BxL: jax.Array
    ) -> jax.Array:
        logp_BxLxV = jax.nn.log_softmax(self.logits(h_BxLxD), axis=-1)
        nll_BxL = -jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
        return jnp.sum(nll_BxL * mask_BxL.astype(jnp.float32))


def make_llm(
    cfg: LLMConfig,
    placeholders: Mapping[str, int],
    dtype: Any = jnp.float32,
    name: str = "llm",
) -> StagedModule:
    """The decoder; ``placeholders`` maps modality name (``"image"``) to its token id."""
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
        ),
        post=lambda rngs: LMHeadLoss(cfg, rngs=rngs, dtype=dtype),
        num_layers=cfg.depth,
    )
