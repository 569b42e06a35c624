"""Videos: which frames a sample takes, their timing, and decoding them.

A record's ``video`` is a video file (any container and codec FFmpeg reads: ``.mp4``,
``.webm``, ``.mkv``, ...), decoded with PyAV (the optional ``video`` extra: ``pip install
'hetjax[video]'``), or a directory of frame images (``.jpg``, ``.jpeg``, ``.png``,
``.webp``, ``.bmp``) in file-name order. A file's frame count and rate are its video
stream's ``frames`` and ``average_rate``, as transformers' ``read_video_pyav`` reads
them (a container that stores no frame count, as WebM, is counted by decoding it, which
transformers cannot sample). A folder's rate is the record's ``fps`` when it gives one
(the rate the frames were extracted at); otherwise the folder counts as already sampled
at the run's ``video_fps``, as qwen-vl-utils treats a list of frames.

Frames are sampled as transformers' ``Qwen2VLVideoProcessor.sample_frames`` with
``fps``: ``total / fps_source x video_fps`` frames, at least one temporal patch, at most
``max_frames`` and the video's frames, rounded down to whole temporal patches, spread
evenly from the first frame. ``second_per_grid_ts`` (seconds per temporal patch, which
the temporal mRoPE positions step by) is ``temporal_patch / sampled fps`` as the
Qwen2.5-VL processor computes it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

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
    """The frames a video sample takes: indices into the video's frames, and the
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


class NoDecoder(ValueError):
    """PyAV is not installed: a setting of the run, never a bad record to skip."""


def decoder() -> Any:
    """The ``av`` module (PyAV), which video files need.

    Raises:
        NoDecoder: PyAV is not installed (one line: how to install it).
    """
    try:
        import av
    except ImportError:
        raise NoDecoder(
            "video files are decoded with PyAV, which is not installed: pip install "
            "'hetjax[video]' (or give a folder of frames)"
        ) from None
    return av


@dataclasses.dataclass(frozen=True)
class Clip:
    """One video of a record, sampled: where its frames come from, which it takes, and
    the original frame size (what the processor's resize starts from)."""

    path: str
    files: tuple[str, ...] | None  # a folder's sampled frame files (None: a video file)
    sampled: Sampled
    size: tuple[int, int]  # (height, width) of a frame before the resize

    def frames(self) -> list[Any]:
        """The sampled frames as RGB ``PIL.Image``s.

        Raises:
            OSError: a frame does not decode.
            ValueError: the file holds fewer frames than its header says.
        """
        from PIL import Image

        if self.files is not None:
            out = []
            for f in self.files:
                with Image.open(f) as im:
                    im.load()
                    out.append(im.convert("RGB"))
            return out
        return decode(self.path, self.sampled.indices)


def _probe(path: str) -> tuple[int, float, tuple[int, int]]:
    """A video file's frame count, rate and ``(height, width)`` (from the header, or
    counted by decoding when the container stores no count)."""
    av = decoder()
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise ValueError("the file has no video stream")
            stream = container.streams.video[0]
            total, rate = stream.frames, stream.average_rate
            size = (stream.codec_context.height, stream.codec_context.width)
            if not total:
                total = sum(1 for _ in container.decode(video=0))
    except av.FFmpegError as e:
        raise OSError(str(e)) from None
    if not rate or rate <= 0:
        raise ValueError("the video stream gives no frame rate")
    return int(total), float(rate), size


def decode(path: str, indices: np.ndarray) -> list[Any]:
    """Frames ``indices`` (ascending) of a video file as RGB ``PIL.Image``s, decoded from
    the start as transformers' ``read_video_pyav`` does.

    Raises:
        OSError: the file does not decode.
        ValueError: it holds fewer frames than ``indices`` asks for.
    """
    av = decoder()
    want, out = {int(i) for i in indices}, []
    last = int(indices[-1])
    try:
        with av.open(path) as container:
            for i, frame in enumerate(container.decode(video=0)):
                if i > last:
                    break
                if i in want:
                    out.append(frame.to_image())
    except av.FFmpegError as e:
        raise OSError(str(e)) from None
    if len(out) != len(indices):
        raise ValueError(f"decoded {len(out)} of the {len(indices)} sampled frames")
    return out


def open_clip(
    path: str, fps: float | None, video_fps: float, max_frames: int, temporal_patch: int = 2
) -> Clip:
    """A record's video (file or frames folder) sampled at ``video_fps``; ``fps`` is the
    record's rate for a folder's frames (a file's own rate is its stream's).

    Raises:
        OSError: no such folder, no frames in it, or a file FFmpeg does not read.
        ValueError: too few frames, no frame rate, or :class:`NoDecoder` (PyAV missing).
    """
    if os.path.isdir(path):
        files = frame_files(path)
        s = sample_frames(len(files), fps or video_fps, video_fps, max_frames, temporal_patch)
        from PIL import Image

        with Image.open(files[0]) as im:
            size = (im.size[1], im.size[0])
        return Clip(path, tuple(files[i] for i in s.indices), s, size)
    total, rate, size = _probe(path)
    s = sample_frames(total, rate, video_fps, max_frames, temporal_patch)
    return Clip(path, None, s, size)
