"""Qwen2.5-VL's ``config.json`` <-> :class:`~models.config.MLLMConfig`, both directions.

Reads the released checkpoints' flat form (text fields at the top, ``rope_scaling``
with ``mrope_section``, ``in_chans``) and the nested one transformers 5 writes
(``text_config``, ``rope_parameters``, ``in_channels``); writes the nested one. A tied
LM head (Qwen2.5-VL-3B) is untied on import: the head starts as a copy of the embedding
table and the export writes both with ``tie_word_embeddings=false``.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping
from typing import Any

from models.config import MLLMConfig
from models.qwen.config import QwenVisionConfig

from .configs import decoder_config
from .errors import HFError
from .files import read_config

MODEL_TYPE = "qwen2_5_vl"


def _text(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    return cfg.get("text_config") or cfg


def _rope(text: Mapping[str, Any], top: Mapping[str, Any]) -> tuple[float, tuple[int, ...]]:
    rope = text.get("rope_parameters") or text.get("rope_scaling") or top.get("rope_scaling")
    rope = rope or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise HFError(f"Qwen2.5-VL with rope type {kind!r}: only mrope is supported")
    theta = rope.get("rope_theta", text.get("rope_theta", top.get("rope_theta", 1000000.0)))
    return float(theta), tuple(rope.get("mrope_section", (16, 24, 24)))


def tied(cfg: Mapping[str, Any]) -> bool:
    """Whether the checkpoint's LM head is its embedding table (no ``lm_head.weight``)."""
    return bool(cfg.get("tie_word_embeddings") or _text(cfg).get("tie_word_embeddings"))


def qwen_config(cfg: Mapping[str, Any], name: str = "hf-qwen2.5-vl") -> MLLMConfig:
    """An :class:`MLLMConfig` from a ``Qwen2_5_VLForConditionalGeneration`` config."""
    if cfg.get("model_type") != MODEL_TYPE:
        raise HFError(f"model_type {cfg.get('model_type')!r} is not {MODEL_TYPE!r}")
    text, vision = _text(cfg), cfg["vision_config"]
    if text.get("use_sliding_window"):
        raise HFError("Qwen2.5-VL with use_sliding_window=true is not supported")
    for part, act in (
        ("text", text.get("hidden_act", "silu")),
        ("vision", vision.get("hidden_act", "silu")),
    ):
        if act != "silu":
            raise HFError(f"Qwen2.5-VL {part} with hidden_act={act!r}: only silu")
    theta, section = _rope(text, cfg)
    llm = decoder_config(text, theta)
    vision_rope = vision.get("rope_parameters") or {}
    tower = QwenVisionConfig(
        width=vision["hidden_size"],
        depth=vision["depth"],
        heads=vision["num_heads"],
        mlp=vision["intermediate_size"],
        out_width=vision.get("out_hidden_size", llm.width),
        patch=vision.get("patch_size", 14),
        temporal_patch=vision.get("temporal_patch_size", 2),
        merge=vision.get("spatial_merge_size", 2),
        window=vision.get("window_size", 112),
        full_attention=tuple(vision.get("fullatt_block_indexes", (7, 15, 23, 31))),
        channels=vision.get("in_channels", vision.get("in_chans", 3)),
        rope_theta=float(vision_rope.get("rope_theta", 10000.0)),
        mrope_section=section,
        tokens_per_second=float(vision.get("tokens_per_second", 2)),
        video_token_id=cfg.get("video_token_id", 151656),
        vision_start_token_id=cfg.get("vision_start_token_id", 151652),
        vision_end_token_id=cfg.get("vision_end_token_id", 151653),
    )
    if tower.out_width != llm.width:
        raise HFError(f"vision out_hidden_size={tower.out_width} != text hidden_size={llm.width}")
    return MLLMConfig(
        name,
        llm=llm,
        vision=tower,
        seq_len=min(int(text.get("max_position_embeddings", 4096)), 4096),
        image_token_id=cfg.get("image_token_id", 151655),
    )


def qwen_config_of(path: pathlib.Path) -> MLLMConfig:
    """The :class:`MLLMConfig` of a Qwen2.5-VL checkpoint directory."""
    return qwen_config(read_config(path), name=path.resolve().name or "hf-qwen2.5-vl")


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x  # HF's field is an int


def hf_qwen_config(config: MLLMConfig) -> dict[str, Any]:
    """The ``Qwen2_5_VLForConditionalGeneration`` ``config.json`` of ``config``."""
    t, v = config.llm, config.vision
    text = {
        "model_type": "qwen2_5_vl_text",
        "vocab_size": t.vocab,
        "hidden_size": t.width,
        "intermediate_size": t.mlp,
        "num_hidden_layers": t.depth,
        "num_attention_heads": t.heads,
        "num_key_value_heads": t.kv_heads,
        "rms_norm_eps": t.norm_eps,
        "hidden_act": "silu",
        "max_position_embeddings": max(config.seq_len, 32768),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": t.rope_theta,
            "mrope_section": list(v.mrope_section),
        },
        "use_sliding_window": False,
    }
    vision = {
        "model_type": "qwen2_5_vl_vision",
        "depth": v.depth,
        "hidden_size": v.width,
        "hidden_act": "silu",
        "intermediate_size": v.mlp,
        "num_heads": v.heads,
        "in_channels": v.channels,
        "patch_size": v.patch,
        "spatial_merge_size": v.merge,
        "temporal_patch_size": v.temporal_patch,
        "tokens_per_second": _number(v.tokens_per_second),
        "window_size": v.window,
        "out_hidden_size": v.out_width,
        "fullatt_block_indexes": list(v.full_attention),
        "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
    }
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": MODEL_TYPE,
        "text_config": text,
        "vision_config": vision,
        "image_token_id": config.image_token_id,
        "video_token_id": v.video_token_id,
        "vision_start_token_id": v.vision_start_token_id,
        "vision_end_token_id": v.vision_end_token_id,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
