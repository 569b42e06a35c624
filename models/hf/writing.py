"""Writing hetjax params as a Hugging Face ``LlavaForConditionalGeneration`` directory.

Saving writes the LLaVA-1.5 key names, which every ``transformers`` version loads, and
``post_layernorm`` as the identity (LLaVA never applies it) and no pooling head.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from models.mllm import MLLM
from models.qwen.config import QwenVisionConfig

from .configs import hf_config
from .qwen import save_qwen
from .rules import rules_for, to_hf

_SAVE_PREFIX = {
    "vision": "vision_tower.vision_model.",
    "projector": "multi_modal_projector.",
    "llm": "language_model.",
}


def save(model: MLLM, params: Mapping[str, Any], path: str | os.PathLike) -> pathlib.Path:
    """Writes ``params`` (single-device layout, host or device arrays) as a Hugging Face
    ``LlavaForConditionalGeneration`` directory: ``config.json`` + ``model.safetensors``
    (a :class:`models.qwen.QwenVL`: ``Qwen2_5_VLForConditionalGeneration``)."""
    from safetensors.numpy import save_file

    path = pathlib.Path(path)
    if isinstance(model.config.vision, QwenVisionConfig):
        return save_qwen(model, params, path)
    config = hf_config(model.config)
    channels = model.config.vision.channels
    tensors: dict[str, np.ndarray] = {}
    for module, prefix in _SAVE_PREFIX.items():
        tree = params[module]
        for rule_path, rule in rules_for(model, module).items():
            node = tree
            for k in rule_path.split("."):
                node = node[k]
            leaf = np.asarray(node, np.float32)
            layers = range(leaf.shape[0]) if rule_path.startswith("blocks.") else [None]
            for i in layers:
                value = leaf if i is None else leaf[i]
                for name, t in zip(rule.names, to_hf(rule, value, channels), strict=True):
                    tensors[prefix + name.format(i=i)] = np.ascontiguousarray(t)
    width = model.config.vision.width  # LLaVA never applies it: write the identity
    tensors[_SAVE_PREFIX["vision"] + "post_layernorm.weight"] = np.ones(width, np.float32)
    tensors[_SAVE_PREFIX["vision"] + "post_layernorm.bias"] = np.zeros(width, np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
