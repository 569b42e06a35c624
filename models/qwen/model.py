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

from collections.abc import Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from hetjax import Layout, LayoutError, Link, ModuleSpec, Params, StagedModule, TrainGraph
from hetjax.meshes import validate_divisible
from models.config import MLLMConfig
from models.mllm import MLLM, PACKED_KEYS

from .config import QwenVisionConfig
from .flops import row_patches
from .llm import make_qwen_llm
from .vision import VISION_KEYS, make_merger, make_vision

# The LLM's block inputs: mRoPE positions; packed rows add Llama's two (PACKED_KEYS).
LLM_KEYS = ("mrope_positions",)
# The tower's batch input (its ``pre``'s): one row of flattened patches per LLM row.
PATCHES = "patches"


class QwenVL:
    """A Qwen2.5-VL model built from an :class:`MLLMConfig` whose ``vision`` is a
    :class:`QwenVisionConfig`.

    Args:
        config: e.g. ``get_preset("qwen2.5-vl-7b")`` or :func:`models.hf.load`'s.
        dtype: compute dtype; parameters stay float32.
        packed: LLM rows hold several samples (``segment_ids``, ``positions``).
        loss_tokens_per_row: supervised tokens the LM head computes per row
            (:class:`models.llm.LMHeadLoss`); None: every position.
        max_segments: packed: the most runs of equal segment ids a row has (the fused
            attention's packed layout on a GPU; None: its mask is a bias there).
    """

    def __init__(
        self,
        config: MLLMConfig,
        dtype: Any = jnp.float32,
        *,
        packed: bool = False,
        loss_tokens_per_row: int | None = None,
        max_segments: int | None = None,
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
        self.max_segments = max_segments if packed else None
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
                max_segments=self.max_segments,
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

    # -- training (hetjax.train's TrainableModel, as MLLM's) -----------------------------

    check_loss_budget = MLLM.check_loss_budget
    head_positions = MLLM.head_positions

    @property
    def module_names(self) -> list[str]:
        """Layout / island names: ``vision`` (the tower with its merger), then ``llm``."""
        return ["vision", "llm"]

    def module_parts(self) -> dict[str, tuple[str, ...]]:
        """Module name -> its part names."""
        return {"vision": ("vision", "projector"), "llm": ("llm",)}

    frozen_parts = MLLM.frozen_parts

    def train_graph(
        self, layouts: Mapping[str, Layout], freeze: Collection[str] = ()
    ) -> TrainGraph:
        """The tower (with the merger) and the LLM, each with its layout.

        The tower reads ``patches`` and, in every block, the patches' positions and
        frame / window segment ids (split over dp with the rows; ``rebalance`` deals the
        rows by their real patches); the LLM reads the mRoPE
        positions in every block, a sequence input like the tokens (under cp stored
        zigzag and split with them). The merged tokens fill the LLM's placeholders in
        order (under cp each rank receives those of the positions it stores); a row's
        padding patches give tokens no placeholder takes.
        """
        packed = PACKED_KEYS if self.packed else ()
        vision = ModuleSpec(
            "vision",
            parts=(self.modules["vision"], self.modules["projector"]),
            layout=layouts["vision"],
            inputs=(PATCHES,),
            block_inputs=VISION_KEYS,
            unit_cost=row_patches,  # rebalance deals rows by their real patches
        )
        link = Link("vision", "llm", "image")
        llm = ModuleSpec(
            "llm",
            parts=(self.modules["llm"],),
            layout=layouts["llm"],
            inputs=("tokens",),
            loss_inputs=("targets", "loss_mask"),
            block_inputs=(*LLM_KEYS, *packed),
            seq_inputs=("tokens", "targets", "loss_mask", *LLM_KEYS, *packed),
            token_slots=(("image", "tokens", self.placeholder("image")),),
        )
        graph = TrainGraph((vision, llm), (link,))
        return graph.freeze(freeze) if freeze else graph

    def validate_layouts(
        self, layouts: Mapping[str, Layout], *, seq_len: int | None = None
    ) -> None:
        """The LLM's as :meth:`MLLM.validate_layouts`; the tower's heads and MLP by tp,
        its scanned periods (:attr:`QwenVisionConfig.groups`) by pp, and no cp.

        Raises:
            LayoutError: one line naming the module, the sizes and the fix.
        """
        if "llm" in layouts:
            MLLM.validate_layouts(self, {"llm": layouts["llm"]}, seq_len=seq_len)
        layout = layouts.get("vision")
        if layout is None:
            return
        v = self.config.vision
        if layout.pp > 1 and v.groups % layout.pp:
            raise LayoutError(
                f"vision: pp={layout.pp} must divide the tower's {v.groups} scanned periods "
                f"of {v.period} layers (a stage holds whole periods of the window/full "
                f"attention pattern); use a pp that divides {v.groups}"
            )
        validate_divisible("vision", layout, heads=v.heads, mlp=v.mlp)
