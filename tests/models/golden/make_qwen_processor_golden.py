"""Regenerates the Qwen2-VL processor golden of tests/models/test_qwen_data.py.

Needs ``transformers`` and ``torch`` (NOT project dependencies; CI never runs this). Run
once in a scratch environment, from the project root:

    /tmp/hfenv/bin/python tests/models/golden/make_qwen_processor_golden.py

It writes ``tests/models/golden/qwen_processor/``: three odd-sized PNGs (RGB, RGB and
greyscale) and ``golden.npz`` with what transformers' ``Qwen2VLImageProcessorPil``
gives for each under its own ``min_pixels``/``max_pixels`` (one rounded, one scaled up
to ``min_pixels``, one scaled down to ``max_pixels``): ``pixel_values_K`` and
``grid_K``, and the frame indices and sampled fps of ``Qwen2VLVideoProcessor
.sample_frames`` for the cases in ``FRAMES``.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import transformers
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.video_utils import VideoMetadata


def video_processor():
    """``Qwen2VLVideoProcessor``: its module imports torchvision, which ``sample_frames``
    (torch and math only) does not use; a stand-in lets it import without it."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        import sys
        import types

        names = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2")
        for n in (*names, "torchvision.transforms.v2.functional"):
            sys.modules[n] = types.ModuleType(n)
        sys.modules["torchvision.transforms.v2.functional"].InterpolationMode = None
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    return Qwen2VLVideoProcessor()


OUT = pathlib.Path(__file__).parent / "qwen_processor"
# (name, (height, width), PIL mode, min_pixels, max_pixels)
IMAGES = (
    ("a", (45, 67), "RGB", 56 * 56, 28 * 28 * 1280),  # rounded: 56 x 56
    ("b", (20, 90), "RGB", 56 * 56, 28 * 28 * 1280),  # scaled up: 28 x 140
    ("c", (150, 97), "L", 56 * 56, 28 * 28 * 8),  # scaled down: 84 x 56
)
# (total frames, source fps, fps, max_frames)
FRAMES = ((10, 2.0, 2.0, 768), (30, 30.0, 2.0, 768), (25, 24.0, 3.0, 4), (7, 1.0, 2.0, 768))


def image(size, mode, rng):
    """A smooth gradient with noise: bicubic resampling has something to do."""
    h, w = size
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (h + w)], axis=-1)
    px = np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8)
    im = Image.fromarray(px, "RGB")
    return im.convert(mode)


def main() -> None:
    OUT.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = {}
    for name, size, mode, lo, hi in IMAGES:
        path = OUT / f"{name}.png"
        image(size, mode, rng).save(path)
        proc = Qwen2VLImageProcessorPil(min_pixels=lo, max_pixels=hi)
        with Image.open(path) as im:
            out = proc(images=[im], return_tensors="np")
        arrays[f"pixel_values_{name}"] = np.asarray(out["pixel_values"], np.float32)
        arrays[f"grid_{name}"] = np.asarray(out["image_grid_thw"], np.int64)
    video = video_processor()
    frames = []
    for total, src, fps, most in FRAMES:
        meta = VideoMetadata(total_num_frames=total, fps=src)
        idx = video.sample_frames(
            meta, temporal_patch_size=2, min_frames=2, max_frames=most, fps=fps
        )
        meta.frames_indices = np.asarray(idx)
        frames.append({"indices": [int(i) for i in idx], "sampled_fps": meta.sampled_fps})
    np.savez_compressed(OUT / "golden.npz", **arrays)
    with open(OUT / "frames.json", "w") as f:
        json.dump({"transformers": transformers.__version__, "cases": frames}, f, indent=1)


if __name__ == "__main__":
    main()
