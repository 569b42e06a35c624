"""Hugging Face processor outputs -> a :class:`~models.qwen.model.QwenVL` batch (host).

The Qwen2.5-VL processor gives the batch's images as one list of flattened patches
(``pixel_values`` ``[sum(t*h*w), C*T*P*P]``, image after image, sample after sample) with
their grids, and the videos likewise. hetjax's tower takes one row of patches per
sample instead (static shapes, the data-parallel split keeps a sample's patches with its
text), so each sample's images and videos are gathered into its row in the order its
placeholder runs appear, which is the order transformers fills them in.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from models.config import MLLMConfig

from . import grids


def _items(pixels: Any, grid_thw: Any, what: str) -> list[tuple[np.ndarray, tuple[int, ...]]]:
    """Split ``pixels`` into one ``(patches, grid)`` per row of ``grid_thw``."""
    if grid_thw is None:
        if pixels is not None:
            raise ValueError(f"{what} pixel values without their grid_thw")
        return []
    grid_thw = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    pixels = np.asarray(pixels, np.float32)
    counts = np.prod(grid_thw, axis=1)
    if pixels.ndim != 2 or pixels.shape[0] != counts.sum():
        raise ValueError(
            f"{what}: grid_thw gives {int(counts.sum())} patches, pixel values have shape "
            f"{pixels.shape}"
        )
    starts = np.concatenate([[0], np.cumsum(counts)])
    return [
        (pixels[a:b], tuple(g))
        for a, b, g in zip(starts[:-1], starts[1:], grid_thw.tolist(), strict=True)
    ]


def hf_batch(
    config: MLLMConfig,
    input_ids: Any,
    pixel_values: Any = None,
    *,
    image_grid_thw: Any = None,
    attention_mask: Any = None,
    pixel_values_videos: Any = None,
    video_grid_thw: Any = None,
    second_per_grid_ts: Any = None,
    patches_per_row: int | None = None,
) -> dict[str, np.ndarray]:
    """The model's inputs for transformers' ``Qwen2_5_VLForConditionalGeneration`` ones.

    Args:
        config: the model's config (its vision token ids, merge size, mRoPE step).
        input_ids: ``[B, L]`` with expanded image/video placeholder runs.
        pixel_values, image_grid_thw: the images' patches and ``[n, 3]`` grids.
        attention_mask: ``[B, L]``, 0 at padding (positions skip it; padding gets 0).
        pixel_values_videos, video_grid_thw, second_per_grid_ts: the videos', and the
            seconds per temporal patch of each.
        patches_per_row: the vision rows' length; default the largest sample's.

    Returns:
        ``tokens``, ``mrope_positions`` ``[B, L, 3]``, ``patches``, ``vision_positions``,
        ``frame_ids``, ``window_ids`` (see :mod:`models.qwen.model`).
    """
    v = config.vision
    ids = np.asarray(input_ids, np.int64)
    valid = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask) != 0
    images = iter(_items(pixel_values, image_grid_thw, "images"))
    videos = iter(_items(pixel_values_videos, video_grid_thw, "videos"))
    seconds = iter([] if second_per_grid_ts is None else np.asarray(second_per_grid_ts).tolist())
    positions = np.zeros((*ids.shape, 3), np.int32)
    rows = []
    for b in range(ids.shape[0]):
        types = grids.token_types(ids[b][valid[b]], config.image_token_id, v.video_token_id)
        items, per_run = [], []
        for kind, _, _ in grids.runs(types):
            if kind == grids.TEXT:
                continue
            source = images if kind == grids.IMAGE else videos
            item = next(source, None)
            if item is None:
                name = "image" if kind == grids.IMAGE else "video"
                raise ValueError(f"row {b} has more {name} runs than the {name} grids given")
            items.append(item)
            per_run.append(
                next(seconds, 1.0)
                if kind == grids.VIDEO and second_per_grid_ts is not None
                else None
            )
        pos = grids.rope_positions(v, types, [g for _, g in items], per_run)
        positions[b][valid[b]] = pos.T
        rows.append(items)
    for rest, name in ((images, "image"), (videos, "video")):
        if next(rest, None) is not None:
            raise ValueError(f"more {name} grids than {name} runs in input_ids")
    longest = max((sum(len(p) for p, _ in items) for items in rows), default=0)
    length = patches_per_row or max(longest, v.merge_unit)
    packed = [grids.pack_row(v, items, length) for items in rows]
    tokens = np.where(ids == v.video_token_id, config.image_token_id, ids).astype(np.int32)
    return {
        "tokens": tokens,
        "mrope_positions": positions,
        **{k: np.stack([row[k] for row in packed]) for k in packed[0]},
    }
