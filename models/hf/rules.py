"""Which Hugging Face tensors make each hetjax parameter, and how (both directions).

One table per module (:func:`rules_for`): transposed linear, convolution as a patch
matmul, q/k/v fused per head, layers stacked. Loading (:func:`read_leaf`) and saving
(:func:`to_hf`) both read it, so they are exact inverses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from models.config import EncoderConfig
from models.mllm import MLLM


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one hetjax leaf is made: ``kind`` of transform, HF names (``{i}``: layer)."""

    kind: str  # "same" | "linear" (W.T) | "patch" (conv -> matmul) | "qkv" (fuse per head)
    names: tuple[str, ...]
    heads: int = 0  # for "qkv"


def _encoder_rules(cfg: EncoderConfig) -> dict[str, Rule]:
    layer = "encoder.layers.{i}."
    attn = layer + "self_attn."
    rules = {
        "pre.proj.kernel": Rule("patch", ("embeddings.patch_embedding.weight",)),
        "pre.pos": Rule("same", ("embeddings.position_embedding.weight",)),
        "blocks.norm1.scale": Rule("same", (layer + "layer_norm1.weight",)),
        "blocks.norm1.bias": Rule("same", (layer + "layer_norm1.bias",)),
        "blocks.qkv.kernel": Rule(
            "qkv", tuple(attn + f"{x}_proj.weight" for x in "qkv"), heads=cfg.heads
        ),
        "blocks.qkv.bias": Rule("qkv", tuple(attn + f"{x}_proj.bias" for x in "qkv"), cfg.heads),
        "blocks.out.kernel": Rule("linear", (attn + "out_proj.weight",)),
        "blocks.out.bias": Rule("same", (attn + "out_proj.bias",)),
        "blocks.norm2.scale": Rule("same", (layer + "layer_norm2.weight",)),
        "blocks.norm2.bias": Rule("same", (layer + "layer_norm2.bias",)),
        "blocks.up.kernel": Rule("linear", (layer + "mlp.fc1.weight",)),
        "blocks.up.bias": Rule("same", (layer + "mlp.fc1.bias",)),
        "blocks.down.kernel": Rule("linear", (layer + "mlp.fc2.weight",)),
        "blocks.down.bias": Rule("same", (layer + "mlp.fc2.bias",)),
    }
    if cfg.kind == "clip":
        rules["pre.cls"] = Rule("same", ("embeddings.class_embedding",))
        rules["pre.norm.scale"] = Rule("same", ("pre_layrnorm.weight",))
        rules["pre.norm.bias"] = Rule("same", ("pre_layrnorm.bias",))
    else:
        rules["pre.proj.bias"] = Rule("same", ("embeddings.patch_embedding.bias",))
    return rules


_PROJECTOR_RULES = {
    "pre.fc1.kernel": Rule("linear", ("linear_1.weight",)),
    "pre.fc1.bias": Rule("same", ("linear_1.bias",)),
    "pre.fc2.kernel": Rule("linear", ("linear_2.weight",)),
    "pre.fc2.bias": Rule("same", ("linear_2.bias",)),
}

_LAYER = "model.layers.{i}."
_LLM_RULES = {
    "pre.table": Rule("same", ("model.embed_tokens.weight",)),
    "blocks.attn_norm.scale": Rule("same", (_LAYER + "input_layernorm.weight",)),
    "blocks.q.kernel": Rule("linear", (_LAYER + "self_attn.q_proj.weight",)),
    "blocks.k.kernel": Rule("linear", (_LAYER + "self_attn.k_proj.weight",)),
    "blocks.v.kernel": Rule("linear", (_LAYER + "self_attn.v_proj.weight",)),
    "blocks.o.kernel": Rule("linear", (_LAYER + "self_attn.o_proj.weight",)),
    "blocks.mlp_norm.scale": Rule("same", (_LAYER + "post_attention_layernorm.weight",)),
    "blocks.gate.kernel": Rule("linear", (_LAYER + "mlp.gate_proj.weight",)),
    "blocks.up.kernel": Rule("linear", (_LAYER + "mlp.up_proj.weight",)),
    "blocks.down.kernel": Rule("linear", (_LAYER + "mlp.down_proj.weight",)),
    "post.norm.scale": Rule("same", ("model.norm.weight",)),
    "post.head.kernel": Rule("linear", ("lm_head.weight",)),
}


def rules_for(model: MLLM, module: str) -> dict[str, Rule]:
    """The table of ``module`` (``vision``, ``projector`` or ``llm``): hetjax leaf path
    (``part.name.param``) -> its :class:`Rule`."""
    if module == "llm":
        return _LLM_RULES
    if module == "projector":
        return _PROJECTOR_RULES
    return _encoder_rules(model.config.vision)


def hf_shapes(rule: Rule, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The HF tensors' shapes that make a hetjax leaf of ``shape`` (one layer)."""
    if rule.kind == "same":
        return [shape]
    if rule.kind == "linear":
        return [shape[::-1]]
    if rule.kind == "patch":
        raise AssertionError("patch shapes are checked by the caller")
    d = shape[-1] // 3
    return [(d, *shape[:-1])] * 3 if len(shape) == 2 else [(d,)] * 3


def read_leaf(rule: Rule, read: Callable, shape: tuple[int, ...], channels: int):
    """A reader ``index -> array`` of one layer's hetjax leaf from HF tensors."""
    if rule.kind == "same":
        return lambda idx: read(rule.names[0], idx)
    if rule.kind == "linear":
        return lambda idx: read(rule.names[0], idx[::-1]).T
    if rule.kind == "patch":

        def patch(idx):
            w = read(rule.names[0], None)  # [o, c, p, p] -> [(p, p, c), o]
            return w.transpose(2, 3, 1, 0).reshape(shape)[idx]

        return patch

    def qkv(idx):
        parts = [read(name, None) for name in rule.names]
        return _fuse_qkv(parts, rule.heads)[idx]

    return qkv


def _fuse_qkv(parts: Sequence[np.ndarray], heads: int) -> np.ndarray:
    """HF q, k, v (``[D_out, D_in]`` weights or ``[D_out]`` biases) -> hetjax's fused
    ``[D_in, H * 3 * K]`` kernel (or ``[H * 3 * K]`` bias), laid out ``[H, 3, K]``."""
    if parts[0].ndim == 1:
        return np.stack([p.reshape(heads, -1) for p in parts], axis=1).reshape(-1)
    d_in = parts[0].shape[1]
    return np.stack([p.T.reshape(d_in, heads, -1) for p in parts], axis=2).reshape(d_in, -1)


def _split_qkv(fused: np.ndarray, heads: int) -> list[np.ndarray]:
    if fused.ndim == 1:
        h = fused.reshape(heads, 3, -1)
        return [h[:, j].reshape(-1) for j in range(3)]
    d_in = fused.shape[0]
    h = fused.reshape(d_in, heads, 3, -1)
    return [h[:, :, j].reshape(d_in, -1).T for j in range(3)]


def to_hf(rule: Rule, leaf: np.ndarray, channels: int) -> list[np.ndarray]:
    """One layer's hetjax leaf -> its HF tensors (in ``rule.names`` order)."""
    if rule.kind == "same":
        return [leaf]
    if rule.kind == "linear":
        return [leaf.T]
    if rule.kind == "patch":
        p = int(round((leaf.shape[0] / channels) ** 0.5))
        return [leaf.reshape(p, p, channels, -1).transpose(3, 2, 0, 1)]
    return _split_qkv(leaf, rule.heads)
