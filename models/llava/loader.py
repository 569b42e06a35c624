"""LLaVA batches: a weighted mixture of record files, read ahead by worker threads.

The stream is deterministic: source ``s`` of the mixture is drawn by stride scheduling
(the next record comes from the source with the smallest ``(count + 1) / weight``), and
its ``k``-th record is ``permutation(seed, s, epoch)[k % n]``, so the whole order is a
function of the seed and the per-source counts. Those counts (plus the skip counters) are
the loader's position: :attr:`Batch.state` is the position after a batch, which a
checkpoint stores, and ``Loader(data, state=...)`` continues exactly there.

Each step's rows (one sample each, or several with ``pack``) are then assigned to
microbatch x data-parallel bins (:mod:`models.llava.rows`). Worker threads read, tokenize
and decode the samples (Pillow and ``tokenizers`` release the GIL), and a producer thread
builds batches ``prefetch`` steps ahead, so a step does not wait for JPEG decoding.

Why not Grain: its index sampler gives the same determinism, but a step here consumes a
data-dependent number of records (packing; skipped bad records), so the position is a
cursor over the record stream that Grain's per-record checkpoint would not give per step,
and its multi-process workers would re-open the index per process; threads suffice
because decoding releases the GIL.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from models.llava import rows as rows_lib
from models.llava.images import ImageProcessor
from models.llava.records import REASONS, BadSample, RecordFile
from models.llava.text import HFTokenizer, Template, render

# Reasons that are a consequence of the settings, not of a broken record: always skipped.
SETTING_REASONS = ("image_truncated", "too_many_images")


@dataclasses.dataclass(frozen=True)
class LoaderConfig:
    """How records become rows."""

    seq_len: int  # model input length L (rows store L + 1 tokens)
    global_batch: int  # rows per step
    image_tokens: int  # placeholder positions per image (the encoder's token count)
    placeholder: int  # the model's image placeholder id
    images_per_row: int  # static image slots per row; unused slots are zero images
    template: Template = "vicuna_v1"
    pack: bool = False  # several samples per row
    balance: bool = False  # rows to microbatch x dp bins by load
    bins: tuple[int, int, int] = (1, 1, 1)  # (microbatches, encoder dp, llm dp)
    skip_bad: bool = False  # skip (and count) bad records instead of stopping
    seed: int = 0
    shuffle: bool = True
    workers: int = 4  # sample-loading threads
    prefetch: int = 2  # batches built ahead


@dataclasses.dataclass
class Sample:
    ids: np.ndarray  # [n] int32, at most L + 1
    supervised: np.ndarray  # [n] float32
    images: list[np.ndarray]  # each [H, W, C] float32
    truncated: bool


@dataclasses.dataclass
class Batch:
    arrays: dict[str, np.ndarray]  # tokens, targets, loss_mask [B, L]; images
    metrics: dict[str, float]  # padding_fraction, image/token imbalance, tokens_per_step
    state: dict[str, Any]  # the loader position after this batch


class LlavaData:
    """The checked record files, the tokenizer and the image processor of a run.

    Args:
        sources: ``(path, weight)`` pairs; weights need not sum to one.
        tokenizer: a loaded :class:`HFTokenizer`.
        processor: the image transform (``None``: a text-only model).
        config: the row settings.
        image_folder: where relative image paths are resolved.

    Raises:
        BadSample: the first bad record (without ``skip_bad``).
        ValueError: the placeholder id collides with a text token, or a record has more
            images than rows have slots (without ``skip_bad``).
    """

    def __init__(
        self,
        sources: Sequence[tuple[str, float]],
        tokenizer: HFTokenizer,
        processor: ImageProcessor | None,
        config: LoaderConfig,
        *,
        image_folder: str | None = None,
    ):
        if tokenizer.image_id != config.placeholder and config.placeholder < tokenizer.vocab_size:
            raise ValueError(
                f"the model's image placeholder id {config.placeholder} is a text token of "
                f"{tokenizer.path} (vocabulary {tokenizer.vocab_size}); give the tokenizer an "
                "<image> token or the model an image_token_id outside the vocabulary"
            )
        self.files = [
            RecordFile(p, image_folder=image_folder, skip_bad=config.skip_bad) for p, _ in sources
        ]
        self.weights = np.asarray([w for _, w in sources], np.float64)
        self.tokenizer, self.processor, self.config = tokenizer, processor, config
        for f in self.files:
            if len(f) == 0:
                raise ValueError(f"{f.path} has no usable record")
        self.index_bad: dict[str, int] = collections.Counter()
        for f in self.files:
            self.index_bad.update(f.bad)
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    @property
    def max_images(self) -> int:
        """The most images one record has."""
        return max(int(f.num_images.max(initial=0)) for f in self.files)

    def draw(self, counts: list[int]) -> tuple[int, int]:
        """The next (file, indexed record) after ``counts``; advances ``counts``."""
        s = int(np.argmin((np.asarray(counts) + 1) / self.weights))
        k, n = counts[s], len(self.files[s])
        counts[s] += 1
        if not self.config.shuffle:
            return s, k % n
        key = (s, k // n)
        if key not in self._perms:
            self._perms[key] = np.random.default_rng([self.config.seed, s, k // n]).permutation(n)
        return s, int(self._perms[key][k % n])

    def load(self, s: int, j: int) -> Sample:
        """Record ``j`` of file ``s`` as ids, supervision and images; raises BadSample."""
        c = self.config
        record, paths, where = self.files[s].read(j)
        if len(paths) > c.images_per_row:
            raise BadSample(
                "too_many_images", where, f"{len(paths)} images, rows hold {c.images_per_row}"
            )
        ids, sup = render(
            record["conversations"],
            self.tokenizer,
            c.template,
            image_tokens=c.image_tokens,
            placeholder=c.placeholder,
        )
        truncated = len(ids) > c.seq_len + 1
        if truncated:
            ids, sup = ids[: c.seq_len + 1], sup[: c.seq_len + 1]
            if int((ids == c.placeholder).sum()) != len(paths) * c.image_tokens:
                raise BadSample(
                    "image_truncated",
                    where,
                    f"longer than --seq-len {c.seq_len} and the cut falls in an image's tokens",
                )
        images = []
        for p in paths:
            try:
                images.append(self.processor(p))
            except OSError as e:
                raise BadSample(
                    "undecodable_image", where, f"image {p} does not decode: {e}"
                ) from None
        return Sample(ids, sup, images, truncated)

    def start_state(self) -> dict[str, Any]:
        return {"counts": [0] * len(self.files), "bad": dict(self.index_bad), "truncated": 0}


class _Lookahead:
    """The record stream from a position, loaded ``window`` records ahead by a pool."""

    def __init__(self, data: LlavaData, counts: list[int], pool, window: int):
        self.data, self.counts, self.pool, self.window = data, list(counts), pool, window
        self.pending: collections.deque = collections.deque()

    def _fill(self) -> None:
        while len(self.pending) < self.window:
            pos = list(self.counts)
            s, j = self.data.draw(self.counts)
            self.pending.append((pos, self.pool.submit(_attempt, self.data, s, j)))

    def peek(self) -> tuple[list[int], Sample | BadSample]:
        self._fill()
        pos, future = self.pending[0]
        return pos, future.result()

    def pop(self) -> None:
        self.pending.popleft()


def _attempt(data: LlavaData, s: int, j: int) -> Sample | BadSample:
    try:
        return data.load(s, j)
    except BadSample as e:
        return e


class Loader:
    """Batches in order from ``state`` (``None``: the start); iterate or call :meth:`next`.

    Raises (from :meth:`next`): BadSample for a bad record without ``skip_bad``.
    """

    def __init__(self, data: LlavaData, state: Mapping[str, Any] | None = None):
        self.data = data
        c = data.config
        self.state = dict(state or data.start_state())
        self._pool = concurrent.futures.ThreadPoolExecutor(c.workers, "llava-load")
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, c.prefetch))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="llava-batches", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        c = self.data.config
        stream = _Lookahead(self.data, self.state["counts"], self._pool, 2 * c.workers)
        state = {**self.state, "bad": dict(self.state["bad"])}
        try:
            while not self._stop.is_set():
                batch = self._build(stream, state)
                while not self._stop.is_set():
                    try:
                        self._queue.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # handed to the consumer, raised by next()
            self._queue.put(e)

    def _build(self, stream: _Lookahead, state: dict[str, Any]) -> Batch:
        c = self.data.config
        packer = rows_lib.Packer(c.global_batch, c.seq_len + 1, c.images_per_row, pack=c.pack)
        while not packer.full:
            pos, sample = stream.peek()
            if isinstance(sample, BadSample):
                if not (c.skip_bad or sample.reason in SETTING_REASONS):
                    raise sample
                state["bad"][sample.reason] = state["bad"].get(sample.reason, 0) + 1
                stream.pop()
                continue
            if not packer.add(sample):
                break  # it starts the next step
            state["truncated"] += int(sample.truncated)
            stream.pop()
        pos, _ = stream.peek()
        state["counts"] = list(pos)
        arrays, loads = packer.arrays(pad_id=self.data.tokenizer.pad_id, shape=self._image_shape())
        order = rows_lib.assign(loads, c.bins, balance=c.balance)
        arrays = {k: v[order] for k, v in arrays.items()}
        metrics = rows_lib.metrics(loads[order], c.bins, c.seq_len)
        return Batch(arrays, metrics, {**state, "bad": dict(state["bad"])})

    def _image_shape(self) -> tuple[int, ...] | None:
        p = self.data.processor
        return None if p is None else (p.crop, p.crop, 3)

    def next(self) -> Batch:
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        self.state = item.state
        return item

    def __iter__(self):
        while True:
            yield self.next()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)


def summary_counts(state: Mapping[str, Any]) -> dict[str, int]:
    """``reason text -> count`` of the records skipped so far, and the truncated ones."""
    out = {REASONS[r]: n for r, n in sorted(state["bad"].items()) if n}
    if state.get("truncated"):
        out["truncated to --seq-len"] = int(state["truncated"])
    return out
