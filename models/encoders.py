"""Modality encoders (ViT, CLIP and SigLIP image towers, audio encoder) and the LLaVA-1.5
projector.

Each is a :class:`hetjax.StagedModule`: ``pre`` embeds the raw input into tokens,
``blocks`` are identical pre-norm transformer blocks, ``post`` is the final norm (none
for CLIP and SigLIP: LLaVA reads their hidden state before any final norm).

Images are ``[B, H, W, C]`` (channels last), or ``[B, K, H, W, C]`` for ``K`` image slots
per sample: the encoder runs on the ``B * K`` images and a projector made with
``images_per_row=K`` returns each sample's ``K * N`` tokens in slot order. ``models.hf``
converts Hugging Face's ``[B, C, H, W]`` pixel values and convolution kernels.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from hetjax.modules import StagedModule
from models.config import EncoderConfig
from models.layers import Dense, EncoderBlock, LayerNorm, activation, normal_param


def patchify(images_BxHxWxC: jax.Array, patch: int) -> jax.Array:
    """``[B, H, W, C]`` -> ``[B, N, p * p * C]``, patches in row-major order, each
    flattened as ``(row, column, channel)``; ``[B, K, H, W, C]`` -> ``[B * K, N, ...]``."""
    if images_BxHxWxC.ndim == 5:
        images_BxHxWxC = images_BxHxWxC.reshape(-1, *images_BxHxWxC.shape[2:])
    b, h, w, c = images_BxHxWxC.shape
    p = patch
    x = images_BxHxWxC.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (h // p) * (w // p), p * p * c)


class PatchEmbed(nnx.Module):
    """Images ``[B, H, W, C]`` -> patch tokens ``[B, N, D]`` + learned positions (ViT,
    SigLIP)."""

    def __init__(self, cfg: EncoderConfig, *, rngs: nnx.Rngs, dtype: Any):
        self.cfg = cfg
        self.proj = Dense(
            cfg.token_in_dim, cfg.width, axes=(None, "embed"), rngs=rngs, use_bias=True, dtype=dtype
        )
        self.pos = normal_param(rngs, (cfg.num_tokens, cfg.width), (None, "embed"))
        self.dtype = dtype

    def __call__(self, images_BxHxWxC: jax.Array) -> jax.Array:
        patches_BxNxP = patchify(images_BxHxWxC, self.cfg.patch)
        return self.proj(patches_BxNxP) + self.pos[...].astype(self.dtype)


class ClipEmbed(nnx.Module):
    """CLIP's embeddings: unbiased patch projection, a class token in front, learned
    positions for ``N + 1`` tokens, then the pre-layernorm -> ``[B, N + 1, D]``."""

    def __init__(self, cfg: EncoderConfig, *, rngs: nnx.Rngs, dtype: Any):
        self.cfg = cfg
        self.proj = Dense(cfg.token_in_dim, cfg.width, axes=(None, "embed"), rngs=rngs, dtype=dtype)
        self.cls = normal_param(rngs, (cfg.width,), ("embed",))
        self.pos = normal_param(rngs, (cfg.block_tokens, cfg.width), (None, "embed"))
        self.norm = LayerNorm(cfg.width, eps=cfg.norm_eps, dtype=dtype)
        self.dtype = dtype

    def __call__(self, images_BxHxWxC: jax.Array) -> jax.Array:
        patches_BxNxD = self.proj(patchify(images_BxHxWxC, self.cfg.patch))
        b, _, d = patches_BxNxD.shape
        cls_Bx1xD = jnp.broadcast_to(self.cls[...].astype(self.dtype), (b, 1, d))
        x = jnp.concatenate([cls_Bx1xD, patches_BxNxD], axis=1)
        return self.norm(x + self.pos[...].astype(self.dtype))


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
    """An image (``vit``, ``clip``, ``siglip``) or audio encoder as a stage-sliceable
    module."""
    embed_cls = {"clip": ClipEmbed, "audio": FrameEmbed}.get(cfg.kind, PatchEmbed)
    block_kwargs = dict(bias=True, act=cfg.act, eps=cfg.norm_eps) if cfg.hf else {}
    return StagedModule(
        name,
        pre=lambda rngs: embed_cls(cfg, rngs=rngs, dtype=dtype),
        block=lambda rngs: EncoderBlock(
            cfg.width, cfg.heads, cfg.mlp, rngs=rngs, dtype=dtype, moe=cfg.moe, **block_kwargs
        ),
        post=None if cfg.hf else (lambda rngs: LayerNorm(cfg.width, dtype=dtype)),
        num_layers=cfg.depth,
    )


class Projector(nnx.Module):
    """LLaVA-1.5 projector: Linear -> GELU -> Linear, encoder width -> LLM width.

    Column-parallel then row-parallel over ``"mlp"``, as a Megatron MLP. ``skip`` leading
    tokens are dropped first (LLaVA's ``vision_feature_select_strategy="default"`` drops
    CLIP's class token).
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        rngs: nnx.Rngs,
        dtype: Any,
        act: str = "gelu_pytorch_tanh",
        skip: int = 0,
        images_per_row: int = 1,
    ):
        self.fc1 = Dense(d_in, d_out, axes=("embed", "mlp"), rngs=rngs, use_bias=True, dtype=dtype)
        self.fc2 = Dense(d_out, d_out, axes=("mlp", "embed"), rngs=rngs, use_bias=True, dtype=dtype)
        self.act, self.skip, self.images_per_row = act, skip, images_per_row

    def __call__(self, x_BxNxE: jax.Array) -> jax.Array:
        y_BxNxD = self.fc2(activation(self.act)(self.fc1(x_BxNxE[:, self.skip :])))
        if self.images_per_row == 1:
            return y_BxNxD
        # [rows * K, N, D] -> [rows, K * N, D]: a row's images' tokens in slot order.
        b, n, d = y_BxNxD.shape
        return y_BxNxD.reshape(b // self.images_per_row, self.images_per_row * n, d)


def make_projector(
    name: str,
    d_in: int,
    d_out: int,
    dtype: Any = jnp.float32,
    *,
    act: str = "gelu_pytorch_tanh",
    skip: int = 0,
    images_per_row: int = 1,
) -> StagedModule:
    return StagedModule(
        name,
        pre=lambda rngs: Projector(
            d_in, d_out, rngs=rngs, dtype=dtype, act=act, skip=skip, images_per_row=images_per_row
        ),
    )
