"""Videos as folders of frames: which frames a sample takes, and their timing.

A record's ``video`` is a directory of frame images (``.jpg``, ``.jpeg``, ``.png``,
``.webp``, ``.bmp``), in file-name order. Its frame rate is the record's ``fps`` when it
gives one (the rate the frames were extracted at); otherwise the folder counts as
already sampled at the run's ``video_fps``, as qwen-vl-utils treats a list of frames.

Frames are sampled as transformers' ``Qwen2VLVideoProcessor.sample_frames`` with
``fps``: ``total / fps_source x video_fps`` frames, at least one temporal patch, at most
``max_frames`` and the folder's frames, rounded down to whole temporal patches, spread
evenly from the first frame. ``second_per_grid_ts`` (seconds per temporal patch, which
the temporal mRoPE positions step by) is ``temporal_patch / sampled fps`` as the
Qwen2.5-VL processor computes it.

Video files are not decoded here: no video decoder is a dependency of hetjax. Extract
frames first (``ffmpeg -i clip.mp4 -vf fps=2 clip/%05d.jpg``) and give the folder.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

FRAME_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")


def frame_files(folder: str) -> list[str]:
    """The folder's frame images in name order.

    Raises:
        OSError: the folder does not exist or holds no frame image.
    """
    names = sorted(n for n in os.listdir(folder) if n.lower().endswith(FRAME_EXTENSIONS))
    if not names:
        raise OSError(f"no frame images ({', '.join(FRAME_EXTENSIONS)}) in {folder}")
    return [os.path.join(folder, n) for n in names]


@dataclasses.dataclass(frozen=True)
class Sampled:
    """The frames a video sample takes: indices into the folder's frames, and the
    seconds each temporal patch spans."""

    indices: np.ndarray  # [n] int, n a multiple of the temporal patch
    second_per_grid: float


def sample_frames(
    total: int, source_fps: float, fps: float, max_frames: int, temporal_patch: int = 2
) -> Sampled:
    """Which of ``total`` frames recorded at ``source_fps`` a sample at ``fps`` takes.

    Raises:
        ValueError: the video has fewer frames than one temporal patch.
    """
    if total < temporal_patch:
        raise ValueError(
            f"{total} frame(s): a video needs at least {temporal_patch} (one temporal patch)"
        )
    most = math.floor(min(max_frames, total) / temporal_patch) * temporal_patch
    n = min(max(total / source_fps * fps, temporal_patch), most, total)
    n = math.floor(n / temporal_patch) * temporal_patch
    # transformers: torch.arange(0, total, total / n).int() (float32 steps, truncated)
    indices = (np.arange(n, dtype=np.float32) * np.float32(total / n)).astype(np.int64)
    sampled_fps = n / total * source_fps
    return Sampled(indices, temporal_patch / sampled_fps)
