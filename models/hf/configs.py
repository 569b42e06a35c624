"""Hugging Face ``config.json`` <-> :class:`~models.config.MLLMConfig`, both directions.

LLaVA reads CLIP's hidden state ``vision_feature_layer`` (-2: the output of layer L-1), so
hetjax keeps those layers only (:func:`vision_config`) and exports them with
``vision_feature_layer=-1`` (:func:`hf_config`): the same features.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Mapping
from typing import Any

from models.config import EncoderConfig, LLMConfig, MLLMConfig
from models.mllm import MLLM

from .errors import HFError
from .files import read_config


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
    return decoder_config(text, _rope_theta(text))


def decoder_config(text: Mapping[str, Any], rope_theta: float) -> LLMConfig:
    """The decoder's shape from a ``text_config`` (Llama's keys, which Qwen2 shares)."""
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
        rope_theta=rope_theta,
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
            f"unknown architecture {arch[0]!r}: model.init_from takes a "
            "LlavaForConditionalGeneration checkpoint (use model.init MODULE=DIR for parts)"
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


def llava_config_of(path: str | os.PathLike) -> MLLMConfig:
    """The :class:`MLLMConfig` of a LLaVA checkpoint directory (reads ``config.json``)."""
    path = pathlib.Path(path)
    return llava_config(read_config(path), name=path.resolve().name or "hf-llava")


def parts_config(dirs: Mapping[str, str | os.PathLike], base: MLLMConfig) -> MLLMConfig:
    """``base`` with the vision tower and/or LLM of separate checkpoints
    (``{"vision": CLIP_DIR, "llm": LLAMA_DIR}``), from their ``config.json``."""
    unknown = sorted(set(dirs) - {"vision", "llm"})
    if unknown:
        raise HFError(f"init {unknown[0]!r}: only vision and llm load from checkpoints")
    config = base
    if "vision" in dirs:
        vision = vision_config(read_config(pathlib.Path(dirs["vision"])))
        config = dataclasses.replace(config, vision=vision, projector_act="gelu")
    if "llm" in dirs:
        text = read_config(pathlib.Path(dirs["llm"]))
        config = dataclasses.replace(config, llm=llm_config(text), seq_len=_seq_len(text))
    return config


def hf_config(config: MLLMConfig) -> dict[str, Any]:
    """The ``LlavaForConditionalGeneration`` ``config.json`` of ``config`` (for export)."""
    v, t = config.vision, config.llm
    if v is None or not v.hf:
        raise HFError(
            f"model {config.name!r} has no CLIP or SigLIP vision tower: only LLaVA models "
            "(a LLaVA preset such as model.preset='llava-1.5-tiny', or a model started from "
            "model.init_from) export to Hugging Face"
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
