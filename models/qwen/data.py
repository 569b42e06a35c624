"""Synthetic dynamic-resolution data for Qwen2.5-VL: images of several sizes, several per
sample, text-only samples and short videos, made on the spot.

Like :class:`models.data.SyntheticLlava`, each image (or video frame) is a coloured
square in one quadrant of a noisy canvas and the supervised answer names the colour, so
a model that uses its tower can drive the loss down; sample ``index`` comes from
``numpy.random.default_rng([seed, index])`` whatever the batch, step or process. Unlike
it, the sizes differ per sample (a multiple of 28 pixels, patches in the processor's
order: :func:`patchify`), so the tower sees rows of different patch counts, windows and
frames, padded to the row's patch budget (:func:`models.qwen.grids.pack_row`), and the
LLM sees 3D positions (:func:`models.qwen.grids.rope_positions`).

Keys of a batch ``[B, ...]``: ``tokens``, ``targets``, ``loss_mask`` and
``mrope_positions`` ``[B, L, 3]``; ``patches`` ``[B, N, C*T*P*P]``,
``vision_positions`` ``[B, N, 2]``, ``frame_ids``, ``window_ids`` ``[B, N]`` (N: the
patch budget per row).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from models import tokenizer
from models.data import COLORS, POSITIONS

from . import grids
from .config import QwenVisionConfig

# Image sizes (height, width) in pixels, multiples of 28: 2 to 8 LLM tokens each, one to
# two windows of the tiny preset along either side.
SIZES = ((28, 56), (56, 56), (56, 84), (112, 56))
VIDEO_FRAMES, VIDEO_SIZE, VIDEO_SECONDS = 4, (56, 56), 1.0  # per temporal patch
# (prompt, number of images, video); the answer names the last item's colour.
KINDS = (
    ("Say hi.", 0, False),
    ("What color?", 1, False),
    ("Second color?", 2, False),
    ("Video color?", 0, True),
)
TEXT_ANSWER = "hi"


def patchify(cfg: QwenVisionConfig, frames_TxHxWxC: np.ndarray) -> tuple[np.ndarray, tuple]:
    """Frames -> the processor's flattened patches ``[t*h*w, C*T*P*P]`` and grid
    ``(t, h, w)``, as Qwen2-VL's image processor orders them (merge units in raster order,
    each patch ``(C, T, P, P)``); the last frame repeats to fill a temporal patch (an
    image is its one frame repeated)."""
    frames = np.asarray(frames_TxHxWxC, np.float32)
    n, height, width, c = frames.shape
    tp, p, m = cfg.temporal_patch, cfg.patch, cfg.merge
    if height % (p * m) or width % (p * m):
        raise ValueError(f"a {height}x{width} frame: sides must be multiples of {p * m} pixels")
    if n % tp:
        frames = np.concatenate([frames, np.repeat(frames[-1:], tp - n % tp, axis=0)])
    t, h, w = len(frames) // tp, height // p, width // p
    x = frames.transpose(0, 3, 1, 2).reshape(t, tp, c, h // m, m, p, w // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * h * w, c * tp * p * p), (t, h, w)


@dataclasses.dataclass(frozen=True)
class QwenSyntheticConfig:
    """What the synthetic data must look like to fit a Qwen2.5-VL model."""

    vision: QwenVisionConfig
    seq_len: int  # model input length L (the stored sequence has L + 1 tokens)
    image_token_id: int  # the LLM's placeholder (images and videos alike)
    patches_per_row: int  # the tower's row length N (the patch budget per row)
    seed: int = 0

    def patches(self, size: tuple[int, int], frames: int = 1) -> int:
        """Patches of one image or video of ``size`` pixels and ``frames`` frames."""
        v = self.vision
        return -(-frames // v.temporal_patch) * (size[0] // v.patch) * (size[1] // v.patch)

    def max_sample_patches(self) -> int:
        """The most patches one sample has (an exact bound: the budget's default)."""
        image = max(self.patches(s) for s in SIZES)
        video = self.patches(VIDEO_SIZE, VIDEO_FRAMES)
        return max(max(k for _, k, _ in KINDS) * image, video)

    def max_supervised_tokens(self) -> int:
        """The most loss-mask positions a sample has: the longest answer and the EOS."""
        return max(len(max(COLORS, key=len)), len(TEXT_ANSWER)) + 1

    def max_sample_tokens(self) -> int:
        """Longest BOS + vision runs + prompt + answer + EOS."""
        units = self.vision.merge_unit
        image = max(self.patches(s) for s in SIZES) // units + 2  # with start and end
        video = self.patches(VIDEO_SIZE, VIDEO_FRAMES) // units + 2
        prompts = max(len(q) + 1 + n * image + video * v for q, n, v in KINDS)  # "question\n"
        return 2 + prompts + self.max_supervised_tokens() - 1

    def validate(self) -> None:
        need = self.max_sample_tokens()
        if self.seq_len + 1 < need:
            raise ValueError(
                f"seq_len={self.seq_len} is too short: synthetic Qwen samples need up to "
                f"{need} tokens; use seq_len={need - 1} or more"
            )
        if self.seed < 0:
            raise ValueError(f"seed={self.seed}: the data seed must be a non-negative integer")


class SyntheticQwen:
    """Deterministic batches: ``dataset.batch(step, global_batch)`` -> numpy arrays."""

    def __init__(self, config: QwenSyntheticConfig):
        config.validate()
        self.config = config

    def _frames(self, rng: np.random.Generator, size, frames: int) -> tuple[np.ndarray, str]:
        color = list(COLORS)[rng.integers(len(COLORS))]
        quadrant = int(rng.integers(len(POSITIONS)))
        h, w = size
        x = rng.normal(0.0, 0.1, (frames, h, w, self.config.vision.channels)).astype(np.float32)
        top, left = (quadrant // 2) * h // 2, (quadrant % 2) * w // 2
        rgb = np.resize(np.asarray(COLORS[color], np.float32), x.shape[-1])
        x[:, top : top + h // 2, left : left + w // 2] += rgb
        return x, color

    def sample(self, index: int) -> dict[str, np.ndarray]:
        c, v = self.config, self.config.vision
        rng = np.random.default_rng([c.seed, index])
        question, images, video = KINDS[int(rng.integers(len(KINDS)))]
        items, ids, seconds, answer = [], [tokenizer.BOS], [], TEXT_ANSWER
        media = [(SIZES[int(rng.integers(len(SIZES)))], 1) for _ in range(images)]
        media += [(VIDEO_SIZE, VIDEO_FRAMES)] if video else []
        for size, frames in media:
            pixels, answer = self._frames(rng, size, frames)
            patches, grid = patchify(v, pixels)
            items.append((patches, grid))
            pid = v.video_token_id if frames > 1 else c.image_token_id
            ids += [v.vision_start_token_id, *[pid] * (len(patches) // v.merge_unit)]
            ids += [v.vision_end_token_id]
            seconds.append(VIDEO_SECONDS if frames > 1 else None)
        ids += tokenizer.encode(question + "\n")
        prompt = len(ids)
        ids += [*tokenizer.encode(answer), tokenizer.EOS]
        supervised = np.zeros(c.seq_len + 1, np.float32)
        supervised[prompt : len(ids)] = 1.0
        ids = np.asarray(ids + [tokenizer.PAD] * (c.seq_len + 1 - len(ids)), np.int64)
        types = grids.token_types(ids[:-1], c.image_token_id, v.video_token_id)
        positions = grids.rope_positions(v, types, [g for _, g in items], seconds)
        if sum(len(p) for p, _ in items) > c.patches_per_row:
            raise ValueError(
                f"sample {index} has {sum(len(p) for p, _ in items)} patches, over the "
                f"{c.patches_per_row} per row; raise data.max_patches_per_microbatch"
            )
        row = grids.pack_row(v, items, c.patches_per_row)
        ids = np.where(ids == v.video_token_id, c.image_token_id, ids).astype(np.int32)
        return {
            "tokens": ids[:-1],
            "targets": ids[1:],
            "loss_mask": supervised[1:],
            "mrope_positions": positions.T.astype(np.int32),
            **row,
        }

    def batch(self, step: int, global_batch: int) -> dict[str, np.ndarray]:
        """The global batch of ``step``: samples ``[step * B, (step + 1) * B)``."""
        samples = [self.sample(step * global_batch + i) for i in range(global_batch)]
        return {k: np.stack([s[k] for s in samples]) for k in samples[0]}
