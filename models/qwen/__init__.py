"""Qwen2.5-VL: dynamic-resolution images and video into a Qwen2 LLM with 3D rotary positions.

    >>> model = QwenVL(get_preset("qwen2.5-vl-tiny"))
    >>> params = model.init(jax.random.key(0))
    >>> batch = hf_batch(model.config, input_ids, pixel_values, image_grid_thw=grids)
    >>> logits = model.logits(params, batch)

By concern:

- :mod:`~models.qwen.config` - :class:`QwenVisionConfig` (the presets are in
  :mod:`models.config`);
- :mod:`~models.qwen.vision` - the tower and the patch merger as ``StagedModule``\\ s;
- :mod:`~models.qwen.llm` - the Qwen2 decoder with mRoPE;
- :mod:`~models.qwen.model` - :class:`QwenVL`, the three composed;
- :mod:`~models.qwen.grids`, :mod:`~models.qwen.inputs` - host-side patch layout, windows,
  3D positions, and transformers' processor outputs as a batch;
- :mod:`~models.qwen.data`, :mod:`~models.qwen.task`, :mod:`~models.qwen.flops` - training:
  synthetic dynamic-resolution data, the trainer's model and batch source, FLOPs per
  patch;
- :mod:`~models.qwen.loader`, :mod:`~models.qwen.records`, :mod:`~models.qwen.processor`,
  :mod:`~models.qwen.video`, :mod:`~models.qwen.template`, :mod:`~models.qwen.packing` -
  LLaVA-format record files: images at native resolution, videos from files or frame
  folders, the ``qwen2_vl`` template, rows one sample each or packed.
"""

from typing import Any

from .config import QwenVisionConfig as QwenVisionConfig

__all__ = ["QwenVL", "QwenVisionConfig", "hf_batch"]


def __getattr__(name: str) -> Any:
    """The model and its inputs import JAX: loaded on first use, so that
    ``models.config`` (which imports :class:`QwenVisionConfig` for its presets) stays
    plain dataclasses."""
    if name == "QwenVL":
        from .model import QwenVL

        return QwenVL
    if name == "hf_batch":
        from .inputs import hf_batch

        return hf_batch
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
