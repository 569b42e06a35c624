"""What the cost model needs to know about a module, read from the model's own counts.

hetjax never imports ``models/``: a model config is duck-typed. It must offer what
``models.config.MLLMConfig`` does: ``llm`` (width, depth, heads, kv_heads, head_dim, mlp,
moe), ``vision`` (an encoder: width, depth, heads, mlp, num_tokens, moe),
``num_params()`` per part and ``forward_flops(batch, seq_len, supervised)`` per part.

No FLOP or parameter formula lives here: the per-layer and outside-the-layers shares
come from evaluating the model's own formulas twice, at the module's depth and at depth
0 (``dataclasses.replace``). The LLM's non-layer parameters (embedding table, LM head,
final norm) are split evenly between its first and last stage (untied: two tables of the
same size); the encoder's (patch embedding, norms) sit on its first stage and the
projector on its last.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

ENCODER, LLM = "vision", "llm"


@dataclasses.dataclass(frozen=True)
class ModuleShape:
    """One module's sizes per sample, as the cost model reads them."""

    name: str  # "vision" (encoder + projector) or "llm"
    depth: int  # blocks (the pipeline splits them)
    width: int  # model width D
    q_width: int  # heads x head_dim
    kv_width: int  # kv_heads x head_dim
    mlp: int  # MLP hidden width
    mlp_mats: int  # MLP weight matrices (SwiGLU 3, GELU 2)
    heads: int  # attention heads
    kv_heads: int  # key/value heads (TP cannot exceed them without replication)
    tokens: int  # tokens per sample inside the blocks
    layer_params: float  # parameters of one block
    first_params: float  # parameters outside the blocks on the first stage
    last_params: float  # ... on the last stage
    layer_flops: float  # forward FLOPs of one block, per sample
    first_flops: float  # forward FLOPs outside the blocks on the first stage, per sample
    last_flops: float  # ... on the last stage (LM head, projector)
    attention_flops: float  # part of layer_flops in QK^T / PV (weightless), per sample
    out_width: int  # features per token leaving the module (the boundary's width)
    column_mats: int  # column-parallel weight matrices reading a block's normed inputs
    projector: bool  # a two-matmul projector (column then row parallel) on the last stage
    experts: int = 1  # MoE experts per layer (1: dense)
    top_k: int = 1  # expert slots a token fills (routed k; executed: capacity buffers)
    expert_params: float = 0.0  # parameters of one block's experts (split over ep)
    # Parameter arrays fsdp splits (those with a model-width axis): per block, outside the
    # blocks on the first stage, on the last; and those the backward gathers again (the
    # matrices an input gradient needs; vectors are kept, and a first-stage embedding or
    # patch projection has no input gradient). XLA:CPU gathers each array on its own
    # (the engine chains them there: hetjax.runtime.fsdp); GPUs one gather per layer.
    fsdp_arrays: tuple[int, int, int] = (1, 0, 0)
    fsdp_regathered: tuple[int, int, int] = (1, 0, 0)

    @property
    def params(self) -> float:
        """All parameters of the module."""
        return self.depth * self.layer_params + self.first_params + self.last_params


def _shallow(cfg: Any, part: str) -> Any:
    return dataclasses.replace(cfg, **{part: dataclasses.replace(getattr(cfg, part), depth=0)})


@functools.lru_cache(maxsize=256)
def llm_shape(cfg: Any, seq_len: int, executed: bool = False) -> ModuleShape:
    """The LLM of ``cfg`` at ``seq_len`` tokens per sample (every token under the loss);
    ``executed``: attention FLOPs as kernels without a causal skip compute them (the full
    ``L x L`` square, as hetjax's XLA attention does), else causal (flash attention)."""
    if executed and cfg.llm.moe:  # the kernels fill every capacity slot of every expert
        moe = cfg.llm.moe
        cfg = dataclasses.replace(
            cfg, llm=dataclasses.replace(cfg.llm, moe=dataclasses.replace(moe, top_k=slots(moe)))
        )
    llm, flat = cfg.llm, _shallow(cfg, "llm")
    full = cfg.forward_flops(1, seq_len, seq_len, executed=executed)["llm"]
    outside = flat.forward_flops(1, seq_len, seq_len, executed=executed)["llm"]
    params, base = cfg.num_params()["llm"], flat.num_params()["llm"]
    attention = cfg.attention_flops(1, seq_len, executed=executed)["llm"] / llm.depth
    moe = llm.moe
    return ModuleShape(
        name=LLM,
        depth=llm.depth,
        width=llm.width,
        q_width=llm.heads * llm.head_dim,
        kv_width=llm.kv_heads * llm.head_dim,
        mlp=llm.mlp,
        mlp_mats=3,
        heads=llm.heads,
        kv_heads=llm.kv_heads,
        tokens=seq_len,
        layer_params=(params - base) / llm.depth,
        first_params=base / 2,
        last_params=base / 2,
        layer_flops=(full - outside) / llm.depth,
        first_flops=0.0,
        last_flops=outside,
        attention_flops=attention,
        out_width=llm.width,
        column_mats=2,  # fused q|k|v, fused gate|up (the models' Llama block)
        projector=False,
        experts=moe.num_experts if moe else 1,
        top_k=moe.top_k if moe else 1,
        expert_params=_expert_params(moe, llm.width, llm.mlp),
        # two norms, q|k|v, o, then gate|up and down or an MoE's router and experts' two;
        # the embedding table; the final norm and the LM head
        fsdp_arrays=(4 + (3 if moe else 2), 1, 2),
        fsdp_regathered=(2 + (3 if moe else 2), 0, 1),  # the matrices; not the table
    )


def slots(moe: Any) -> int:
    """Expert slots per token that a GShard capacity buffer holds: ``E`` when dropless
    (every expert has room for every token), else about ``capacity_factor x k``."""
    if moe.capacity_factor is None:
        return moe.num_experts
    return min(moe.num_experts, math.ceil(moe.capacity_factor * moe.top_k))


def _expert_params(moe: Any, width: int, mlp: int) -> float:
    # MoEConfig.num_params counts the router (width x E) and then the experts.
    return 0.0 if moe is None else moe.num_params(width, mlp) - width * moe.num_experts


@functools.lru_cache(maxsize=256)
def encoder_shape(cfg: Any) -> ModuleShape:
    """The vision encoder and its projector of ``cfg``; a sample is one image."""
    enc = cfg.vision
    if enc is None:
        raise ValueError("the model has no vision encoder; the planner plans encoder + LLM")
    flat, n = _shallow(cfg, "vision"), 1
    full, outside = cfg.forward_flops(n, 1, 0), flat.forward_flops(n, 1, 0)
    counts, base = cfg.num_params(), flat.num_params()["vision"]
    moe = enc.moe
    return ModuleShape(
        name=ENCODER,
        depth=enc.depth,
        width=enc.width,
        q_width=enc.width,
        kv_width=enc.width,
        mlp=enc.mlp,
        mlp_mats=3 if moe else 2,
        heads=enc.heads,
        kv_heads=enc.heads,
        tokens=n * enc.block_tokens,
        layer_params=(counts["vision"] - base) / enc.depth,
        first_params=base,
        last_params=counts["projector"],
        layer_flops=(full["vision"] - outside["vision"]) / enc.depth,
        first_flops=outside["vision"],
        last_flops=full["projector"],
        attention_flops=cfg.attention_flops(n, 1)["vision"] / enc.depth,
        out_width=cfg.llm.width,
        column_mats=2,  # fused qkv, MLP up
        projector=True,
        experts=moe.num_experts if moe else 1,
        top_k=moe.top_k if moe else 1,
        expert_params=_expert_params(moe, enc.width, enc.mlp),
        # two LayerNorms' scales and biases, qkv, out, up, down; the patch projection and
        # positions; the final LayerNorm and the projector's two matmuls and output bias
        fsdp_arrays=(8, 3, 5),
        fsdp_regathered=(4, 0, 2),  # the matrices; not the patch projection's
    )


def image_tokens(cfg: Any) -> int:
    """LLM tokens one image becomes (the encoder's output tokens)."""
    return cfg.vision.num_tokens
