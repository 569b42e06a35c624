"""Logits of a Qwen2.5-VL model on one device, from transformers' processor outputs."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def qwen_logits(
    model: Any, params: Mapping[str, Any], input_ids: Any, pixel_values: Any = None, **hf: Any
) -> np.ndarray:
    """Float32 logits ``[B, L, vocab]`` of a :class:`~models.qwen.QwenVL`.

    Takes ``Qwen2_5_VLForConditionalGeneration``'s inputs under their names
    (:func:`models.qwen.hf_batch`: ``image_grid_thw``, ``attention_mask``,
    ``pixel_values_videos``, ``video_grid_thw``, ``second_per_grid_ts``). Positions where
    ``attention_mask`` is 0 are padding: their logits are unspecified (transformers'
    attention implementations disagree there too); the others do not depend on them.
    """
    from models.qwen import hf_batch

    batch = hf_batch(model.config, input_ids, pixel_values, **hf)
    params = jax.tree.map(jnp.asarray, params)
    return np.asarray(_logits(model, params, jax.tree.map(jnp.asarray, batch)))


@functools.partial(jax.jit, static_argnums=0)
def _logits(model, params, batch):
    return model.logits(params, batch)
