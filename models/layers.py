"""Flax NNX building blocks shared by the encoders and the LLM.

Every parameter carries logical axis names in ``nnx.Param(..., axes=...)`` (see
``hetjax.modules.staged``). Names follow Megatron-style tensor parallelism: column-
parallel kernels put ``"heads"``/``"kv_heads"``/``"mlp"`` on their OUTPUT dim, row-parallel
kernels put the same name on their INPUT dim, so one name -> mesh-axis map shards both.

Parameters are stored in float32; ``dtype`` is the compute dtype (float32 or bfloat16).
Softmax, normalisation statistics and the loss are always computed in float32.

Shape key: B batch, L sequence, D width, H heads, G kv heads, R query heads per kv head
(H / G), K head dim, F MLP width.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from hetjax.ops import MoEFFN, attach_aux_loss, load_balance_loss_per_sample
from hetjax.ops import context as parallel
from hetjax.ops.attention import attention as attention  # re-exported for the tests
from hetjax.ops.attention import self_attention
from hetjax.ops.dense import dense
from models.config import MoEConfig

Axes = tuple[str | None, ...]
INIT_STD = 0.02


def normal_param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: Axes) -> nnx.Param:
    return nnx.Param(INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32), axes=axes)


class Dense(nnx.Module):
    """``y = x @ W (+ b)`` with named axes on ``W`` (and on ``b``, its output names).

    ``d_out`` may be a shape: ``W`` is then ``[d_in, *d_out]`` and ``y`` ends in
    ``d_out``, still ONE matmul. Fused projections use it so that a tensor-parallel split
    of one named output dim keeps what belongs together on one rank (a kv group's q, k
    and v; a column's gate and up), which a flat ``[d_in, n]`` kernel could not.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int | tuple[int, ...],
        *,
        axes: Axes,
        rngs: nnx.Rngs,
        use_bias: bool = False,
        dtype: Any = jnp.float32,
    ):
        out = (d_out,) if isinstance(d_out, int) else tuple(d_out)
        self.kernel = normal_param(rngs, (d_in, *out), axes)
        self.bias = nnx.Param(jnp.zeros(out), axes=tuple(axes[1:])) if use_bias else None
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        y = dense(x.astype(self.dtype), self.kernel[...])  # weight gradient in float32
        return y if self.bias is None else y + self.bias[...].astype(self.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float = 1e-5, dtype: Any = jnp.float32):
        self.scale = nnx.Param(jnp.ones((dim,)), axes=("embed",))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...]).astype(self.dtype)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float = 1e-6, dtype: Any = jnp.float32):
        self.scale = nnx.Param(jnp.ones((dim,)), axes=("embed",))
        self.bias = nnx.Param(jnp.zeros((dim,)), axes=("embed",))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...] + self.bias[...]).astype(self.dtype)


ACTIVATIONS = {  # Hugging Face activation names
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "silu": jax.nn.silu,
}


def activation(name: str):
    """The activation called ``name`` in Hugging Face configs (``hidden_act``)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}: use one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def rope_angles(positions: jax.Array, head_dim: int, theta: float) -> jax.Array:
    """Rotation angles ``[..., K/2]``: ``pos * theta^(-2i/K)`` for positions ``[...]``."""
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    return positions.astype(jnp.float32)[..., None] * inv_freq


def apply_rope(x_BxLxHxK: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Llama RoPE (half-split convention): rotates pairs ``(x[i], x[i + K/2])``.

    ``positions``: ``[L]`` (shared by the batch) or ``[B, L]`` (packed rows: per sample).
    """
    k = x_BxLxHxK.shape[-1]
    ang = rope_angles(positions, k, theta)
    ang = ang[None, :, None, :] if positions.ndim == 1 else ang[:, :, None, :]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x = x_BxLxHxK.astype(jnp.float32)
    x1, x2 = x[..., : k // 2], x[..., k // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxHxK.dtype)


class MoEMLP(nnx.Module):
    """Mixture-of-experts MLP; experts split over the stage's ``ep`` ranks (all-to-all).

    Its load-balancing loss is computed per sample and attached to the gradients (see
    ``hetjax.ops.aux_loss``), so results do not depend on the batch split.
    """

    def __init__(self, width: int, mlp: int, cfg: MoEConfig, *, rngs: nnx.Rngs, dtype: Any):
        self.cfg = cfg
        self.ffn = MoEFFN(
            width,
            mlp,
            cfg.num_experts,
            top_k=cfg.top_k,
            capacity_factor=cfg.capacity_factor,
            rngs=rngs,
            dtype=dtype,
        )

    def __call__(self, h_BxLxD: jax.Array) -> jax.Array:
        ctx = parallel.current()
        if ctx is not None and ctx.ep > 1:
            y, _ = self.ffn(h_BxLxD, mesh=ctx.mesh, batch_axes=ctx.batch_axes)
        else:
            y, _ = self.ffn(h_BxLxD)
        aux = load_balance_loss_per_sample(h_BxLxD, self.ffn.router[...], self.cfg.top_k)
        return attach_aux_loss(y.astype(h_BxLxD.dtype), self.cfg.aux_weight * jnp.sum(aux))


class EncoderBlock(nnx.Module):
    """Pre-norm ViT block: LayerNorm -> bidirectional MHA -> LayerNorm -> MLP.

    ``bias=True`` gives the attention projections and the MLP's down projection biases
    (CLIP, SigLIP); ``act`` is the MLP activation by its Hugging Face name.
    """

    def __init__(
        self,
        width: int,
        heads: int,
        mlp: int,
        *,
        rngs: nnx.Rngs,
        dtype: Any,
        moe: MoEConfig | None = None,
        bias: bool = False,
        act: str = "gelu_pytorch_tanh",
        eps: float = 1e-6,
    ):
        self.heads = heads
        self.act = act
        self.norm1 = LayerNorm(width, eps=eps, dtype=dtype)
        self.qkv = Dense(
            width, 3 * width, axes=("embed", "heads"), rngs=rngs, use_bias=bias, dtype=dtype
        )
        self.out = Dense(
            width, width, axes=("heads", "embed"), rngs=rngs, use_bias=bias, dtype=dtype
        )
        self.norm2 = LayerNorm(width, eps=eps, dtype=dtype)
        self.moe = MoEMLP(width, mlp, moe, rngs=rngs, dtype=dtype) if moe else None
        if moe is None:
            self.up = Dense(
                width, mlp, axes=("embed", "mlp"), rngs=rngs, use_bias=True, dtype=dtype
            )
            self.down = Dense(
                mlp, width, axes=("mlp", "embed"), rngs=rngs, use_bias=bias, dtype=dtype
            )

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        b, l, d = x_BxLxD.shape
        # qkv output is laid out [H, 3, K] so a TP split over "heads" keeps whole heads.
        h = parallel.enter_tensor_parallel(self.norm1(x_BxLxD))
        qkv = self.qkv(h).reshape(b, l, self.heads, 3, d // self.heads)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        a = self_attention(q, k, v, causal=False)
        a = a.reshape(b, l, d)
        x_BxLxD = x_BxLxD + parallel.exit_tensor_parallel(self.out(a))
        h = parallel.enter_tensor_parallel(self.norm2(x_BxLxD))
        if self.moe is not None:
            return x_BxLxD + parallel.exit_tensor_parallel(self.moe(h))
        hidden = activation(self.act)(self.up(h))
        return x_BxLxD + parallel.exit_tensor_parallel(self.down(hidden))


class DecoderBlock(nnx.Module):
    """Llama block: RMSNorm -> causal GQA with RoPE -> RMSNorm -> SwiGLU.

    Packed rows (several samples per row) pass ``segment_ids`` and ``positions`` ``[B, L]``
    (stored like the tokens): attention stays within a segment and RoPE uses the
    positions within each sample, so every sample computes what it would alone.
    ``max_segments`` bounds the runs of equal segment ids in any row (the data guarantees
    it): bf16 attention on a GPU then takes cuDNN's packed layout instead of a bias.
    """

    def __init__(
        self,
        width: int,
        heads: int,
        kv_heads: int,
        mlp: int,
        *,
        rope_theta: float,
        eps: float,
        rngs: nnx.Rngs,
        dtype: Any,
        moe: MoEConfig | None = None,
        max_segments: int | None = None,
    ):
        if heads % kv_heads:
            raise ValueError(
                f"DecoderBlock: heads={heads} is not a multiple of kv_heads={kv_heads}; "
                "use kv_heads dividing heads"
            )
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.rope_theta = rope_theta
        self.max_segments = max_segments
        kd, group = self.head_dim, heads // kv_heads
        self.attn_norm = RMSNorm(width, eps=eps, dtype=dtype)
        # One matmul for q, k and v, laid out per kv group [G, R + 2, K]: the group's R
        # query heads, then its key and its value. A tp split of "kv_heads" (G) keeps
        # whole groups, the query heads with the key/value they attend with.
        self.qkv = Dense(
            width,
            (kv_heads, group + 2, kd),
            axes=("embed", "kv_heads", None, None),
            rngs=rngs,
            dtype=dtype,
        )
        self.o = Dense(heads * kd, width, axes=("heads", "embed"), rngs=rngs, dtype=dtype)
        self.mlp_norm = RMSNorm(width, eps=eps, dtype=dtype)
        self.moe = MoEMLP(width, mlp, moe, rngs=rngs, dtype=dtype) if moe else None
        if moe is None:
            # gate and up as one [D, 2, F] matmul, F split over tp: each rank keeps the
            # gate and up columns its SwiGLU multiplies together.
            self.gate_up = Dense(
                width, (2, mlp), axes=("embed", None, "mlp"), rngs=rngs, dtype=dtype
            )
            self.down = Dense(mlp, width, axes=("mlp", "embed"), rngs=rngs, dtype=dtype)

    def __call__(
        self,
        x_BxLxD: jax.Array,
        *,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        b, l, _ = x_BxLxD.shape
        kd = self.head_dim
        ctx = parallel.current()
        if (segment_ids is None) != (positions is None):
            raise ValueError("DecoderBlock: packed rows need both segment_ids and positions")
        # Under context parallelism the sequence is stored load-balanced (permuted):
        # RoPE and the causal mask use each element's ORIGINAL position. Packed rows'
        # positions restart per sample; in a segment their order is the original one.
        if positions is None:
            positions = jnp.arange(l) if ctx is None else jnp.asarray(ctx.positions(l))
        h = parallel.enter_tensor_parallel(self.attn_norm(x_BxLxD))
        tp = parallel.tensor_parallel_activation  # heads (dim 2) stay split over tp
        group = self.heads // self.kv_heads
        qkv_BxLxGxRxK = tp(self.qkv(h), 2)
        q = tp(qkv_BxLxGxRxK[:, :, :, :group].reshape(b, l, self.heads, kd), 2)
        k = tp(qkv_BxLxGxRxK[:, :, :, group], 2)
        v = tp(qkv_BxLxGxRxK[:, :, :, group + 1], 2)
        q = apply_rope(q, positions, self.rope_theta)
        k = apply_rope(k, positions, self.rope_theta)
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
        if self.moe is not None:
            return x_BxLxD + parallel.exit_tensor_parallel(self.moe(h))
        gate_up_BxLx2xF = tp(self.gate_up(h), 3)
        hidden = jax.nn.silu(gate_up_BxLx2xF[:, :, 0]) * gate_up_BxLx2xF[:, :, 1]
        y = self.down(tp(hidden, 2))
        return x_BxLxD + parallel.exit_tensor_parallel(y)
