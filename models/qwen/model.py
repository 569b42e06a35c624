"""The composed Qwen2.5-VL model: vision tower -> patch merger -> Qwen2 LLM.

Modules and parameters are keyed as :class:`models.mllm.MLLM`'s (``vision``,
``projector``, ``llm``), so per-module layouts, metrics and checkpoints address the same
names. A batch holds, per row (one sample, or one packed LLM row and its vision row):

- ``tokens`` ``[B, L]`` with the one vision placeholder id at image and video positions
  (:mod:`models.qwen.llm`), ``mrope_positions`` ``[B, L, 3]``;
- ``patches`` ``[B, N, C*T*P*P]`` and the tower's block inputs ``vision_positions``
  ``[B, N, 2]``, ``frame_ids``, ``window_ids`` ``[B, N]`` (:func:`models.qwen.grids.pack_row`);
  ``N`` is the patch budget per row, padding in segment ``-1``;
- for training, ``targets`` and ``loss_mask`` ``[B, L]``; packed rows add
  ``segment_ids`` and ``positions`` ``[B, L]`` as Llama's.

Row ``b``'s vision tokens fill row ``b``'s placeholders in order, so the data-parallel
split of the batch keeps a sample's patches with its text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from hetjax import Params, StagedModule
from models.config import MLLMConfig
from models.mllm import MLLM

from .config import QwenVisionConfig
from .llm import make_qwen_llm
from .vision import VISION_KEYS, make_merger, make_vision

# The LLM's block inputs: mRoPE positions; packed rows add Llama's two (PACKED_KEYS).
LLM_KEYS = ("mrope_positions",)


class QwenVL:
    """A Qwen2.5-VL model built from an :class:`MLLMConfig` whose ``vision`` is a
    :class:`QwenVisionConfig`.

    Args:
        config: e.g. ``get_preset("qwen2.5-vl-7b")`` or :func:`models.hf.load`'s.
        dtype: compute dtype; parameters stay float32.
        packed: LLM rows hold several samples (``segment_ids``, ``positions``).
        loss_tokens_per_row: supervised tokens the LM head computes per row
            (:class:`models.llm.LMHeadLoss`); None: every position.
    """

    def __init__(
        self,
        config: MLLMConfig,
        dtype: Any = jnp.float32,
        *,
        packed: bool = False,
        loss_tokens_per_row: int | None = None,
    ):
        vision = config.vision
        if not isinstance(vision, QwenVisionConfig):
            raise ValueError(
                f"model {config.name!r} has no Qwen2.5-VL vision tower; use a qwen2.5-vl "
                "preset or models.hf.load on a Qwen2_5_VLForConditionalGeneration directory"
            )
        if vision.out_width != config.llm.width:
            raise ValueError(
                f"the merger outputs {vision.out_width} features, the LLM's width is "
                f"{config.llm.width}: set vision out_width to the LLM's width"
            )
        self.config = config
        self.packed = packed
        self.loss_tokens_per_row = loss_tokens_per_row
        self.modules: dict[str, StagedModule] = {
            "vision": make_vision(vision, dtype),
            "projector": make_merger(vision, dtype),
            "llm": make_qwen_llm(
                config.llm,
                vision.mrope_section,
                {"image": self.placeholder("image")},
                dtype,
                loss_capacity=loss_tokens_per_row,
            ),
        }

    def placeholder(self, modality: str) -> int:
        """The LLM's vision placeholder id (images and videos alike)."""
        if modality != "image":
            raise ValueError(f"Qwen2.5-VL has no {modality!r} placeholder: only 'image'")
        return self.config.image_token_id

    @property
    def modalities(self) -> list[str]:
        return ["image"]

    def init(self, key: jax.Array) -> Params:
        """Parameters per module; module ``i`` uses ``fold_in(key, i)`` (MLLM's order)."""
        order = ["vision", "projector", "audio", "audio_projector", "llm"]
        return {n: m.init(jax.random.fold_in(key, order.index(n))) for n, m in self.modules.items()}

    def num_params(self) -> dict[str, int]:
        return {name: m.num_params() for name, m in self.modules.items()}

    def encode(self, params: Params, batch: Mapping[str, Any]) -> dict[str, jax.Array]:
        """The merged vision tokens ``{"image": [B, N / 4, D_llm]}``."""
        vision = self.modules["vision"]
        h = vision.apply_pre(params["vision"]["pre"], batch["patches"])
        h = vision.apply_blocks(params["vision"]["blocks"], h, **self.vision_inputs(batch))
        return {"image": self.modules["projector"](params["projector"], h)}

    def vision_inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The batch keys every vision block reads."""
        return {k: batch[k] for k in VISION_KEYS}

    def block_inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The batch keys every LLM block reads: ``mrope_positions``, and when packed
        ``segment_ids``/``positions`` (checked as :meth:`MLLM.block_inputs` does, which
        reads only ``packed``).

        Raises:
            ValueError: a packed model's batch lacks them, or an unpacked one's has them.
        """
        return {**{k: batch[k] for k in LLM_KEYS}, **MLLM.block_inputs(self, batch)}

    def hidden(self, params: Params, batch: Mapping[str, Any]) -> jax.Array:
        """The LLM's last hidden states ``[B, L, D]`` (before the final norm)."""
        llm = self.modules["llm"]
        h = llm.apply_pre(params["llm"]["pre"], batch["tokens"], **self.encode(params, batch))
        return llm.apply_blocks(params["llm"]["blocks"], h, **self.block_inputs(batch))

    def logits(self, params: Params, batch: Mapping[str, Any]) -> jax.Array:
        """Float32 logits ``[B, L, V]`` at every position."""
        h = self.hidden(params, batch)
        return self.modules["llm"].bind("post", params["llm"]["post"]).logits(h)

    def loss_sum(self, params: Params, batch: Mapping[str, Any]) -> jax.Array:
        """Summed cross-entropy over the supervised tokens of ``batch``."""
        h = self.hidden(params, batch)
        post = params["llm"]["post"]
        return self.modules["llm"].apply_post(post, h, batch["targets"], batch["loss_mask"])
