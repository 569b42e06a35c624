"""Modality encoders (ViT image encoder, audio encoder) and the LLaVA-1.5 projector.

Each is a :class:`hetjax.StagedModule`: ``pre`` embeds the raw input into tokens,
``blocks`` are identical pre-norm transformer blocks, ``post`` is the final norm.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from hetjax.modules import StagedModule
from models.config import EncoderConfig
from models.layers import Dense, EncoderBlock, LayerNorm, normal_param


class PatchEmbed(nnx.Module):
    """Images ``[B, H, W, C]`` -> patch tokens ``[B, N, D]`` + learned positions."""

    def __init__(self, cfg: EncoderConfig, *, rngs: nnx.Rngs, dtype: Any):
        self.cfg = cfg
        self.proj = Dense(
            cfg.token_in_dim, cfg.width, axes=(None, "embed"), rngs=rngs, use_bias=True, dtype=dtype
        )
        self.pos = normal_param(rngs, (cfg.num_tokens, cfg.width), (None, "embed"))
        self.dtype = dtype

    def __call__(self, images_BxHxWxC: jax.Array) -> jax.Array:
        b, h, w, c = images_BxHxWxC.shape
        p = self.cfg.patch
        x = images_BxHxWxC.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
        patches_BxNxP = x.reshape(b, (h // p) * (w // p), p * p * c)
        return self.proj(patches_BxNxP) + self.pos[...].astype(self.dtype)


class FrameEmbed(nnx.Module):
    """Audio frames ``[B, T, F]`` -> tokens ``[B, T / stack, D]`` + learned positions."""

    def __init__(self, cfg: EncoderConfig, *, rngs: nnx.Rngs, dtype: Any):
        self.cfg = cfg
        self.proj = Dense(
            cfg.token_in_dim, cfg.width, axes=(None, "embed"), rngs=rngs, use_bias=True, dtype=dtype
        )
        self.pos = normal_param(rngs, (cfg.num_tokens, cfg.width), (None, "embed"))
        self.dtype = dtype

    def __call__(self, frames_BxTxF: jax.Array) -> jax.Array:
        b, t, f = frames_BxTxF.shape
        s = self.cfg.frame_stack
        tokens_BxNxI = frames_BxTxF.reshape(b, t // s, s * f)
        return self.proj(tokens_BxNxI) + self.pos[...].astype(self.dtype)


def make_encoder(name: str, cfg: EncoderConfig, dtype: Any = jnp.float32) -> StagedModule:
    """A ViT (``cfg.kind == "vit"``) or audio encoder as a stage-sliceable module."""
    embed_cls = PatchEmbed if cfg.kind == "vit" else FrameEmbed
    return StagedModule(
        name,
        pre=lambda rngs: embed_cls(cfg, rngs=rngs, dtype=dtype),
        block=lambda rngs: EncoderBlock(
            cfg.width, cfg.heads, cfg.mlp, rngs=rngs, dtype=dtype, moe=cfg.moe
        ),
        post=lambda rngs: LayerNorm(cfg.width, dtype=dtype),
        num_layers=cfg.depth,
    )


class Projector(nnx.Module):
    """LLaVA-1.5 projector: Linear -> GELU -> Linear, encoder width -> LLM width.

    Column-parallel then row-parallel over ``"mlp"``, as a Megatron MLP.
    """

    def __init__(self, d_in: int, d_out: int, *, rngs: nnx.Rngs, dtype: Any):
        self.fc1 = Dense(d_in, d_out, axes=("embed", "mlp"), rngs=rngs, use_bias=True, dtype=dtype)
        self.fc2 = Dense(d_out, d_out, axes=("mlp", "embed"), rngs=rngs, use_bias=True, dtype=dtype)

    def __call__(self, x_BxNxE: jax.Array) -> jax.Array:
        return self.fc2(jax.nn.gelu(self.fc1(x_BxNxE)))


def make_projector(name: str, d_in: int, d_out: int, dtype: Any = jnp.float32) -> StagedModule:
    return StagedModule(name, pre=lambda rngs: Projector(d_in, d_out, rngs=rngs, dtype=dtype))
