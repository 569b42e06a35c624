"""Qwen2.5-VL's forward FLOPs per part, at a step's real patch counts.

:meth:`models.config.MLLMConfig.forward_flops` counts LLaVA's encoders per image (a fixed
token count). Qwen2.5-VL's tower sees a different number of patches every step, and its
attention runs within windows (most layers) or frames (the full-attention ones), so its
FLOPs are counted per patch and per attended pair from the batch itself
(:func:`vision_counts`). The anchors' convention (MaxText/PaLM) counts the work the step
needs: real patches and the pairs inside each window and frame. ``executed`` counts what
the kernels compute instead: every patch of the budget, and each row's whole square (the
masked attention computes every tile).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from models.config import MLLMConfig


class VisionCounts(NamedTuple):
    """One step's tower sizes (over the global batch)."""

    patches: int  # real patches
    window_pairs: int  # (query, key) pairs within a window, summed over windows
    frame_pairs: int  # (query, key) pairs within a frame
    budget: int  # patch slots: rows x the row length
    square: int  # rows x the row length squared (what masked attention computes)


def _pairs(ids_BxN: np.ndarray) -> int:
    """Sum over rows and segments (ids >= 0) of the segment's size squared."""
    total = 0
    for row in ids_BxN:
        sizes = np.bincount(row[row >= 0])
        total += int(np.sum(sizes.astype(np.int64) ** 2))
    return total


def row_patches(batch: Mapping[str, Any]) -> np.ndarray:
    """``[B]`` real patches of each vision row (its samples' images and videos; padding
    ``frame_ids`` are ``-1``): the tower's work per row, what balancing its rows over
    data-parallel ranks weighs (the loader's ``balance`` orders rows by it)."""
    return np.count_nonzero(np.asarray(batch["frame_ids"]) >= 0, axis=1)


def vision_counts(batch: Mapping[str, Any]) -> VisionCounts:
    """The tower's sizes of ``batch`` (host arrays ``frame_ids``/``window_ids`` ``[B, N]``,
    padding ``-1``)."""
    frames, windows = np.asarray(batch["frame_ids"]), np.asarray(batch["window_ids"])
    rows, n = frames.shape
    patches = int(row_patches(batch).sum())
    return VisionCounts(patches, _pairs(windows), _pairs(frames), rows * n, rows * n * n)


def forward_flops(
    cfg: MLLMConfig,
    counts: VisionCounts,
    batch: int,
    seq_len: int,
    supervised: int,
    *,
    executed: bool = False,
    head_tokens: int | None = None,
) -> dict[str, int]:
    """Forward FLOPs per part (``vision``, ``projector``, ``llm``) of a step: the tower 2 x
    its matmul weights per patch (the patch embedding, q/k/v, out, the SwiGLU) plus QK^T
    and PV over its attended pairs (:func:`attention_flops`), the merger per merged token,
    the LLM as :meth:`models.config.LLMConfig.forward_flops` over ``batch`` rows of
    ``seq_len``."""
    v = cfg.vision
    d, f = v.width, v.mlp
    patches = counts.budget if executed else counts.patches
    per_patch = 2 * v.patch_dim * d + v.depth * 2 * (4 * d * d + 3 * d * f)
    attention = attention_flops(cfg, counts, batch, seq_len, supervised, executed=executed)
    wide = d * v.merge_unit
    merger = patches // v.merge_unit * 2 * (wide * wide + wide * v.out_width)
    llm = cfg.llm.forward_flops(
        batch * seq_len, seq_len, supervised, executed=executed, head_tokens=head_tokens
    )
    return {"vision": patches * per_patch + attention["vision"], "projector": merger, "llm": llm}


def attention_flops(
    cfg: MLLMConfig,
    counts: VisionCounts,
    batch: int,
    seq_len: int,
    supervised: int = 0,
    *,
    executed: bool = False,
) -> dict[str, int]:
    """The parts' FLOPs in QK^T and PV (weightless): the tower's window layers over the
    window pairs, its full layers over the frame pairs (``executed``: every layer over the
    rows' squares); the LLM's causal square at half (``executed``: whole)."""
    v, c = cfg.vision, cfg.llm
    full = len(v.full_attention)
    if executed:
        pairs = v.depth * counts.square
    else:
        pairs = (v.depth - full) * counts.window_pairs + full * counts.frame_pairs
    share = 1.0 if executed else 0.5
    llm = int(batch * seq_len * c.depth * 4 * c.heads * c.head_dim * seq_len * share)
    return {"vision": 4 * v.width * pairs, "llm": llm}
