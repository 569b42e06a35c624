"""LLaVA-format records on disk: a byte-offset index, checked once, read on demand.

A LLaVA data file is a JSON list (``llava_v1_5_mix665k.json``) or JSON Lines of records
``{"id", "image": PATH | [PATH, ...] (optional), "conversations": [{"from", "value"}]}``
where each ``<image>`` in a value marks one image's place. :class:`RecordFile` scans the
file ONCE (the quick validation pass before training), keeps only numpy arrays of byte
offsets and image counts, and reads a record by ``os.pread`` when a loader worker needs it:
no worker ever holds the parsed list (665K Python dicts would cost gigabytes per worker).

Every problem with a record is a :class:`BadSample` carrying a ``reason`` (the key of the
run summary's counts) and one line naming the file, the record index and its ``id``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
ROLES["system"] = "system"
IMAGE_TAG = "<image>"

# reason -> what the summary calls it
REASONS = {
    "malformed_json": "malformed JSON",
    "no_conversations": "no conversations",
    "unknown_role": "unknown role",
    "image_count": "<image> tags != images",
    "image_outside_folder": "image path outside data.image_folder",
    "missing_image": "missing image file",
    "undecodable_image": "undecodable image",
    "too_many_images": "more images than data.max_images_per_microbatch allows per row",
    "image_truncated": "truncation would cut an image",
    "too_many_loss_tokens": "more supervised tokens than data.max_loss_tokens_per_microbatch "
    "allows per row",
}


class BadSample(ValueError):
    """One bad record: ``reason`` (a key of :data:`REASONS`) and a one-line message."""

    def __init__(self, reason: str, where: str, problem: str):
        super().__init__(f"{where}: {problem}")
        self.reason = reason


def image_paths(record: dict[str, Any]) -> list[str]:
    """The record's image paths in ``<image>`` order (``image`` may be a path or a list)."""
    image = record.get("image")
    if image is None:
        return []
    return [image] if isinstance(image, str) else list(image)


def resolve_image(path: str, folder: str | None) -> str:
    """``path`` under ``folder``; raises ``ValueError`` when it escapes the folder."""
    if folder is None:
        return path
    root = os.path.realpath(folder)
    full = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, full]) != root:
        raise ValueError(f"image {path!r} resolves outside the image folder {folder}")
    return full


class RecordFile:
    """One LLaVA JSON / JSONL file as an index; :meth:`read` returns a checked record.

    Args:
        path: the ``.json`` (a list) or ``.jsonl`` file.
        image_folder: where relative image paths are resolved (``None``: as given).
        skip_bad: drop bad records from the index (counted in ``bad``) instead of raising.

    Raises:
        BadSample: the first bad record (``skip_bad=False``), or malformed JSON inside a
            JSON list (no record boundary to resume at, so it is never skipped).
    """

    def __init__(self, path: str, *, image_folder: str | None = None, skip_bad: bool = False):
        self.path, self.image_folder = path, image_folder
        self.bad: dict[str, int] = {}
        starts, ends, images, record_index = [], [], [], []
        for i, (start, end, record) in enumerate(self._scan()):
            try:
                if isinstance(record, BadSample):
                    raise record
                images.append(len(self.check(record, i)))
            except BadSample as e:
                if not skip_bad:
                    raise
                self.bad[e.reason] = self.bad.get(e.reason, 0) + 1
                continue
            starts.append(start)
            ends.append(end)
            record_index.append(i)
        self.starts = np.asarray(starts, np.int64)
        self.ends = np.asarray(ends, np.int64)
        self.num_images = np.asarray(images, np.int32)
        self.record_index = np.asarray(record_index, np.int64)  # position in the file

    def __len__(self) -> int:
        return len(self.starts)

    def where(self, i: int, record: dict[str, Any] | None = None) -> str:
        """``FILE record I (id X)`` for the message of a bad record."""
        rid = record.get("id") if isinstance(record, dict) else None
        return f"{self.path} record {i}" + (f" (id {rid})" if rid is not None else "")

    def _scan(self) -> Iterator[tuple[int, int, Any]]:
        """(byte start, byte end, record or BadSample) for every record of the file."""
        with open(self.path, "rb") as f:
            data = f.read()
        if self.path.endswith(".jsonl"):
            yield from self._scan_lines(data)
            return
        text = data.decode("utf-8")
        decoder = json.JSONDecoder()
        pos = _skip_space(text, 0)
        if not text.startswith("[", pos):
            raise BadSample("malformed_json", self.path, "not a JSON list (use .jsonl for lines)")
        pos, byte, i = pos + 1, pos + 1, 0
        while True:
            gap = _skip_space(text, pos)
            if text.startswith("]", gap):
                return
            if i and not text.startswith(",", gap):
                raise self._malformed(text, gap, i, "expected ',' or ']'")
            if i:
                gap = _skip_space(text, gap + 1)
            byte += gap - pos  # whitespace and commas are ASCII
            try:
                record, end = decoder.raw_decode(text, gap)
            except json.JSONDecodeError as e:
                raise self._malformed(text, e.pos, i, e.msg) from None
            size = len(text[gap:end].encode("utf-8"))
            yield byte, byte + size, record
            byte, pos, i = byte + size, end, i + 1

    def _scan_lines(self, data: bytes) -> Iterator[tuple[int, int, Any]]:
        start, i = 0, 0
        while start < len(data):
            end = data.find(b"\n", start)
            end = len(data) if end < 0 else end
            line = data[start:end]
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    record = BadSample(
                        "malformed_json", f"{self.path} record {i} (line {i + 1})", e.msg
                    )
                yield start, end, record
                i += 1
            start = end + 1

    def _malformed(self, text: str, pos: int, i: int, msg: str) -> BadSample:
        line = text.count("\n", 0, pos) + 1
        return BadSample("malformed_json", f"{self.path} record {i} (line {line})", msg)

    def check(self, record: Any, i: int) -> list[str]:
        """The record's resolved image paths; raises :class:`BadSample` for a bad record."""
        where = self.where(i, record)
        if not isinstance(record, dict):
            raise BadSample("malformed_json", where, f"a record must be an object, not {record!r}")
        turns = record.get("conversations")
        if not isinstance(turns, list) or not turns:
            raise BadSample("no_conversations", where, "no 'conversations' list")
        tags = 0
        for t, turn in enumerate(turns):
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                raise BadSample("no_conversations", where, f"turn {t} has no 'value' string")
            if turn.get("from") not in ROLES:
                raise BadSample(
                    "unknown_role",
                    where,
                    f"turn {t} is from {turn.get('from')!r}; known roles: {sorted(ROLES)}",
                )
            tags += turn["value"].count(IMAGE_TAG)
        paths = image_paths(record)
        if tags != len(paths):
            raise BadSample(
                "image_count", where, f"{tags} {IMAGE_TAG} tag(s) but {len(paths)} image(s)"
            )
        out = []
        for p in paths:
            try:
                full = resolve_image(p, self.image_folder)
            except ValueError as e:
                raise BadSample("image_outside_folder", where, str(e)) from None
            if not os.path.isfile(full):
                raise BadSample("missing_image", where, f"image file {full} does not exist")
            out.append(full)
        return out

    def read(self, j: int) -> tuple[dict[str, Any], list[str], str]:
        """Indexed record ``j``: (record, resolved image paths, where)."""
        start, end = int(self.starts[j]), int(self.ends[j])
        fd = os.open(self.path, os.O_RDONLY)
        try:
            record = json.loads(os.pread(fd, end - start, start))
        finally:
            os.close(fd)
        i = int(self.record_index[j])
        return record, self.check(record, i), self.where(i, record)


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos
