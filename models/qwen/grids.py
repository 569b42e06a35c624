"""Host-side layout of Qwen2.5-VL's inputs, from the processor's grids (numpy, no JAX).

Everything that depends on an image's or video's ``(t, h, w)`` patch grid is computed
here, once per batch, so the device programs see static shapes:

- per patch, its 2D rotary position ``(row, column)``, the frame it belongs to (the
  full-attention layers attend within a frame) and its window (the other layers attend
  within a window of ``window_units x window_units`` merged units), as Hugging Face's
  ``get_vision_position_ids``, ``get_vision_attention_seqlens`` and
  ``get_vision_window_index``;
- per LLM token, its 3D (temporal, height, width) mRoPE position, as ``get_rope_index``.

Patches stay in the processor's order (merge units of ``merge x merge`` patches, raster
order, frame by frame) instead of Hugging Face's window order: attention with segment
ids does not depend on where a segment's tokens sit, and the merger then emits tokens in
the order the LLM's placeholders take them, with no permutation to undo.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .config import QwenVisionConfig

TEXT, IMAGE, VIDEO = 0, 1, 2  # HF's mm_token_type_ids


def patch_layout(cfg: QwenVisionConfig, grid: Sequence[int]) -> dict[str, np.ndarray]:
    """One image's or video's patches, in the processor's order.

    Returns:
        ``positions`` ``[N, 2]`` (row, column) in patches; ``frames`` ``[N]`` the temporal
        patch of each; ``windows`` ``[N]`` its window, numbered per frame from 0.
    """
    t, h, w = (int(x) for x in grid)
    m, u = cfg.merge, cfg.window_units
    if h % m or w % m:
        raise ValueError(f"grid {tuple(grid)}: height and width must be multiples of merge={m}")
    blocks = (h // m, m, w // m, m)
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    rows = rows.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1)
    cols = cols.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1)
    across = -(-(w // m) // u)  # windows per row of windows
    windows = (rows // m // u) * across + cols // m // u
    per_frame = windows.max() + 1
    return {
        "positions": np.tile(np.stack([rows, cols], axis=-1), (t, 1)),
        "frames": np.repeat(np.arange(t), h * w),
        "windows": np.concatenate([windows + f * per_frame for f in range(t)]),
    }


def pack_row(
    cfg: QwenVisionConfig, items: Sequence[tuple[np.ndarray, Sequence[int]]], length: int
) -> dict[str, np.ndarray]:
    """The vision row of one sample: its items' patches ``(patches [N, I], grid)`` one
    after another, padded to ``length`` patches.

    Segment ids are numbered across the row (item after item), and padding patches get
    ``-1``, a segment of their own: attention never crosses items, frames or windows.

    Returns:
        ``patches`` ``[length, I]``, ``vision_positions`` ``[length, 2]``, ``frame_ids``
        and ``window_ids`` ``[length]`` (int32).
    """
    patches = np.zeros((length, cfg.patch_dim), np.float32)
    positions = np.zeros((length, 2), np.int32)
    frames = np.full((length,), -1, np.int32)
    windows = np.full((length,), -1, np.int32)
    at = frame0 = window0 = 0
    for pixels, grid in items:
        lay = patch_layout(cfg, grid)
        n = len(lay["frames"])
        if pixels.shape != (n, cfg.patch_dim):
            raise ValueError(
                f"grid {tuple(grid)} has {n} patches of {cfg.patch_dim} values, the pixel "
                f"values give {pixels.shape}"
            )
        if at + n > length:
            raise ValueError(
                f"a row's images and videos have more than {length} patches; raise the patch "
                "budget per row"
            )
        patches[at : at + n] = pixels
        positions[at : at + n] = lay["positions"]
        frames[at : at + n] = lay["frames"] + frame0
        windows[at : at + n] = lay["windows"] + window0
        frame0, window0 = frames[at + n - 1] + 1, windows[at + n - 1] + 1
        at += n
    return {
        "patches": patches,
        "vision_positions": positions,
        "frame_ids": frames,
        "window_ids": windows,
    }


def token_types(input_ids: np.ndarray, image_token_id: int, video_token_id: int) -> np.ndarray:
    """HF's ``mm_token_type_ids``: 0 text, 1 image, 2 video placeholder."""
    return (input_ids == image_token_id) * IMAGE + (input_ids == video_token_id) * VIDEO


def runs(types: np.ndarray) -> list[tuple[int, int, int]]:
    """``(type, start, stop)`` of each run of equal token types."""
    edges = np.flatnonzero(np.diff(types)) + 1
    bounds = np.concatenate([[0], edges, [len(types)]])
    return [
        (int(types[a]), int(a), int(b))
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        if b > a
    ]


def rope_positions(
    cfg: QwenVisionConfig,
    types: np.ndarray,
    grids: Sequence[Sequence[int]],
    seconds: Sequence[float] | None,
) -> np.ndarray:
    """One sample's 3D mRoPE positions ``[3, L]`` (unpadded tokens), as transformers 5's
    ``get_rope_index``: text advances all three by one per token; an image or video
    run starts at the current position ``p`` with temporal ``p + int(k * interval)``
    (``interval``: ``tokens_per_second x seconds per temporal patch`` for a video, 1 for
    an image), height ``p + row``, width ``p + column`` over its merged grid, and the
    text after it resumes at ``p + max(h, w) / merge``.

    ``grids``: the ``(t, h, w)`` of the sample's vision runs in order; ``seconds``: per run,
    seconds per temporal patch (None for images).
    """
    out, pos, k = [], 0, 0
    for kind, start, stop in runs(types):
        if kind == TEXT:
            out.append(np.broadcast_to(np.arange(stop - start) + pos, (3, stop - start)))
            pos += stop - start
            continue
        t, h, w = (int(x) for x in grids[k])
        m = cfg.merge
        if stop - start != t * h * w // (m * m):
            raise ValueError(
                f"a run of {stop - start} {'video' if kind == VIDEO else 'image'} tokens at "
                f"{start} but its grid {(t, h, w)} makes {t * h * w // (m * m)}"
            )
        interval = 1.0
        if kind == VIDEO:
            sec = 1.0 if seconds is None or seconds[k] is None else seconds[k]
            interval = np.float32(cfg.tokens_per_second) * np.float32(sec)
        # HF multiplies in float32 and truncates: keep both
        temporal = (np.arange(t, dtype=np.float32) * np.float32(interval)).astype(np.int64)
        tt, hh, ww = np.meshgrid(temporal, np.arange(h // m), np.arange(w // m), indexing="ij")
        out.append(np.stack([tt, hh, ww]).reshape(3, -1) + pos)
        pos += max(h, w) // m
        k += 1
    if k != len(grids):
        raise ValueError(f"{len(grids)} vision grids for {k} vision runs in the sample")
    return np.concatenate(out, axis=1) if out else np.zeros((3, 0), np.int64)
