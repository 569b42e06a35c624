"""The Qwen2.5-VL vision tower's configuration, and what couples it to the LLM.

A Qwen2.5-VL model is an :class:`~models.config.MLLMConfig` whose ``vision`` is a
:class:`QwenVisionConfig` and whose ``llm`` is a plain :class:`~models.config.LLMConfig`
(Qwen2 is Llama with biases on q, k and v, which the family's LLM always has). The
LLM's multimodal rotary positions (mRoPE) and the vision token ids live here, beside the
tower whose grids they describe, as Hugging Face keeps ``tokens_per_second`` in its
``vision_config``.

This file imports nothing from ``models`` (``models.config`` imports it for the presets).
"""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True)
class QwenVisionConfig:
    """Qwen2.5-VL's vision tower: ``[temporal, height, width]`` patches at native
    resolution, 2D rotary positions, window attention with a few full-attention layers,
    RMSNorm, a biased SwiGLU MLP, and the 2x2 patch merger into the LLM's width."""

    kind: Literal["qwen2_5_vl"] = "qwen2_5_vl"  # tells a config dict from EncoderConfig's
    width: int = 1280  # tower width D
    depth: int = 32  # vision blocks
    heads: int = 16  # attention heads (head dim = width // heads)
    mlp: int = 3420  # SwiGLU hidden width
    out_width: int = 3584  # the merger's output: the LLM's width
    patch: int = 14  # square patch side in pixels
    temporal_patch: int = 2  # frames per patch (an image is repeated to fill them)
    merge: int = 2  # merge x merge patches become one LLM token
    window: int = 112  # window side in pixels (window // merge // patch merged units)
    full_attention: tuple[int, ...] = (7, 15, 23, 31)  # blocks attending a whole frame
    channels: int = 3  # colour channels
    norm_eps: float = 1e-6  # every RMSNorm of the tower and merger (HF hard-codes 1e-6)
    rope_theta: float = 10000.0  # the tower's 2D rotary base
    # -- the LLM's side: mRoPE sections and vision token ids (HF's config.json names) --
    mrope_section: tuple[int, ...] = (16, 24, 24)  # rotary pairs per t / h / w position
    tokens_per_second: float = 2.0  # temporal position step per second of video
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653

    def __post_init__(self):
        # Tuples survive a JSON round trip (config_from_dict) as lists: keep them hashable.
        object.__setattr__(self, "full_attention", tuple(self.full_attention))
        object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        if self.width % self.heads or (self.width // self.heads) % 4:
            raise ValueError(
                f"vision width={self.width} / heads={self.heads}: the head dim must be a "
                "multiple of 4 (2D rotary over height and width halves)"
            )
        if self.window % (self.merge * self.patch):
            raise ValueError(
                f"vision window={self.window} must be a multiple of merge x patch = "
                f"{self.merge * self.patch} pixels"
            )
        bad = [i for i in self.full_attention if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"full_attention={self.full_attention}: no block {bad[0]}")

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def patch_dim(self) -> int:
        """Inputs per patch: ``channels x temporal_patch x patch x patch`` (HF's order)."""
        return self.channels * self.temporal_patch * self.patch * self.patch

    @property
    def merge_unit(self) -> int:
        """Patches per LLM token."""
        return self.merge * self.merge

    @property
    def window_units(self) -> int:
        """A window's side in merged units (HF's ``vit_merger_window_size``)."""
        return self.window // self.merge // self.patch

    @property
    def period(self) -> int:
        """Layers per scanned block: the shortest period of the full-attention pattern
        that divides the depth (8 for Qwen2.5-VL's ``(7, 15, 23, 31)`` over 32 layers)."""
        full = set(self.full_attention)
        for p in range(1, self.depth + 1):
            if self.depth % p == 0 and all(
                (i in full) == (i % p in full) for i in range(self.depth)
            ):
                return p
        raise AssertionError("unreachable: the depth itself is a period")

    @property
    def pattern(self) -> tuple[bool, ...]:
        """Which layers of a scanned block attend whole frames (the others: windows)."""
        return tuple(i in self.full_attention for i in range(self.period))

    @property
    def groups(self) -> int:
        """Scanned blocks: ``depth // period`` (what pipeline stages split)."""
        return self.depth // self.period

    def num_params(self) -> int:
        """The tower's parameters (patch embedding and blocks; the merger is the
        projector's)."""
        d, f = self.width, self.mlp
        block = (3 * d * d + 3 * d) + (d * d + d) + 3 * d * f + 2 * f + d + 2 * d
        return self.patch_dim * d + self.depth * block

    def merger_params(self) -> int:
        h = self.width * self.merge_unit
        return self.width + h * h + h + h * self.out_width + self.out_width
