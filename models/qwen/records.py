"""LLaVA-format records with images and videos, as Qwen2.5-VL's data.

:class:`QwenRecordFile` is :class:`models.llava.records.RecordFile` (the byte-offset
index, read on demand, bad records skipped and counted) with one more field: ``video``,
a video file or frames folder, or a list of them (:mod:`models.qwen.video`), each marked
by a ``<video>`` in a user turn as ``<image>`` marks an image. ``fps`` (optional) is the
rate a folder's frames were extracted at. Images and videos may interleave; the
markers' order is the order the tower reads them. Video files need PyAV: without it the
check of the first record with one stops the run, before training
(:class:`models.qwen.video.NoDecoder`, never skipped).
"""

from __future__ import annotations

import os
from typing import Any

from models.llava.records import IMAGE_TAG, REASONS, ROLES, BadSample, RecordFile, resolve_image

from .template import VIDEO_TAG, markers
from .video import decoder

QWEN_REASONS = {
    **REASONS,
    "image_count": "<image>/<video> tags != images/videos",
    "missing_video": "missing video file or frames folder",
    "undecodable_video": "undecodable video",
    "image_truncated": "truncation would cut an image or video",
    "too_many_patches": "more patches than data.max_patches_per_microbatch allows per row",
}


def video_paths(record: dict[str, Any]) -> list[str]:
    """The record's videos (files or frames folders) in ``<video>`` order (a path or a
    list)."""
    video = record.get("video")
    if video is None:
        return []
    return [video] if isinstance(video, str) else list(video)


class QwenRecordFile(RecordFile):
    """One LLaVA JSON / JSONL file of image and video records (see
    :class:`~models.llava.records.RecordFile`); :meth:`check` returns the record's
    media in marker order as ``(kind, resolved path)``, kind ``"image"`` or ``"video"``."""

    def check(self, record: Any, i: int) -> list[tuple[str, str]]:
        where = self.where(i, record)
        if isinstance(record, dict) and isinstance(record.get("conversations"), list):
            for t, turn in enumerate(record["conversations"]):
                value = turn.get("value") if isinstance(turn, dict) else None
                user = isinstance(turn, dict) and ROLES.get(turn.get("from")) == "user"
                tagged = isinstance(value, str) and (IMAGE_TAG in value or VIDEO_TAG in value)
                if tagged and not user:
                    problem = f"turn {t} has an {IMAGE_TAG}/{VIDEO_TAG} tag outside a user turn"
                    raise BadSample("image_count", where, problem)
        images = iter(super().check(record, i))  # the conversation's shape, the images
        videos = video_paths(record)
        order = markers(record["conversations"])
        if order.count("video") != len(videos):
            raise BadSample(
                "image_count",
                where,
                f"{order.count('video')} {VIDEO_TAG} tag(s) but {len(videos)} video(s)",
            )
        resolved = []
        for p in videos:
            try:
                full = resolve_image(p, self.image_folder)
            except ValueError as e:
                raise BadSample("image_outside_folder", where, str(e)) from None
            if not os.path.exists(full):
                problem = f"video {full} does not exist (give a video file or a frames folder)"
                raise BadSample("missing_video", where, problem)
            if not os.path.isdir(full):  # a file: the run stops here, before training
                decoder()
            resolved.append(full)
        videos_it = iter(resolved)
        return [(kind, next(images if kind == "image" else videos_it)) for kind in order]


def summary_counts(state: dict[str, Any]) -> dict[str, int]:
    """``reason text -> count`` of the records skipped so far, and the truncated ones."""
    out = {QWEN_REASONS[r]: n for r, n in sorted(state["bad"].items()) if n}
    if state.get("truncated"):
        out["truncated to model.seq_len"] = int(state["truncated"])
    return out
