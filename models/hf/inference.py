"""Logits of a LLaVA model on one device, to compare with ``transformers``."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.mllm import MLLM
from models.qwen.config import QwenVisionConfig

from .qwen_inference import qwen_logits


def logits(
    model: MLLM, params: Mapping[str, Any], input_ids: Any, pixel_values: Any, **qwen: Any
) -> np.ndarray:
    """Float32 logits ``[B, L, vocab]`` of a LLaVA model, on one device.

    Args:
        input_ids: int ``[B, L]``, the config's image token at each image position
            (expanded: one id per image token, as current HF processors do).
        pixel_values: float32 ``[B, C, H, W]``, as ``CLIPImageProcessor`` outputs.
        qwen: for a :class:`models.qwen.QwenVL`, the rest of its processor's outputs
            (``image_grid_thw``, ``attention_mask``, ``pixel_values_videos``,
            ``video_grid_thw``, ``second_per_grid_ts``): :func:`~.qwen_inference.qwen_logits`.
    """
    if isinstance(model.config.vision, QwenVisionConfig):
        return qwen_logits(model, params, input_ids, pixel_values, **qwen)
    if qwen:
        raise TypeError(f"LLaVA logits take no {sorted(qwen)}: those are Qwen2.5-VL inputs")
    params = jax.tree.map(jnp.asarray, params)
    return np.asarray(_logits(model, params, jnp.asarray(input_ids), jnp.asarray(pixel_values)))


@functools.partial(jax.jit, static_argnums=0)
def _logits(model: MLLM, params, input_ids, pixel_values):
    images = jnp.transpose(pixel_values, (0, 2, 3, 1))
    llm = model.modules["llm"]
    h = llm.apply_pre(params["llm"]["pre"], input_ids, **model.encode(params, {"images": images}))
    h = llm.apply_blocks(params["llm"]["blocks"], h)
    return llm.bind("post", params["llm"]["post"]).logits(h)
