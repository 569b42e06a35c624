"""Images at native resolution as Qwen2-VL's image processor prepares them, with Pillow.

transformers' ``Qwen2VLImageProcessorPil`` (5.25; bit for bit: the golden in
``tests/models/golden/qwen_processor``): RGB, :func:`smart_resize` (both sides multiples of
``patch x merge`` = 28 pixels, the area between ``min_pixels`` and ``max_pixels``, the
aspect ratio kept as closely as that allows), a bicubic Pillow resize of the uint8
image, rescale by 1/255 (in float64, then float32), normalise with OpenAI CLIP's mean
and std, and patchify into ``[t*h*w, C*T*P*P]`` rows in the processor's order
(:func:`models.qwen.data.patchify`; an image is its one frame repeated to fill the
temporal patch). A video's frames go through the same resize, all at the size the
first frame's :func:`smart_resize` gives (transformers resizes a video as one tensor).

The torchvision ("fast") processor that ``AutoImageProcessor`` may pick resizes with
torch's antialiased bicubic instead: its pixels differ from Pillow's by a few levels,
its grids are the same.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from models.llava.images import CLIP_MEAN, CLIP_STD

from .config import QwenVisionConfig
from .data import patchify

# transformers' Qwen2VLImageProcessor defaults (size shortest_edge / longest_edge).
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 1280
MAX_ASPECT = 200  # the processor refuses a longer side over 200 x the shorter


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> tuple[int, int]:
    """The ``(height, width)`` an image is resized to, as transformers'
    ``smart_resize``: each side rounded to a multiple of ``factor``; if that area is
    over ``max_pixels`` (under ``min_pixels``), both sides scaled by one factor and
    rounded down (up) to multiples of ``factor`` instead.

    Raises:
        ValueError: the aspect ratio is over 200, as the processor says.
    """
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ValueError(
            f"absolute aspect ratio must be smaller than {MAX_ASPECT}, got "
            f"{max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclasses.dataclass(frozen=True)
class QwenImageProcessor:
    """Files -> ``(patches [t*h*w, C*T*P*P] float32, grid (t, h, w))`` for a tower.

    Raises (from every method): ``OSError`` when a file is no image Pillow decodes,
    ``ValueError`` for an aspect ratio over 200 or frames of different sizes.
    """

    vision: QwenVisionConfig
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS

    def __post_init__(self):
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(
                f"min_pixels={self.min_pixels} and max_pixels={self.max_pixels}: give "
                "0 < min_pixels <= max_pixels"
            )

    @property
    def factor(self) -> int:
        return self.vision.patch * self.vision.merge

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """:func:`smart_resize` with this processor's factor and pixel bounds."""
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def grid(self, sizes: Sequence[tuple[int, int]], frames: int = 1) -> tuple[int, int, int]:
        """The ``(t, h, w)`` patch grid of ``frames`` frames of original ``(height,
        width)`` ``sizes[0]`` (read from headers: nothing decoded)."""
        _check_sizes(sizes)
        h, w = self.resized(*sizes[0])
        v = self.vision
        return -(-frames // v.temporal_patch), h // v.patch, w // v.patch

    def size(self, path: str) -> tuple[int, int]:
        """``(height, width)`` of an image file from its header."""
        from PIL import Image

        with Image.open(path) as im:
            return im.size[1], im.size[0]

    def __call__(self, path: str) -> tuple[np.ndarray, tuple[int, int, int]]:
        """One image file's patches and grid."""
        return self.frames([path])

    def frames(self, paths: Sequence[str]) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Frame files (one image, or a video's sampled frames) -> patches and grid."""
        from PIL import Image

        pixels, sizes = [], []
        for p in paths:
            with Image.open(p) as im:
                im.load()
                sizes.append((im.size[1], im.size[0]))
                _check_sizes(sizes)
                pixels.append(self.transform(im, self.resized(*sizes[0])))
        return patchify(self.vision, np.stack(pixels))

    def images(self, frames: Sequence) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Decoded frames (``PIL.Image``s, e.g. a video file's) -> patches and grid."""
        sizes = [(im.size[1], im.size[0]) for im in frames]
        _check_sizes(sizes)
        size = self.resized(*sizes[0])
        return patchify(self.vision, np.stack([self.transform(im, size) for im in frames]))

    def transform(self, im, size: tuple[int, int]) -> np.ndarray:
        """An open ``PIL.Image`` -> ``[height, width, C]`` float32 at ``size``, normalised."""
        from PIL import Image

        im = im.convert("RGB")
        height, width = size
        if im.size != (width, height):
            im = im.resize((width, height), resample=Image.Resampling.BICUBIC)
        x = (np.asarray(im).astype(np.float64) * (1 / 255)).astype(np.float32)
        return (x - np.asarray(CLIP_MEAN, np.float32)) / np.asarray(CLIP_STD, np.float32)


def _check_sizes(sizes: Sequence[tuple[int, int]]) -> None:
    if any(s != sizes[0] for s in sizes):
        raise ValueError(
            f"frames of different sizes ({sizes[0][0]}x{sizes[0][1]} and "
            f"{sizes[-1][0]}x{sizes[-1][1]}): a video's frames must share one size"
        )
