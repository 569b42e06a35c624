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

In a multi-process run each process decodes only the images of the rows its devices hold
(``Loader(image_rows=...)``, from :func:`hetjax.runtime.feed.local_rows`); the other
rows' images stay zeros, which the executor never reads (it builds only local shards).
Every process still reads every record and tokenizes it (cheap), and opens each image's
header, so all of them skip the same bad records and build the same rows; the pixels are
decoded after the step's rows are fixed, by the processes that feed them.

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
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from models.llava import rows as rows_lib
from models.llava.images import ImageProcessor
from models.llava.records import REASONS, BadSample, RecordFile
from models.llava.text import HFTokenizer, Template, render

# Reasons that are a consequence of the settings, not of a broken record: always skipped.
SETTING_REASONS = ("image_truncated", "too_many_images", "too_many_loss_tokens")


@dataclasses.dataclass(frozen=True)
class LoaderConfig:
    """How records become rows."""

    seq_len: int  # model input length L (rows store L + 1 tokens)
    global_batch: int  # rows per step
    image_tokens: int  # placeholder positions per image (the encoder's token count)
    placeholder: int  # the model's image placeholder id
    images_per_row: int  # static image slots per row; unused slots are zero images
    loss_tokens_per_row: int | None = None  # the loss head's supervised targets per row
    samples_per_row: int | None = None  # packed: the most samples a row holds
    template: Template = "vicuna_v1"
    pack: bool = False  # several samples per row
    balance: bool = False  # rows to microbatch x dp bins by load
    bins: tuple[int, int, int] = (1, 1, 1)  # (microbatches, encoder dp, llm dp)
    skip_bad: bool = False  # skip (and count) bad records instead of stopping
    seed: int = 0
    shuffle: bool = True
    workers: int = 4  # sample-loading threads
    prefetch: int = 2  # batches built ahead


@dataclasses.dataclass(frozen=True)
class Pending:
    """An image whose header was read but whose pixels are decoded only if a local device
    holds its row."""

    path: str
    where: str  # the record, for the error message


@dataclasses.dataclass
class Sample:
    ids: np.ndarray  # [n] int32, at most L + 1
    supervised: np.ndarray  # [n] float32
    images: list[np.ndarray | Pending]  # each [H, W, C] float32, or not decoded yet
    truncated: bool


@dataclasses.dataclass
class Batch:
    arrays: dict[str, np.ndarray]  # tokens, targets, loss_mask [B, L]; images
    metrics: dict[str, float]  # padding_fraction, image/token imbalance, tokens_per_step,
    # images_decoded (by this process, for this batch's rows)
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

    image_budget = ""  # where config.images_per_row came from (models.llava.run.build)
    loss_budget = ""  # where config.loss_tokens_per_row came from
    samples_budget = ""  # where config.samples_per_row came from
    record_file: type = RecordFile  # what reads and indexes one file of records

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
        self._open(sources, tokenizer, processor, config, image_folder)

    def _open(self, sources, tokenizer, processor, config, image_folder) -> None:
        """Indexes every source with :attr:`record_file` (bad records counted); the
        attributes :meth:`draw` and :meth:`load` read. Raises ValueError: a file with no
        usable record."""
        self.files = [
            self.record_file(p, image_folder=image_folder, skip_bad=config.skip_bad)
            for p, _ in sources
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

    @property
    def images_shape(self) -> tuple[int, ...] | None:
        """The shape of a batch's ``images`` (``[B, H, W, C]``, or ``[B, K, H, W, C]`` with
        ``K > 1`` slots per row); ``None`` for a text-only model."""
        p, c = self.processor, self.config
        if p is None:
            return None
        slots = () if c.images_per_row == 1 else (c.images_per_row,)
        return (c.global_batch, *slots, p.crop, p.crop, 3)

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

    def load(self, s: int, j: int, *, decode: bool = True, slots: int | None = None) -> Sample:
        """Record ``j`` of file ``s`` as ids, supervision and images; raises BadSample.

        ``decode=False``: the images' headers are read (a file that is no image is a bad
        record either way) and their pixels left :class:`Pending`. ``slots``: the image
        slots a row has (the config's ``images_per_row`` unless given): a record with
        more images is refused."""
        c = self.config
        slots = c.images_per_row if slots is None else slots
        record, paths, where = self.files[s].read(j)
        if len(paths) > slots:
            raise BadSample("too_many_images", where, f"{len(paths)} images, rows hold {slots}")
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
                    f"longer than seq_len={c.seq_len} and the cut falls in an image's tokens",
                )
        check_loss_tokens(sup, c.loss_tokens_per_row, where)
        images: list[np.ndarray | Pending] = []
        for p in paths:
            try:
                if decode:
                    images.append(self.processor(p))
                else:
                    self.processor.check(p)
                    images.append(Pending(p, where))
            except OSError as e:
                raise BadSample(
                    "undecodable_image", where, f"image {p} does not decode: {e}"
                ) from None
        return Sample(ids, sup, images, truncated)

    def decode(self, image: Pending) -> np.ndarray:
        """The pixels of a pending image; raises BadSample when they do not decode."""
        try:
            return self.processor(image.path)
        except OSError as e:
            # Its header read, so every process took the record into this step's rows:
            # skipping it now would give the processes different batches.
            raise BadSample(
                "undecodable_image",
                image.where,
                f"image {image.path} does not decode: {e}; found only when decoding this "
                "process's rows, after every process placed the record, so it cannot be "
                "skipped: fix or remove the file",
            ) from None

    def start_state(self) -> dict[str, Any]:
        return {"counts": [0] * len(self.files), "bad": dict(self.index_bad), "truncated": 0}


class _Lookahead:
    """The record stream from a position, loaded ``window`` records ahead by a pool."""

    def __init__(self, data: LlavaData, counts: list[int], pool, window: int, *, decode: bool):
        self.data, self.counts, self.pool, self.window = data, list(counts), pool, window
        self.decode = decode
        self.pending: collections.deque = collections.deque()

    def _fill(self) -> None:
        while len(self.pending) < self.window:
            pos = list(self.counts)
            s, j = self.data.draw(self.counts)
            future = self.pool.submit(_attempt, self.data, s, j, self.decode)
            self.pending.append((pos, future))

    def peek(self) -> tuple[list[int], Sample | BadSample]:
        self._fill()
        pos, future = self.pending[0]
        return pos, future.result()

    def pop(self) -> None:
        self.pending.popleft()


def _attempt(data: LlavaData, s: int, j: int, decode: bool) -> Sample | BadSample:
    try:
        return data.load(s, j, decode=decode)
    except BadSample as e:
        return e


def check_loss_tokens(sup: np.ndarray, budget: int | None, where: str) -> None:
    """Raises :class:`BadSample` (``too_many_loss_tokens``) when a record supervises more
    tokens than a row's loss budget holds (``None``: no budget)."""
    if budget is None:
        return
    n = rows_lib.supervised_targets(sup)
    if n > budget:
        raise BadSample("too_many_loss_tokens", where, f"{n} supervised tokens, rows hold {budget}")


class Loader:
    """Batches in order from ``state`` (``None``: the start); iterate or call :meth:`next`.

    Args:
        data: the checked data.
        state: a position (:attr:`Batch.state`); ``None``: the start.
        image_rows: the global rows whose images this process decodes (the others'
            stay zeros); ``None``: every image, decoded as its record loads. A
            multi-process run gives every process its rows (an empty set too), so all
            of them check images alike (header only) and build the same rows.

    Raises (from :meth:`next`): BadSample for a bad record without ``skip_bad``, and
    for an image of a local row that does not decode after its header read.
    """

    setting_reasons = SETTING_REASONS  # bad records skipped even without skip_bad

    def __init__(
        self,
        data: LlavaData,
        state: Mapping[str, Any] | None = None,
        *,
        image_rows: Collection[int] | None = None,
    ):
        self.data = data
        c = data.config
        self.state = dict(state or data.start_state())
        self.image_rows = None if image_rows is None else frozenset(int(r) for r in image_rows)
        # Bad records in a row after which every record has been drawn (and was bad) at
        # least once: the draws interleave the sources by weight, and two epochs of each
        # cover every record of it across an epoch boundary.
        share = data.weights / data.weights.sum()
        spans = (2 * len(f) / w for f, w in zip(data.files, share, strict=True))
        self._all_bad_after = int(max(spans)) + 1
        self._bad_in_a_row = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(c.workers, "llava-load")
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, c.prefetch))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="llava-batches", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        c = self.data.config
        window = 2 * c.workers
        decode = self.image_rows is None
        stream = _Lookahead(self.data, self.state["counts"], self._pool, window, decode=decode)
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
        packer = rows_lib.Packer(
            c.global_batch,
            c.seq_len + 1,
            c.images_per_row,
            pack=c.pack,
            loss_tokens=c.loss_tokens_per_row,
            samples=c.samples_per_row,
        )
        while not packer.full:
            pos, sample = stream.peek()
            if isinstance(sample, BadSample):
                self._skip(sample, state)
                stream.pop()
                continue
            self._bad_in_a_row = 0
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
        if self.image_rows is None:
            metrics["images_decoded"] = float(loads[:, 1].sum())
        else:
            metrics["images_decoded"] = float(self._decode_local(packer.pending, order, arrays))
        return Batch(arrays, metrics, {**state, "bad": dict(state["bad"])})

    def _skip(self, sample: BadSample, state: dict[str, Any]) -> None:
        """Counts a bad record in ``state`` (raises it unless ``skip_bad`` or a setting
        caused it); stops with one line once every record has been skipped in a row (the
        stream would draw forever)."""
        c = self.data.config
        if not (c.skip_bad or sample.reason in self.setting_reasons):
            raise sample
        state["bad"][sample.reason] = state["bad"].get(sample.reason, 0) + 1
        self._bad_in_a_row += 1
        if self._bad_in_a_row >= self._all_bad_after:
            reasons = ", ".join(f"{n} {r}" for r, n in summary_counts(state).items())
            raise ValueError(
                f"every record was skipped ({reasons}): fix the records or the settings "
                "that skip them"
            )

    def _decode_local(self, pending: list, order: np.ndarray, arrays: dict) -> int:
        """Decodes the pending images of this process's rows into ``arrays["images"]``
        (the workers in parallel); returns how many."""
        at = np.empty(len(order), np.int64)
        at[order] = np.arange(len(order))  # packer row -> batch row
        mine = [(int(at[r]), slot, im) for r, slot, im in pending if int(at[r]) in self.image_rows]
        futures = [self._pool.submit(self.data.decode, im) for _, _, im in mine]
        images = arrays.get("images")
        for (row, slot, _), future in zip(mine, futures, strict=True):
            if images.ndim == 4:  # one slot per row: stored [B, H, W, C]
                images[row] = future.result()
            else:
                images[row, slot] = future.result()
        return len(mine)

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
        out["truncated to model.seq_len"] = int(state["truncated"])
    return out
