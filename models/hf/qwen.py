"""Qwen2.5-VL weights in and out: which HF tensors make each hetjax parameter.

One table (:func:`qwen_rules`) serves reading (lazy, per slice, as LLaVA's) and writing,
so the two are exact inverses. Besides :mod:`models.hf.rules`' transforms, the family
needs: ``flat`` (a weight flattened past its first dim, transposed, reshaped: the
Conv3d patch embedding as a matmul, the tower's fused ``[D, 3, H, K]`` q/k/v), ``shape``
(a bias reshaped), ``gqa_bias`` (the LLM's q/k/v biases fused per kv group, as their
kernels) and ``stack_bias`` (the SwiGLU's gate/up biases). The tower's stacked leaves
are periods of layers (:class:`models.qwen.config.QwenVisionConfig`): hetjax leaf
``blocks.layer{j}`` of period ``g`` is HF block ``g * period + j``.

Names: the released checkpoints' and what transformers 5 saves (``visual.``, ``model.``,
``lm_head.``) and transformers 5's module names (``model.visual.``,
``model.language_model.``) are read; the former are written.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from models.qwen.config import QwenVisionConfig

from . import rules as base
from .errors import HFError
from .files import Files, Tensors
from .lazy import LazyTensor
from .qwen_config import hf_qwen_config, tied
from .rules import Rule

# (stored prefix, canonical prefix), tried in order.
_PREFIXES = (
    ("model.visual.", "visual."),
    ("model.language_model.", "model."),
    ("visual.", "visual."),
    ("lm_head.", "lm_head."),
    ("model.", "model."),
)
_NEW_KINDS = ("flat", "shape", "gqa_bias", "stack_bias")


@dataclasses.dataclass(frozen=True)
class Entry:
    """A hetjax leaf: its module, path (``part.name.param``), rule and, for stacked
    leaves, the HF layer of stacked index ``g`` (``layer(g)``)."""

    module: str
    path: str
    rule: Rule
    layer: Callable[[int], int] | None = None
    hf_shape: tuple[int, ...] | None = None  # "flat": the HF weight's shape


def qwen_rules(vision: QwenVisionConfig, *, tied_head: bool = False) -> list[Entry]:
    """Every parameter of a :class:`~models.qwen.QwenVL` and how HF stores it."""
    v, p = vision, vision.period
    out = [
        Entry(
            "vision",
            "pre.proj.kernel",
            Rule("flat", ("visual.patch_embed.proj.weight",)),
            hf_shape=(v.width, v.channels, v.temporal_patch, v.patch, v.patch),
        )
    ]
    blk = "visual.blocks.{i}."
    for j in range(p):
        pre = f"blocks.layer{j}."
        layer = lambda g, j=j: g * p + j  # noqa: E731
        table = {
            "norm1.scale": Rule("same", (blk + "norm1.weight",)),
            "norm2.scale": Rule("same", (blk + "norm2.weight",)),
            "qkv.kernel": Rule("flat", (blk + "attn.qkv.weight",)),
            "qkv.bias": Rule("shape", (blk + "attn.qkv.bias",)),
            "proj.kernel": Rule("linear", (blk + "attn.proj.weight",)),
            "proj.bias": Rule("same", (blk + "attn.proj.bias",)),
            "gate_up.kernel": Rule(
                "stack", (blk + "mlp.gate_proj.weight", blk + "mlp.up_proj.weight")
            ),
            "gate_up.bias": Rule(
                "stack_bias", (blk + "mlp.gate_proj.bias", blk + "mlp.up_proj.bias")
            ),
            "down.kernel": Rule("linear", (blk + "mlp.down_proj.weight",)),
            "down.bias": Rule("same", (blk + "mlp.down_proj.bias",)),
        }
        for path, rule in table.items():
            shape = (3 * v.width, v.width) if path == "qkv.kernel" else None
            out.append(Entry("vision", pre + path, rule, layer, hf_shape=shape))
    merger = "visual.merger."
    out += [
        Entry("projector", "pre.norm.scale", Rule("same", (merger + "ln_q.weight",))),
        Entry("projector", "pre.fc1.kernel", Rule("linear", (merger + "mlp.0.weight",))),
        Entry("projector", "pre.fc1.bias", Rule("same", (merger + "mlp.0.bias",))),
        Entry("projector", "pre.fc2.kernel", Rule("linear", (merger + "mlp.2.weight",))),
        Entry("projector", "pre.fc2.bias", Rule("same", (merger + "mlp.2.bias",))),
    ]
    lay = "model.layers.{i}."
    attn = [lay + f"self_attn.{x}_proj." for x in "qkv"]
    llm = {
        "pre.table": Rule("same", ("model.embed_tokens.weight",)),
        "blocks.attn_norm.scale": Rule("same", (lay + "input_layernorm.weight",)),
        "blocks.qkv.kernel": Rule("gqa", tuple(a + "weight" for a in attn)),
        "blocks.qkv.bias": Rule("gqa_bias", tuple(a + "bias" for a in attn)),
        "blocks.o.kernel": Rule("linear", (lay + "self_attn.o_proj.weight",)),
        "blocks.mlp_norm.scale": Rule("same", (lay + "post_attention_layernorm.weight",)),
        "blocks.gate_up.kernel": Rule(
            "stack", (lay + "mlp.gate_proj.weight", lay + "mlp.up_proj.weight")
        ),
        "blocks.down.kernel": Rule("linear", (lay + "mlp.down_proj.weight",)),
        "post.norm.scale": Rule("same", ("model.norm.weight",)),
        "post.head.kernel": Rule(
            "linear", ("model.embed_tokens.weight" if tied_head else "lm_head.weight",)
        ),
    }
    for path, rule in llm.items():
        out.append(Entry("llm", path, rule, (lambda g: g) if path.startswith("blocks.") else None))
    return out


# -- one layer's leaf from its HF tensors, and back -----------------------------------


def _hf_shapes(entry: Entry, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    kind = entry.rule.kind
    if kind == "flat":
        return [entry.hf_shape]
    if kind == "shape":
        return [(int(np.prod(shape)),)]
    if kind == "gqa_bias":
        g, r, k = shape
        return [((r - 2) * g * k,), (g * k,), (g * k,)]
    if kind == "stack_bias":
        return [(shape[1],)] * shape[0]
    return base.hf_shapes(entry.rule, shape)


def _read_leaf(rule: Rule, read: Callable, shape: tuple[int, ...]):
    """A reader ``index -> array`` of one layer's leaf (new kinds: read whole, sliced)."""
    if rule.kind not in _NEW_KINDS:
        return base.read_leaf(rule, read, shape, 0)

    def whole(idx):
        parts = [read(n, None) for n in rule.names]
        if rule.kind == "flat":
            leaf = parts[0].reshape(parts[0].shape[0], -1).T.reshape(shape)
        elif rule.kind == "shape":
            leaf = parts[0].reshape(shape)
        elif rule.kind == "stack_bias":
            leaf = np.stack(parts)
        else:  # gqa_bias: q [G * R * K], k, v [G * K] -> [G, R + 2, K]
            g, r, k = shape[0], shape[1] - 2, shape[2]
            leaf = np.concatenate(
                [parts[0].reshape(g, r, k), parts[1].reshape(g, 1, k), parts[2].reshape(g, 1, k)],
                axis=1,
            )
        return leaf[idx]

    return whole


def _to_hf(entry: Entry, leaf: np.ndarray) -> list[np.ndarray]:
    kind = entry.rule.kind
    if kind == "flat":
        return [leaf.reshape(leaf.shape[0], -1).T.reshape(entry.hf_shape)]
    if kind == "shape":
        return [leaf.reshape(-1)]
    if kind == "stack_bias":
        return list(leaf)
    if kind == "gqa_bias":
        r = leaf.shape[1] - 2
        return [leaf[:, :r].reshape(-1), leaf[:, r].reshape(-1), leaf[:, r + 1].reshape(-1)]
    return base.to_hf(entry.rule, leaf, 0)


# -- reading ---------------------------------------------------------------------------


def canonical(files: Files) -> Tensors:
    """The checkpoint's tensors under their canonical (released checkpoint) names."""
    names: dict[str, str] = {}
    for key in files.where:
        for old, new in _PREFIXES:
            if key.startswith(old):
                names.setdefault(new + key[len(old) :], key)
                break
    return Tensors(files, names, "qwen2.5-vl")


def read_qwen(
    model: Any, path: pathlib.Path, config_json: Mapping[str, Any], *, lazy: bool = False
) -> tuple[dict[str, Any], list[str]]:
    """``model``'s parameters from a Qwen2.5-VL directory, and the stored tensors unused.

    Raises:
        HFError: a tensor is missing or its shape disagrees with ``config.json``.
    """
    files = Files(path)
    tensors = canonical(files)
    tied_head = tied(config_json) and "lm_head.weight" not in tensors.names
    params: dict[str, Any] = {}
    used: set[str] = set()
    for entry in qwen_rules(model.config.vision, tied_head=tied_head):
        node = model.modules[entry.module].abstract_params()
        keys = entry.path.split(".")
        for k in keys:
            node = node[k]
        stacked = entry.layer is not None
        shape = tuple(node.shape[1:] if stacked else node.shape)
        readers = []
        for g in range(node.shape[0]) if stacked else [None]:
            i = None if g is None else entry.layer(g)
            names = tuple(tensors.get(n.format(i=i)) for n in entry.rule.names)
            for name, want in zip(names, _hf_shapes(entry, shape), strict=True):
                if files.shape(name) != tuple(want):
                    raise HFError(
                        f"{path}: tensor {name!r} has shape {files.shape(name)}, the config "
                        f"needs {tuple(want)} (for {entry.module}.{entry.path})"
                    )
            used |= set(names)
            readers.append(
                _read_leaf(dataclasses.replace(entry.rule, names=names), files.read, shape)
            )
        if stacked:
            leaf = LazyTensor(
                (len(readers), *shape),
                lambda idx, rs=readers: np.stack(
                    [rs[g](idx[1:]) for g in range(idx[0].start, idx[0].stop)]
                ).reshape(idx[0].stop - idx[0].start, *[s.stop - s.start for s in idx[1:]]),
            )
        else:
            leaf = LazyTensor(shape, readers[0])
        target = params.setdefault(entry.module, {})
        for k in keys[:-1]:
            target = target.setdefault(k, {})
        target[keys[-1]] = leaf if lazy else np.asarray(leaf)
    return params, sorted(set(files.where) - used)


# -- writing ---------------------------------------------------------------------------


def save_qwen(model: Any, params: Mapping[str, Any], path: pathlib.Path) -> pathlib.Path:
    """Writes ``params`` as a ``Qwen2_5_VLForConditionalGeneration`` directory
    (``config.json`` + ``model.safetensors``, float32)."""
    from safetensors.numpy import save_file

    tensors: dict[str, np.ndarray] = {}
    for entry in qwen_rules(model.config.vision):
        node = params[entry.module]
        for k in entry.path.split("."):
            node = node[k]
        leaf = np.asarray(node, np.float32)
        for g in range(leaf.shape[0]) if entry.layer is not None else [None]:
            value = leaf if g is None else leaf[g]
            i = None if g is None else entry.layer(g)
            for name, t in zip(entry.rule.names, _to_hf(entry, value), strict=True):
                tensors[name.format(i=i)] = np.ascontiguousarray(t)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_qwen_config(model.config), indent=2) + "\n")
    return path


def load_qwen(path: pathlib.Path, *, lazy: bool = False, dtype: Any = None) -> tuple[Any, dict]:
    """A Qwen2.5-VL directory -> ``(QwenVL, params)``, the config from its ``config.json``."""
    import jax.numpy as jnp

    from models.qwen import QwenVL

    from .files import read_config
    from .qwen_config import qwen_config

    config_json = read_config(path)
    name = path.resolve().name or "hf-qwen2.5-vl"
    model = QwenVL(qwen_config(config_json, name), dtype=dtype or jnp.float32)
    params, _ = read_qwen(model, path, config_json, lazy=lazy)
    return model, params
