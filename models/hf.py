"""Hugging Face weights in and out: LLaVA (CLIP or SigLIP + Llama) and its parts.

    >>> model, params = hf.load("llava-1.5-7b-hf")            # LlavaForConditionalGeneration
    >>> dirs = {"vision": "clip-vit-large-patch14-336", "llm": "vicuna-7b-v1.5"}
    >>> model = MLLM(hf.parts_config(dirs, get_preset("llava-1.5-7b")))
    >>> params, report = hf.read_parts(model, dirs, key=jax.random.key(0))  # new projector
    >>> logits = hf.logits(model, params, input_ids, pixel_values)
    >>> hf.save(model, params, "out-hf")                     # from_pretrained loads it

One table per module (:func:`_rules`) says which Hugging Face tensors make each hetjax
parameter and how (transposed linear, convolution as a patch matmul, q/k/v fused per
head, layers stacked); loading and saving both read it, so they are exact inverses.

Reading uses ``safetensors`` and is lazy: :func:`load` with ``lazy=True`` returns
:class:`LazyTensor` leaves that read only the slices asked for. The executor places
parameters with ``jax.make_array_from_callback``, so each process reads only the layers
(pipeline stage) and rows or columns (tensor parallelism) that its own devices hold.
Only CLIP's and SigLIP's fused q/k/v kernels and patch kernels, small next to the LLM,
are read whole per layer.

Key names: both the LLaVA-1.5 checkpoints people download (``vision_tower.vision_model.``,
``language_model.model.``, ``language_model.lm_head.``) and what ``transformers`` 5 writes
(``vision_tower.embeddings``, ``model.language_model.``, ``lm_head.``) are read. Saving
writes the LLaVA-1.5 names, which every ``transformers`` version loads.

What changes on the way: LLaVA reads CLIP's hidden state ``vision_feature_layer`` (-2:
the output of layer L-1), so hetjax keeps those layers only and exports them with
``vision_feature_layer=-1``: the same features. Tensors LLaVA never uses (the last CLIP
layer, ``post_layernorm``, SigLIP's pooling head) are not loaded (:func:`load` reports
them); export writes ``post_layernorm`` as the identity and no pooling head.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.config import EncoderConfig, LLMConfig, MLLMConfig
from models.mllm import MLLM

Index = tuple[slice, ...]


class HFError(ValueError):
    """A Hugging Face checkpoint that cannot be read as the model it claims to be."""


# -- lazy tensors ------------------------------------------------------------------------


class LazyTensor:
    """An array-like view of a parameter on disk: ``x[index]`` reads only that slice.

    ``shape``/``dtype`` are the hetjax parameter's; ``read(index)`` gets a tuple of
    ``slice`` (step 1) per dimension. ``rows(start, stop)`` cuts a stacked leaf to a
    pipeline stage's layers without reading. ``np.asarray(x)`` reads all of it.
    """

    def __init__(self, shape: tuple[int, ...], read: Callable[[Index], np.ndarray]):
        self.shape = tuple(shape)
        self.dtype = np.dtype(np.float32)
        self.ndim = len(self.shape)
        self._read = read

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def __getitem__(self, index: Any) -> np.ndarray:
        if index is Ellipsis:
            index = ()
        index = index if isinstance(index, tuple) else (index,)
        full = [slice(None)] * self.ndim
        full[: len(index)] = index
        norm = []
        for s, n in zip(full, self.shape, strict=True):
            if not isinstance(s, slice) or s.step not in (None, 1):
                raise IndexError(f"LazyTensor takes slices of step 1, not {s!r}")
            norm.append(slice(*s.indices(n)[:2]))
        out = np.asarray(self._read(tuple(norm)), np.float32)
        expected = tuple(s.stop - s.start for s in norm)
        assert out.shape == expected, (out.shape, expected)
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[...]
        return out if dtype is None else out.astype(dtype)

    def rows(self, start: int, stop: int) -> LazyTensor:
        def read(index: Index) -> np.ndarray:
            first = slice(index[0].start + start, index[0].stop + start)
            return self._read((first, *index[1:]))

        return LazyTensor((stop - start, *self.shape[1:]), read)

    def __repr__(self) -> str:
        return f"LazyTensor(shape={self.shape})"


# -- reading safetensors -----------------------------------------------------------------


class _Files:
    """The tensors of one checkpoint directory, by name, opened once with safetensors."""

    def __init__(self, path: pathlib.Path):
        from safetensors import safe_open

        self.path = path
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            if not files:
                raise HFError(f"{path}: no *.safetensors file (and no shard index)")
            weight_map = None
        self._handles: dict[str, Any] = {}
        self.where: dict[str, str] = {}
        for name in files:
            if not (path / name).exists():
                raise HFError(f"{path}: the shard index names {name}, which is missing")
            handle = safe_open(str(path / name), framework="numpy")
            self._handles[name] = handle
            for key in handle.keys():
                self.where[key] = name
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self.where))
            if missing:
                raise HFError(f"{path}: the shard index lists {missing[0]!r}, no shard has it")

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handles[self.where[key]].get_slice(key).get_shape())

    def read(self, key: str, index: Index | None = None) -> np.ndarray:
        file = self.where[key]
        part = self._handles[file].get_slice(key)
        if part.get_dtype() == "BF16":  # numpy has no bfloat16: read through JAX's dtypes
            from safetensors import safe_open

            part = safe_open(str(self.path / file), framework="flax").get_slice(key)
        out = part[index] if index else part[:]
        return np.asarray(out).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class _Tensors:
    """One component's tensors in a checkpoint: canonical name -> name in the file."""

    files: _Files
    names: dict[str, str]  # canonical -> stored
    label: str  # for errors: "vision", "llm", ...

    def get(self, canonical: str) -> str:
        if canonical not in self.names:
            raise HFError(
                f"{self.files.path}: missing tensor {canonical!r} ({self.label}); the "
                "checkpoint does not match its config.json"
            )
        return self.names[canonical]


# Canonical names: a standalone model's keys (CLIPVisionModel / SiglipVisionModel without
# the "vision_model." level, LlamaForCausalLM, the projector without its prefix), from
# (stored prefix, canonical prefix) pairs tried in order.
_LLAVA_PREFIXES = {
    "vision": (("model.vision_tower.vision_model.", ""), ("model.vision_tower.", ""),
               ("vision_tower.vision_model.", ""), ("vision_tower.", "")),
    "projector": (("model.multi_modal_projector.", ""), ("multi_modal_projector.", "")),
    "llm": (("model.language_model.", "model."), ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head.")),
}  # fmt: skip
_PART_PREFIXES = {
    "vision": (("vision_model.", ""), ("", "")),  # CLIPModel's text_model.* stays unused
    "llm": (("model.", "model."), ("lm_head.", "lm_head.")),
}


def _component(files: _Files, label: str, *, inside_llava: bool) -> _Tensors:
    prefixes = (_LLAVA_PREFIXES if inside_llava else _PART_PREFIXES)[label]
    names: dict[str, str] = {}
    for key in files.where:
        for old, new in prefixes:
            if key.startswith(old):
                names.setdefault(new + key[len(old) :], key)
                break
    return _Tensors(files, names, label)


# -- the tables --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Rule:
    """How one hetjax leaf is made: ``kind`` of transform, HF names (``{i}``: layer)."""

    kind: str  # "same" | "linear" (W.T) | "patch" (conv -> matmul) | "qkv" (fuse per head)
    names: tuple[str, ...]
    heads: int = 0  # for "qkv"


def _encoder_rules(cfg: EncoderConfig) -> dict[str, _Rule]:
    layer = "encoder.layers.{i}."
    attn = layer + "self_attn."
    rules = {
        "pre.proj.kernel": _Rule("patch", ("embeddings.patch_embedding.weight",)),
        "pre.pos": _Rule("same", ("embeddings.position_embedding.weight",)),
        "blocks.norm1.scale": _Rule("same", (layer + "layer_norm1.weight",)),
        "blocks.norm1.bias": _Rule("same", (layer + "layer_norm1.bias",)),
        "blocks.qkv.kernel": _Rule(
            "qkv", tuple(attn + f"{x}_proj.weight" for x in "qkv"), heads=cfg.heads
        ),
        "blocks.qkv.bias": _Rule("qkv", tuple(attn + f"{x}_proj.bias" for x in "qkv"), cfg.heads),
        "blocks.out.kernel": _Rule("linear", (attn + "out_proj.weight",)),
        "blocks.out.bias": _Rule("same", (attn + "out_proj.bias",)),
        "blocks.norm2.scale": _Rule("same", (layer + "layer_norm2.weight",)),
        "blocks.norm2.bias": _Rule("same", (layer + "layer_norm2.bias",)),
        "blocks.up.kernel": _Rule("linear", (layer + "mlp.fc1.weight",)),
        "blocks.up.bias": _Rule("same", (layer + "mlp.fc1.bias",)),
        "blocks.down.kernel": _Rule("linear", (layer + "mlp.fc2.weight",)),
        "blocks.down.bias": _Rule("same", (layer + "mlp.fc2.bias",)),
    }
    if cfg.kind == "clip":
        rules["pre.cls"] = _Rule("same", ("embeddings.class_embedding",))
        rules["pre.norm.scale"] = _Rule("same", ("pre_layrnorm.weight",))
        rules["pre.norm.bias"] = _Rule("same", ("pre_layrnorm.bias",))
    else:
        rules["pre.proj.bias"] = _Rule("same", ("embeddings.patch_embedding.bias",))
    return rules


_PROJECTOR_RULES = {
    "pre.fc1.kernel": _Rule("linear", ("linear_1.weight",)),
    "pre.fc1.bias": _Rule("same", ("linear_1.bias",)),
    "pre.fc2.kernel": _Rule("linear", ("linear_2.weight",)),
    "pre.fc2.bias": _Rule("same", ("linear_2.bias",)),
}

_LAYER = "model.layers.{i}."
_LLM_RULES = {
    "pre.table": _Rule("same", ("model.embed_tokens.weight",)),
    "blocks.attn_norm.scale": _Rule("same", (_LAYER + "input_layernorm.weight",)),
    "blocks.q.kernel": _Rule("linear", (_LAYER + "self_attn.q_proj.weight",)),
    "blocks.k.kernel": _Rule("linear", (_LAYER + "self_attn.k_proj.weight",)),
    "blocks.v.kernel": _Rule("linear", (_LAYER + "self_attn.v_proj.weight",)),
    "blocks.o.kernel": _Rule("linear", (_LAYER + "self_attn.o_proj.weight",)),
    "blocks.mlp_norm.scale": _Rule("same", (_LAYER + "post_attention_layernorm.weight",)),
    "blocks.gate.kernel": _Rule("linear", (_LAYER + "mlp.gate_proj.weight",)),
    "blocks.up.kernel": _Rule("linear", (_LAYER + "mlp.up_proj.weight",)),
    "blocks.down.kernel": _Rule("linear", (_LAYER + "mlp.down_proj.weight",)),
    "post.norm.scale": _Rule("same", ("model.norm.weight",)),
    "post.head.kernel": _Rule("linear", ("lm_head.weight",)),
}


def _rules(model: MLLM, module: str) -> dict[str, _Rule]:
    if module == "llm":
        return _LLM_RULES
    if module == "projector":
        return _PROJECTOR_RULES
    return _encoder_rules(model.config.vision)


# -- transforms: HF tensors <-> one layer's hetjax leaf ----------------------------------


def _hf_shapes(rule: _Rule, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The HF tensors' shapes that make a hetjax leaf of ``shape`` (one layer)."""
    if rule.kind == "same":
        return [shape]
    if rule.kind == "linear":
        return [shape[::-1]]
    if rule.kind == "patch":
        raise AssertionError("patch shapes are checked by the caller")
    d = shape[-1] // 3
    return [(d, *shape[:-1])] * 3 if len(shape) == 2 else [(d,)] * 3


def _read_leaf(rule: _Rule, read: Callable, shape: tuple[int, ...], channels: int):
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


def _to_hf(rule: _Rule, leaf: np.ndarray, channels: int) -> list[np.ndarray]:
    """One layer's hetjax leaf -> its HF tensors (in ``rule.names`` order)."""
    if rule.kind == "same":
        return [leaf]
    if rule.kind == "linear":
        return [leaf.T]
    if rule.kind == "patch":
        p = int(round((leaf.shape[0] / channels) ** 0.5))
        return [leaf.reshape(p, p, channels, -1).transpose(3, 2, 0, 1)]
    return _split_qkv(leaf, rule.heads)


# -- configs -----------------------------------------------------------------------------


def _read_config(path: pathlib.Path) -> dict[str, Any]:
    file = path / "config.json"
    if not file.exists():
        raise HFError(f"{path}: no config.json (give a Hugging Face checkpoint directory)")
    return json.loads(file.read_text())


def _rope_theta(text: Mapping[str, Any]) -> float:
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise HFError(f"rope type {kind!r} is not supported (only the default RoPE)")
    return float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))


def llm_config(text: Mapping[str, Any]) -> LLMConfig:
    """An :class:`LLMConfig` from a Llama ``config.json`` (or LLaVA's ``text_config``)."""
    if text.get("model_type", "llama") != "llama":
        raise HFError(f"unknown LLM architecture {text.get('model_type')!r}: only llama")
    for flag in ("attention_bias", "mlp_bias"):
        if text.get(flag):
            raise HFError(f"llama with {flag}=true is not supported")
    if text.get("hidden_act", "silu") != "silu":
        raise HFError(f"llama with hidden_act={text['hidden_act']!r}: only silu")
    if text.get("tie_word_embeddings"):
        raise HFError("tie_word_embeddings=true is not supported: untie the LM head first")
    width, heads = text["hidden_size"], text["num_attention_heads"]
    head_dim = text.get("head_dim") or width // heads
    if head_dim * heads != width:
        raise HFError(f"head_dim={head_dim} x {heads} heads != hidden_size={width}")
    return LLMConfig(
        vocab=text["vocab_size"],
        width=width,
        depth=text["num_hidden_layers"],
        heads=heads,
        kv_heads=text.get("num_key_value_heads") or heads,
        mlp=text["intermediate_size"],
        rope_theta=_rope_theta(text),
        norm_eps=float(text.get("rms_norm_eps", 1e-6)),
    )


_TOWERS = {"clip_vision_model": "clip", "clip": "clip", "siglip_vision_model": "siglip",
           "siglip": "siglip"}  # fmt: skip
_TOWER_ACT = {"clip": "quick_gelu", "siglip": "gelu_pytorch_tanh"}


def vision_config(
    vision: Mapping[str, Any], *, feature_layer: int | None = None, strategy: str | None = None
) -> EncoderConfig:
    """An :class:`EncoderConfig` from a CLIP/SigLIP (vision) ``config.json``, keeping the
    layers up to LLaVA's ``feature_layer`` (default -2 for CLIP, -1 for SigLIP)."""
    if "vision_config" in vision:  # a CLIPModel / SiglipModel config
        vision = {**vision["vision_config"], "model_type": vision.get("model_type")}
    kind = _TOWERS.get(vision.get("model_type", ""))
    if kind is None:
        raise HFError(
            f"unknown vision architecture {vision.get('model_type')!r}: use a CLIP or SigLIP "
            "vision tower"
        )
    if vision.get("hidden_act", _TOWER_ACT[kind]) != _TOWER_ACT[kind]:
        raise HFError(f"{kind} with hidden_act={vision['hidden_act']!r} is not supported")
    strategy = strategy or ("default" if kind == "clip" else "full")
    if (kind, strategy) not in (("clip", "default"), ("siglip", "full")):
        raise HFError(
            f"vision_feature_select_strategy={strategy!r} with {kind} is not supported "
            "(CLIP: 'default', SigLIP: 'full')"
        )
    layers = vision["num_hidden_layers"]
    feature_layer = (-2 if kind == "clip" else -1) if feature_layer is None else feature_layer
    if not isinstance(feature_layer, int):
        raise HFError(f"vision_feature_layer={feature_layer!r}: only one layer is supported")
    depth = layers + 1 + feature_layer if feature_layer < 0 else feature_layer
    if not 1 <= depth <= layers:
        raise HFError(f"vision_feature_layer={feature_layer} with {layers} layers")
    return EncoderConfig(
        kind=kind,
        width=vision["hidden_size"],
        depth=depth,
        heads=vision["num_attention_heads"],
        mlp=vision["intermediate_size"],
        image_size=vision["image_size"],
        patch=vision["patch_size"],
        channels=vision.get("num_channels", 3),
        norm_eps=float(vision.get("layer_norm_eps", 1e-5 if kind == "clip" else 1e-6)),
    )


def _seq_len(text: Mapping[str, Any]) -> int:
    return min(int(text.get("max_position_embeddings", 2048)), 2048)


def llava_config(cfg: Mapping[str, Any], name: str = "hf-llava") -> MLLMConfig:
    """An :class:`MLLMConfig` from a ``LlavaForConditionalGeneration`` ``config.json``."""
    arch = cfg.get("architectures") or [cfg.get("model_type")]
    if cfg.get("model_type") != "llava":
        raise HFError(
            f"unknown architecture {arch[0]!r}: --init-from takes a "
            "LlavaForConditionalGeneration checkpoint (use --init MODULE=DIR for parts)"
        )
    if not cfg.get("multimodal_projector_bias", True):
        raise HFError("multimodal_projector_bias=false is not supported")
    text = cfg["text_config"]
    return MLLMConfig(
        name,
        llm=llm_config(text),
        vision=vision_config(
            cfg["vision_config"],
            feature_layer=cfg.get("vision_feature_layer", -2),
            strategy=cfg.get("vision_feature_select_strategy", "default"),
        ),
        seq_len=_seq_len(text),
        projector_act=cfg.get("projector_hidden_act", "gelu"),
        image_token_id=cfg.get("image_token_index", cfg.get("image_token_id", 32000)),
    )


# -- loading -----------------------------------------------------------------------------


def _load_module(model: MLLM, module: str, tensors: _Tensors, *, lazy: bool) -> dict:
    """One module's parameter tree read from ``tensors`` (a dict of parts)."""
    abstract = model.modules[module].abstract_params()
    channels = model.config.vision.channels if model.config.vision else 3
    files = tensors.files
    out: dict[str, Any] = {}
    for path, rule in _rules(model, module).items():
        part, *keys = path.split(".")
        node = abstract[part]
        for k in keys:
            node = node[k]
        stacked = part == "blocks"
        shape = tuple(node.shape[1:] if stacked else node.shape)
        layers = range(node.shape[0]) if stacked else [None]
        per_layer = []
        for i in layers:
            names = [tensors.get(n.format(i=i)) for n in rule.names]
            _check_shapes(rule, names, shape, files, channels, module, path)
            per_layer.append(
                _read_leaf(
                    dataclasses.replace(rule, names=tuple(names)), files.read, shape, channels
                )
            )
        if stacked:
            full = (len(per_layer), *shape)
            leaf = LazyTensor(
                full,
                lambda idx, per_layer=per_layer: np.stack(
                    [per_layer[i](idx[1:]) for i in range(idx[0].start, idx[0].stop)]
                ).reshape(idx[0].stop - idx[0].start, *[s.stop - s.start for s in idx[1:]]),
            )
        else:
            leaf = LazyTensor(shape, per_layer[0])
        target = out.setdefault(part, {})
        for k in keys[:-1]:
            target = target.setdefault(k, {})
        target[keys[-1]] = leaf if lazy else np.asarray(leaf)
    return out


def _check_shapes(rule, names, shape, files: _Files, channels, module, path) -> None:
    if rule.kind == "patch":
        p = int(round((shape[0] / channels) ** 0.5))
        expected = [(shape[1], channels, p, p)]
    else:
        expected = _hf_shapes(rule, shape)
    for name, want in zip(names, expected, strict=True):
        got = files.shape(name)
        if tuple(got) != tuple(want):
            raise HFError(
                f"{files.path}: tensor {name!r} has shape {tuple(got)}, the config needs "
                f"{tuple(want)} (for {module}.{path})"
            )


def _used(model: MLLM, module: str, tensors: _Tensors) -> set[str]:
    abstract = model.modules[module].abstract_params()
    depth = jax.tree.leaves(abstract.get("blocks", {"": np.zeros((0,))}))[0].shape[0]
    used = set()
    for path, rule in _rules(model, module).items():
        layers = range(depth) if path.startswith("blocks.") else [0]
        used |= {tensors.names.get(n.format(i=i)) for n in rule.names for i in layers}
    return used


@dataclasses.dataclass
class LoadReport:
    """What a load read: each module's source, and the stored tensors it did not use."""

    sources: dict[str, str] = dataclasses.field(default_factory=dict)
    unused: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # per directory

    def lines(self) -> list[str]:
        by_source: dict[str, list[str]] = {}
        for module, src in self.sources.items():
            by_source.setdefault(src, []).append(module)
        out = []
        for src, modules in by_source.items():
            skipped = self.unused.get(src, [])
            note = f"; {len(skipped)} tensors unused (e.g. {skipped[0]})" if skipped else ""
            out.append(f"init: {', '.join(modules)} from {src}{note}")
        return out


def load(
    path: str | os.PathLike, *, lazy: bool = False, dtype: Any = jnp.float32
) -> tuple[MLLM, dict[str, Any]]:
    """A LLaVA checkpoint directory -> ``(model, params)``; the model config comes from
    its ``config.json``. ``lazy=True``: :class:`LazyTensor` leaves (read on placement)."""
    model = MLLM(llava_config_of(path), dtype=dtype)
    params, _ = read_llava(model, path, lazy=lazy)
    return model, params


def llava_config_of(path: str | os.PathLike) -> MLLMConfig:
    """The :class:`MLLMConfig` of a LLaVA checkpoint directory (reads ``config.json``)."""
    path = pathlib.Path(path)
    return llava_config(_read_config(path), name=path.resolve().name or "hf-llava")


def read_llava(
    model: MLLM, path: str | os.PathLike, *, lazy: bool = False
) -> tuple[dict[str, Any], LoadReport]:
    """``model``'s parameters from a LLaVA checkpoint directory, and what was read."""
    path = pathlib.Path(path)
    files = _Files(path)
    report, params = LoadReport(), {}
    used: set[str] = set()
    for module in ("vision", "projector", "llm"):
        tensors = _component(files, module, inside_llava=True)
        params[module] = _load_module(model, module, tensors, lazy=lazy)
        used |= _used(model, module, tensors)
        report.sources[module] = str(path)
    report.unused[str(path)] = sorted(set(files.where) - used)
    return params, report


def parts_config(dirs: Mapping[str, str | os.PathLike], base: MLLMConfig) -> MLLMConfig:
    """``base`` with the vision tower and/or LLM of separate checkpoints
    (``{"vision": CLIP_DIR, "llm": LLAMA_DIR}``), from their ``config.json``."""
    unknown = sorted(set(dirs) - {"vision", "llm"})
    if unknown:
        raise HFError(f"init {unknown[0]!r}: only vision and llm load from checkpoints")
    config = base
    if "vision" in dirs:
        vision = vision_config(_read_config(pathlib.Path(dirs["vision"])))
        config = dataclasses.replace(config, vision=vision, projector_act="gelu")
    if "llm" in dirs:
        text = _read_config(pathlib.Path(dirs["llm"]))
        config = dataclasses.replace(config, llm=llm_config(text), seq_len=_seq_len(text))
    return config


def read_parts(
    model: MLLM,
    dirs: Mapping[str, str | os.PathLike],
    *,
    key: jax.Array,
    lazy: bool = False,
) -> tuple[dict[str, Any], LoadReport]:
    """``model``'s parameters: the modules in ``dirs`` from their checkpoints, the others
    (e.g. the projector) freshly initialised from ``key`` as :meth:`MLLM.init` does."""
    fresh = model.init(key)
    params = {k: v for k, v in fresh.items() if k not in dirs}
    report = LoadReport()
    for module, d in dirs.items():
        files = _Files(pathlib.Path(d))
        tensors = _component(files, module, inside_llava=False)
        params[module] = _load_module(model, module, tensors, lazy=lazy)
        report.sources[module] = str(d)
        report.unused[str(d)] = sorted(set(files.where) - _used(model, module, tensors))
    for module in fresh:
        report.sources.setdefault(module, "a fresh initialisation")
    return params, report


# -- saving ------------------------------------------------------------------------------

_SAVE_PREFIX = {
    "vision": "vision_tower.vision_model.",
    "projector": "multi_modal_projector.",
    "llm": "language_model.",
}


def _hf_config(config: MLLMConfig) -> dict[str, Any]:
    v, t = config.vision, config.llm
    if v is None or not v.hf:
        raise HFError(
            f"model {config.name!r} has no CLIP or SigLIP vision tower: only LLaVA models "
            "(e.g. --preset llava-1.5-tiny, or --init-from) export to Hugging Face"
        )
    if config.audio is not None:
        raise HFError("models with an audio encoder have no Hugging Face LLaVA form")
    vision = {
        "model_type": f"{v.kind}_vision_model",
        "hidden_size": v.width,
        "intermediate_size": v.mlp,
        "num_hidden_layers": v.depth,
        "num_attention_heads": v.heads,
        "image_size": v.image_size,
        "patch_size": v.patch,
        "num_channels": v.channels,
        "layer_norm_eps": v.norm_eps,
        "hidden_act": v.act,
    }
    if v.kind == "siglip":
        vision["vision_use_head"] = False
    text = {
        "model_type": "llama",
        "vocab_size": t.vocab,
        "hidden_size": t.width,
        "intermediate_size": t.mlp,
        "num_hidden_layers": t.depth,
        "num_attention_heads": t.heads,
        "num_key_value_heads": t.kv_heads,
        "head_dim": t.head_dim,
        "rms_norm_eps": t.norm_eps,
        "rope_theta": t.rope_theta,
        "hidden_act": "silu",
        "max_position_embeddings": max(config.seq_len, 2048),
        "tie_word_embeddings": False,
    }
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "vision_config": vision,
        "text_config": text,
        "image_token_index": MLLM(config).placeholder("image"),
        "projector_hidden_act": config.projector_act,
        "multimodal_projector_bias": True,
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "default" if v.kind == "clip" else "full",
        "image_seq_length": v.num_tokens,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def save(model: MLLM, params: Mapping[str, Any], path: str | os.PathLike) -> pathlib.Path:
    """Writes ``params`` (single-device layout, host or device arrays) as a Hugging Face
    ``LlavaForConditionalGeneration`` directory: ``config.json`` + ``model.safetensors``."""
    from safetensors.numpy import save_file

    path = pathlib.Path(path)
    config = _hf_config(model.config)
    channels = model.config.vision.channels
    tensors: dict[str, np.ndarray] = {}
    for module, prefix in _SAVE_PREFIX.items():
        tree = params[module]
        for rule_path, rule in _rules(model, module).items():
            node = tree
            for k in rule_path.split("."):
                node = node[k]
            leaf = np.asarray(node, np.float32)
            layers = range(leaf.shape[0]) if rule_path.startswith("blocks.") else [None]
            for i in layers:
                value = leaf if i is None else leaf[i]
                for name, t in zip(rule.names, _to_hf(rule, value, channels), strict=True):
                    tensors[prefix + name.format(i=i)] = np.ascontiguousarray(t)
    width = model.config.vision.width  # LLaVA never applies it: write the identity
    tensors[_SAVE_PREFIX["vision"] + "post_layernorm.weight"] = np.ones(width, np.float32)
    tensors[_SAVE_PREFIX["vision"] + "post_layernorm.bias"] = np.zeros(width, np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


# -- logits ------------------------------------------------------------------------------


def logits(model: MLLM, params: Mapping[str, Any], input_ids: Any, pixel_values: Any) -> np.ndarray:
    """Float32 logits ``[B, L, vocab]`` of a LLaVA model, on one device.

    Args:
        input_ids: int ``[B, L]``, the config's image token at each image position
            (expanded: one id per image token, as current HF processors do).
        pixel_values: float32 ``[B, C, H, W]``, as ``CLIPImageProcessor`` outputs.
    """
    params = jax.tree.map(jnp.asarray, params)
    return np.asarray(_logits(model, params, jnp.asarray(input_ids), jnp.asarray(pixel_values)))


@functools.partial(jax.jit, static_argnums=0)
def _logits(model: MLLM, params, input_ids, pixel_values):
    images = jnp.transpose(pixel_values, (0, 2, 3, 1))
    llm = model.modules["llm"]
    h = llm.apply_pre(params["llm"]["pre"], input_ids, **model.encode(params, {"images": images}))
    h = llm.apply_blocks(params["llm"]["blocks"], h)
    return llm.bind("post", params["llm"]["post"]).logits(h)
