"""A step's Qwen2.5-VL rows from its samples: one sample per row, or several packed.

The text side is LLaVA's packer (:class:`models.llava.rows.Packer`): first fit by
tokens, with the row's patch budget as its slots (a sample takes one per patch), the
loss budget and the samples per row; packed rows carry its ``segment_ids`` and
``positions`` (restarting per sample), which the LLM's attention mask reads, so no
sample attends to another. What Qwen adds per row:

- ``mrope_positions`` ``[L, 3]``: each sample's own, from 0, exactly those it has alone
  in a row (the last sample's continue as text over the row's padding, as a lone
  sample's do);
- one vision row holding every sample's images and videos in order
  (:func:`models.qwen.grids.pack_row`: segment ids numbered across the row, so the
  tower's attention never crosses an item either); its merged tokens fill the row's
  placeholders in that order, the order of the samples in the row.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from models.llava import rows, run
from models.llava.rows import Packer

from . import grids
from .config import QwenVisionConfig


def row_arrays(
    packer: Packer,
    vision: QwenVisionConfig,
    *,
    pad_id: int,
    image_pad: int,
    video_pad: int,
    placeholder: int,
    patches_per_row: int,
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The batch arrays of ``packer``'s rows (samples with ``ids``, ``supervised``,
    decoded ``items``, ``grids``, ``seconds`` and ``patches``), and each row's load
    ``[R, 2]`` (input tokens, real patches): what balancing and its metrics read.

    A video's pads become ``placeholder`` (one LLM placeholder for images and videos)
    after the positions are laid out (they tell the two apart)."""
    arrays, loads = packer.arrays(pad_id=pad_id, shape=None)
    r, length = packer.num_rows, packer.capacity
    mrope = np.zeros((r, length, 3), np.int32)
    rows: list[Sequence] = [*packer.rows, *[[]] * (r - len(packer.rows))]
    vision_rows = []
    for row, samples in enumerate(rows):
        at = 0
        for k, s in enumerate(samples):
            n = len(s.ids) if k + 1 < len(samples) else length - at
            ids = np.full(n, pad_id, np.int64)
            ids[: len(s.ids)] = s.ids
            types = grids.token_types(ids, image_pad, video_pad)
            mrope[row, at : at + n] = grids.rope_positions(vision, types, s.grids, s.seconds).T
            at += len(s.ids)
        if not samples:
            mrope[row] = np.arange(length)[:, None]
        items = [item for s in samples for item in s.items]
        vision_rows.append(grids.pack_row(vision, items, patches_per_row))
        loads[row, 1] = sum(s.patches for s in samples)
    for key in ("tokens", "targets"):
        arrays[key] = np.where(arrays[key] == video_pad, placeholder, arrays[key]).astype(np.int32)
    arrays["mrope_positions"] = mrope[:, :-1]
    for key in vision_rows[0]:
        arrays[key] = np.stack([v[key] for v in vision_rows])
    return arrays, loads


def packed_patches(
    measured: run.Measured, global_batch: int, capacity: int, unit: int
) -> tuple[int, str]:
    """A packed row's patch budget from the data, and a line saying how: LLaVA's packed
    image slots (:func:`models.llava.run.packed_slots`) counted in patches: the
    :data:`~models.llava.run.PACKED_QUANTILE` quantile of the patches the rows of the
    measured records hold when packed with no patch limit, at least the most one record
    has (none is skipped for its patches), rounded up to whole merge units."""
    n, samples = measured.records, measured.samples
    per_row = np.asarray(
        rows.packed_images([(t, p) for t, p, _ in samples], global_batch, capacity)
    )
    q = int(np.quantile(per_row, run.PACKED_QUANTILE, method="higher"))
    most = max(p for _, p, _ in samples)
    per = -(-max(q, most, unit) // unit) * unit
    pct = round(run.PACKED_QUANTILE * 100)
    return per, (
        f"derived from the data (--pack): {pct}% of the {len(per_row)} rows in the full steps "
        f"of the first {n} records ({n - len(samples)} skipped), packed with no patch limit, "
        f"hold at most {q} patches (mean {per_row.mean():.0f}, max {per_row.max()}); at least "
        f"a record's most ({most}); --max-patches-per-microbatch sets it"
    )
