"""Qwen2.5-VL's LLM (Qwen2): Llama's decoder with biased q/k/v and 3D rotary positions.

``pre`` and ``post`` are the Llama LLM's own (:class:`models.llm.TokenEmbed`: the
vision tokens replace the placeholder positions in order; :class:`models.llm.LMHeadLoss`).
Images and videos share one placeholder id in the LLM's input: the embedding of a
placeholder is overwritten, so only the host (which computes the mRoPE positions) needs
to tell them apart, and one vision link fills both.

Every block reads ``mrope_positions`` ``[B, L, 3]`` (temporal, height, width; batch on
dim 0 and sequence on dim 1, like every batch key the runtime splits over dp and cp);
the attention mask still follows the sequence order (``positions``/``segment_ids`` for
packed rows, as Llama's blocks). Shape key: B batch, L sequence, D width, G kv heads,
R query heads per kv head, K head dim, F MLP width.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from hetjax.modules import StagedModule
from hetjax.ops import context as parallel
from hetjax.ops.attention import self_attention
from models.config import LLMConfig
from models.layers import Dense, RMSNorm
from models.llm import LMHeadLoss, TokenEmbed

from .rope import mrope_angles, rotate


class QwenDecoderBlock(nnx.Module):
    """RMSNorm -> causal GQA with mRoPE (biased q/k/v, fused per kv group as Llama's
    ``[D, G, R + 2, K]``) -> RMSNorm -> SwiGLU."""

    def __init__(
        self,
        cfg: LLMConfig,
        section: Sequence[int],
        *,
        rngs: nnx.Rngs,
        dtype: Any,
        max_segments: int | None = None,
    ):
        if cfg.heads % cfg.kv_heads:
            raise ValueError(
                f"Qwen LLM: heads={cfg.heads} is not a multiple of kv_heads={cfg.kv_heads}"
            )
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.theta, self.section = cfg.rope_theta, tuple(section)
        self.max_segments = max_segments  # packed rows' bound (models.layers.DecoderBlock)
        group, kd, d = cfg.heads // cfg.kv_heads, cfg.head_dim, cfg.width
        self.attn_norm = RMSNorm(d, eps=cfg.norm_eps, dtype=dtype)
        self.qkv = Dense(
            d,
            (cfg.kv_heads, group + 2, kd),
            axes=("embed", "kv_heads", None, None),
            rngs=rngs,
            use_bias=True,
            dtype=dtype,
        )
        self.o = Dense(cfg.heads * kd, d, axes=("heads", "embed"), rngs=rngs, dtype=dtype)
        self.mlp_norm = RMSNorm(d, eps=cfg.norm_eps, dtype=dtype)
        self.gate_up = Dense(d, (2, cfg.mlp), axes=("embed", None, "mlp"), rngs=rngs, dtype=dtype)
        self.down = Dense(cfg.mlp, d, axes=("mlp", "embed"), rngs=rngs, dtype=dtype)

    def __call__(
        self,
        x_BxLxD: jax.Array,
        *,
        mrope_positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        b, l, _ = x_BxLxD.shape
        kd, group = self.head_dim, self.heads // self.kv_heads
        if (segment_ids is None) != (positions is None):
            raise ValueError("QwenDecoderBlock: packed rows need both segment_ids and positions")
        ctx = parallel.current()
        if positions is None:  # the mask's order; under cp the stored permutation's
            positions = jnp.arange(l) if ctx is None else jnp.asarray(ctx.positions(l))
        if mrope_positions is None:  # text only: all three follow the sequence
            mrope_positions = jnp.broadcast_to(
                jnp.broadcast_to(positions, (b, l))[..., None], (b, l, 3)
            )
        angles_BxLxJ = mrope_angles(mrope_positions, kd, self.theta, self.section)
        tp = parallel.tensor_parallel_activation
        h = parallel.enter_tensor_parallel(self.attn_norm(x_BxLxD))
        qkv_BxLxGxRxK = tp(self.qkv(h), 2)
        q = tp(qkv_BxLxGxRxK[:, :, :, :group].reshape(b, l, self.heads, kd), 2)
        k = tp(qkv_BxLxGxRxK[:, :, :, group], 2)
        v = tp(qkv_BxLxGxRxK[:, :, :, group + 1], 2)
        q, k = rotate(q, angles_BxLxJ), rotate(k, angles_BxLxJ)
        a = self_attention(
            q,
            k,
            v,
            causal=True,
            positions=positions,
            segment_ids=segment_ids,
            max_segments=self.max_segments,
        )
        a = tp(a.reshape(b, l, self.heads * kd), 2)
        x_BxLxD = x_BxLxD + parallel.exit_tensor_parallel(self.o(a))
        h = parallel.enter_tensor_parallel(self.mlp_norm(x_BxLxD))
        gate_up_BxLx2xF = tp(self.gate_up(h), 3)
        hidden = jax.nn.silu(gate_up_BxLx2xF[:, :, 0]) * gate_up_BxLx2xF[:, :, 1]
        return x_BxLxD + parallel.exit_tensor_parallel(self.down(tp(hidden, 2)))


def make_qwen_llm(
    cfg: LLMConfig,
    section: Sequence[int],
    placeholders: Mapping[str, int],
    dtype: Any = jnp.float32,
    name: str = "llm",
    *,
    loss_capacity: int | None = None,
    max_segments: int | None = None,
) -> StagedModule:
    """The Qwen2 decoder; ``section``: the mRoPE pairs per temporal/height/width position;
    ``placeholders``: modality -> token id (``{"image": id}``: images and videos alike);
    ``max_segments``: a bound on packed rows' segments (the fused attention's layout)."""
    if cfg.moe is not None or cfg.tie_embeddings:
        raise ValueError("the Qwen LLM has a dense MLP and an untied head")
    return StagedModule(
        name,
        pre=lambda rngs: TokenEmbed(cfg, placeholders, rngs=rngs, dtype=dtype),
        block=lambda rngs: QwenDecoderBlock(
            cfg, section, rngs=rngs, dtype=dtype, max_segments=max_segments
        ),
        post=lambda rngs: LMHeadLoss(cfg, rngs=rngs, dtype=dtype, capacity=loss_capacity),
        num_layers=cfg.depth,
    )
