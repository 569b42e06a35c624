"""Which Hugging Face tensors make each hetjax parameter, and how (both directions).

One table per module (:func:`rules_for`): transposed linear, convolution as a patch
matmul, the encoders' q/k/v fused per head, the LLM's q/k/v fused per kv group and its
gate/up stacked, layers stacked. Loading (:func:`read_leaf`) and saving (:func:`to_hf`)
both read it, so they are exact inverses. The LLM's fused leaves are read lazily: a
slice asks only for the HF rows of its kv groups or MLP columns (a tp rank's share).
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

    # "same" | "linear" (W.T) | "patch" (conv -> matmul) | "qkv" (fuse per head)
    # | "gqa" (q, k, v fused per kv group: [D, G, R + 2, K]) | "stack" (W.T's: [D, n, F])
    kind: str
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
    "blocks.qkv.kernel": Rule("gqa", tuple(_LAYER + f"self_attn.{x}_proj.weight" for x in "qkv")),
    "blocks.o.kernel": Rule("linear", (_LAYER + "self_attn.o_proj.weight",)),
    "blocks.mlp_norm.scale": Rule("same", (_LAYER + "post_attention_layernorm.weight",)),
    "blocks.gate_up.kernel": Rule(
        "stack", (_LAYER + "mlp.gate_proj.weight", _LAYER + "mlp.up_proj.weight")
    ),
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
    if rule.kind == "gqa":
        d, g, r, k = shape
        return [((r - 2) * g * k, d), (g * k, d), (g * k, d)]
    if rule.kind == "stack":
        return [(shape[2], shape[0])] * shape[1]
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
    if rule.kind == "gqa":
        return lambda idx: _read_gqa(rule.names, read, shape, idx)
    if rule.kind == "stack":
        return lambda idx: np.stack(
            [read(n, (idx[2], idx[0])).T for n in rule.names[idx[1]]], axis=1
        )

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


def _read_gqa(names: Sequence[str], read: Callable, shape: tuple[int, ...], idx) -> np.ndarray:
    """Slice ``idx`` of a ``[D, G, R + 2, K]`` fused kernel, reading only the HF rows of
    the kv groups in ``idx[1]`` (and the columns in ``idx[0]``). HF's query head
    ``g * R + r`` attends with kv head ``g`` (``repeat_kv``), so group ``g``'s query
    rows are one contiguous block of ``q_proj``."""
    d_in, groups, r, k = idx[0], idx[1], shape[2] - 2, shape[3]
    g0, g1 = groups.start, groups.stop
    q = read(names[0], (slice(g0 * r * k, g1 * r * k), d_in))
    kv = [read(n, (slice(g0 * k, g1 * k), d_in)) for n in names[1:]]
    rows = np.concatenate(
        [q.reshape(g1 - g0, r, k, -1), *(x.reshape(g1 - g0, 1, k, -1) for x in kv)], axis=1
    )
    return rows.transpose(3, 0, 1, 2)[:, :, idx[2], idx[3]]


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
    if rule.kind == "gqa":  # [D, G, R + 2, K] -> q [G * R * K, D], k, v [G * K, D]
        r = leaf.shape[2] - 2
        q, k, v = leaf[:, :, :r], leaf[:, :, r], leaf[:, :, r + 1]
        return [x.reshape(leaf.shape[0], -1).T for x in (q, k, v)]
    if rule.kind == "stack":
        return [leaf[:, j].T for j in range(leaf.shape[1])]
    return _split_qkv(leaf, rule.heads)
