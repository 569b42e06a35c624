"""Qwen2.5-VL's vision tower and patch merger as stage-sliceable modules.

The tower (``vision``) takes a row of flattened patches ``[B, N, C*T*P*P]`` (the
processor's ``pixel_values``, one row per sample, padded to the row's patch budget):

- ``pre``: the patch embedding. HF's Conv3d with stride = kernel = ``(T, P, P)`` sees each
  patch exactly once, so it is one unbiased matmul over the flattened patch;
- ``blocks``: RMSNorm -> attention with 2D rotary positions and biased q/k/v/out ->
  RMSNorm -> biased SwiGLU. Most layers attend within a window, a few (HF's
  ``fullatt_block_indexes``) within a whole frame. A layer's kind depends on its index,
  which a scanned block cannot see, so one scanned block is one *period* of that pattern
  (8 layers, the 8th full, for Qwen2.5-VL's ``(7, 15, 23, 31)``), its layers unrolled;
  pipeline stages split whole periods (as MaxText scans Gemma 3's local/global pattern);
- no ``post``: the merger is the ``projector`` module, as LLaVA's is.

The merger (``projector``): RMSNorm, then every ``merge x merge`` consecutive patches (one
merge unit, consecutive in the processor's order) concatenated, Linear -> exact GELU ->
Linear into the LLM's width: ``[B, N / 4, D_llm]``, the LLM tokens in placeholder order.

Block inputs (per row, from :func:`models.qwen.grids.pack_row`): ``vision_positions``
``[B, N, 2]``, ``frame_ids`` and ``window_ids`` ``[B, N]``.
Shape key: B rows, N patches, I patch values, D width, H heads, K head dim, F MLP width.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from hetjax.modules import StagedModule
from hetjax.ops import context as parallel
from models.layers import Dense, RMSNorm, activation

from .attention import segment_attention
from .config import QwenVisionConfig
from .rope import rotate, vision_angles

# The tower's block inputs (batch keys), per row and patch.
VISION_KEYS = ("vision_positions", "frame_ids", "window_ids")


class PatchEmbed(nnx.Module):
    """Flattened ``(C, T, P, P)`` patches -> ``[B, N, D]`` (HF's Conv3d as a matmul)."""

    def __init__(self, cfg: QwenVisionConfig, *, rngs: nnx.Rngs, dtype: Any):
        self.proj = Dense(cfg.patch_dim, cfg.width, axes=(None, "embed"), rngs=rngs, dtype=dtype)

    def __call__(self, patches_BxNxI: jax.Array) -> jax.Array:
        return self.proj(patches_BxNxI)


class VisionLayer(nnx.Module):
    """One Qwen2.5-VL vision block; attention within the segments it is given."""

    def __init__(self, cfg: QwenVisionConfig, *, rngs: nnx.Rngs, dtype: Any):
        d, h, k, f = cfg.width, cfg.heads, cfg.head_dim, cfg.mlp
        self.heads = h
        self.norm1 = RMSNorm(d, eps=cfg.norm_eps, dtype=dtype)
        # [D, 3, H, K]: HF's qkv rows are (q|k|v, head, dim); tp splits whole heads.
        self.qkv = Dense(
            d, (3, h, k), axes=("embed", None, "heads", None), rngs=rngs, use_bias=True, dtype=dtype
        )
        self.proj = Dense(d, d, axes=("heads", "embed"), rngs=rngs, use_bias=True, dtype=dtype)
        self.norm2 = RMSNorm(d, eps=cfg.norm_eps, dtype=dtype)
        self.gate_up = Dense(
            d, (2, f), axes=("embed", None, "mlp"), rngs=rngs, use_bias=True, dtype=dtype
        )
        self.down = Dense(f, d, axes=("mlp", "embed"), rngs=rngs, use_bias=True, dtype=dtype)

    def __call__(
        self, x_BxNxD: jax.Array, angles_BxNxJ: jax.Array, segment_ids_BxN: jax.Array
    ) -> jax.Array:
        b, n, d = x_BxNxD.shape
        tp = parallel.tensor_parallel_activation  # heads / MLP columns stay split over tp
        h = parallel.enter_tensor_parallel(self.norm1(x_BxNxD))
        qkv_BxNx3xHxK = tp(self.qkv(h), 3)
        q = rotate(qkv_BxNx3xHxK[:, :, 0], angles_BxNxJ)
        k = rotate(qkv_BxNx3xHxK[:, :, 1], angles_BxNxJ)
        a = segment_attention(q, k, qkv_BxNx3xHxK[:, :, 2], segment_ids_BxN)
        x_BxNxD = x_BxNxD + parallel.exit_tensor_parallel(self.proj(tp(a.reshape(b, n, d), 2)))
        h = parallel.enter_tensor_parallel(self.norm2(x_BxNxD))
        gate_up_BxNx2xF = tp(self.gate_up(h), 3)
        hidden = jax.nn.silu(gate_up_BxNx2xF[:, :, 0]) * gate_up_BxNx2xF[:, :, 1]
        return x_BxNxD + parallel.exit_tensor_parallel(self.down(tp(hidden, 2)))


class VisionPeriod(nnx.Module):
    """One period of the tower's layers (``layer0`` ... ``layer{p-1}``), each attending
    within windows or whole frames by :attr:`QwenVisionConfig.pattern`."""

    def __init__(self, cfg: QwenVisionConfig, *, rngs: nnx.Rngs, dtype: Any):
        self.cfg = cfg
        for j in range(cfg.period):
            setattr(self, f"layer{j}", VisionLayer(cfg, rngs=rngs, dtype=dtype))

    def __call__(
        self,
        x_BxNxD: jax.Array,
        *,
        vision_positions: jax.Array,
        frame_ids: jax.Array,
        window_ids: jax.Array,
    ) -> jax.Array:
        cfg = self.cfg
        angles_BxNxJ = vision_angles(vision_positions, cfg.head_dim, cfg.rope_theta)
        for j, full in enumerate(cfg.pattern):
            layer = getattr(self, f"layer{j}")
            x_BxNxD = layer(x_BxNxD, angles_BxNxJ, frame_ids if full else window_ids)
        return x_BxNxD


class PatchMerger(nnx.Module):
    """RMSNorm, ``merge x merge`` patches concatenated, Linear -> GELU -> Linear."""

    def __init__(self, cfg: QwenVisionConfig, *, rngs: nnx.Rngs, dtype: Any):
        wide = cfg.width * cfg.merge_unit
        self.unit = cfg.merge_unit
        self.norm = RMSNorm(cfg.width, eps=cfg.norm_eps, dtype=dtype)
        self.fc1 = Dense(wide, wide, axes=("embed", "mlp"), rngs=rngs, use_bias=True, dtype=dtype)
        self.fc2 = Dense(
            wide, cfg.out_width, axes=("mlp", "embed"), rngs=rngs, use_bias=True, dtype=dtype
        )

    def __call__(self, x_BxNxD: jax.Array) -> jax.Array:
        b, n, d = x_BxNxD.shape
        if n % self.unit:
            raise ValueError(f"{n} patches per row: a multiple of {self.unit} is needed")
        x_BxMxW = self.norm(x_BxNxD).reshape(b, n // self.unit, self.unit * d)
        return self.fc2(activation("gelu")(self.fc1(x_BxMxW)))


def make_vision(cfg: QwenVisionConfig, dtype: Any = jnp.float32, name: str = "vision"):
    """The tower: patch embedding, then ``cfg.groups`` scanned periods of layers."""
    return StagedModule(
        name,
        pre=lambda rngs: PatchEmbed(cfg, rngs=rngs, dtype=dtype),
        block=lambda rngs: VisionPeriod(cfg, rngs=rngs, dtype=dtype),
        num_layers=cfg.groups,
    )


def make_merger(cfg: QwenVisionConfig, dtype: Any = jnp.float32, name: str = "projector"):
    """The 2x2 patch merger into the LLM's width."""
    return StagedModule(name, pre=lambda rngs: PatchMerger(cfg, rngs=rngs, dtype=dtype))
