"""Qwen2.5-VL batches from LLaVA-format record files: images and videos at native
resolution, one sample per row or several packed (``pack``).

The machinery is LLaVA's (:mod:`models.llava.loader`: the deterministic mixture of
record files, worker threads reading ahead, a producer thread ``prefetch`` batches
ahead, the position a checkpoint stores, bad records skipped and counted with
``skip_bad``; its packer); what differs is a sample. :meth:`QwenData.load` sizes each
image and video from headers (:func:`models.qwen.processor.smart_resize`), renders the
``qwen2_vl`` template with that many pads per item, and decodes the pixels; a step's
rows (:mod:`models.qwen.packing`) hold ``seq_len + 1`` tokens with their 3D mRoPE
positions and one vision row of their patches padded to the patch budget, the same keys
as the synthetic data (:mod:`models.qwen.data`), and packed rows LLaVA's segment ids.

Budgets (per row, as a microbatch's share): patches (``data.max_patches_per_microbatch``;
default the most one of the first records has, or packed the rows' 90% quantile),
supervised tokens and packed samples (as LLaVA's). A record over a budget is skipped
and counted, never cut; a packed row closes to it. ``balance`` orders rows by tokens
for the LLM's ranks and by patches for the tower's.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from models.config import MLLMConfig
from models.llava import rows as rows_lib
from models.llava import run as llava_run
from models.llava.loader import Batch, LlavaData, Loader, check_loss_tokens
from models.llava.records import BadSample
from models.llava.rows import Packer
from models.llava.text import HFTokenizer

from . import packing, video
from .processor import QwenImageProcessor
from .records import QwenRecordFile, summary_counts
from .template import QwenTokens, render

# Reasons that are a consequence of the settings, not of a broken record: always skipped.
SETTING_REASONS = ("image_truncated", "too_many_patches", "too_many_loss_tokens")


@dataclasses.dataclass(frozen=True)
class QwenLoaderConfig:
    """How records become rows."""

    seq_len: int  # model input length L (rows store L + 1 tokens)
    global_batch: int  # rows per step
    placeholder: int  # the model's image placeholder id (videos' pads become it too)
    patches_per_row: int | None = None  # the tower's row length (None: measuring)
    loss_tokens_per_row: int | None = None  # the loss head's supervised targets per row
    video_fps: float = 2.0  # frames sampled per second of video
    max_frames: int = 768  # the most frames one video gives
    balance: bool = False
    bins: tuple[int, int, int] = (1, 1, 1)  # (microbatches, tower dp, llm dp)
    skip_bad: bool = False
    seed: int = 0
    shuffle: bool = True
    workers: int = 4
    prefetch: int = 2
    pack: bool = False  # several samples per row (models.qwen.packing)
    samples_per_row: int | None = None  # packed: the most samples a row holds

    @property
    def images_per_row(self) -> int | None:
        """A row's slots as :func:`models.llava.run.derived_loss_tokens` packs them: its
        patches (a sample's "images" are its patches)."""
        return self.patches_per_row


@dataclasses.dataclass
class QwenSample:
    ids: np.ndarray  # [n] int32, at most L + 1
    supervised: np.ndarray  # [n] float32
    images: list  # the record's media (kind, path), in marker order
    truncated: bool
    patches: int  # the tower's patches for the sample
    grids: list  # (t, h, w) per item
    seconds: list  # seconds per temporal patch per item (None: an image)
    items: list | None = None  # (patches [n, I], grid) per item (None: not decoded)


class QwenData(LlavaData):
    """The checked record files, tokenizer and processor of a run (LLaVA's mixture draw
    and start state, Qwen's samples).

    Raises:
        BadSample: the first bad record (without ``skip_bad``).
        ValueError: a file with no usable record.
    """

    patch_budget = ""  # where config.patches_per_row came from (build)
    record_file = QwenRecordFile

    def __init__(
        self,
        sources: Sequence[tuple[str, float]],
        tokenizer: HFTokenizer,
        processor: QwenImageProcessor,
        config: QwenLoaderConfig,
        *,
        image_folder: str | None = None,
    ):
        self.tokens = QwenTokens.of(tokenizer)
        self._open(sources, tokenizer, processor, config, image_folder)

    def _media(self, record: dict, kind: str, path: str) -> tuple[Any, tuple, float | None]:
        """One image (its path) or video (a :class:`~models.qwen.video.Clip`), its grid
        from headers, and a video's seconds per temporal patch."""
        p = self.processor
        if kind == "image":
            return path, p.grid([p.size(path)]), None
        c = self.config
        fps = record.get("fps")
        bad = isinstance(fps, bool) or not isinstance(fps, (int, float, type(None)))
        if bad or (fps is not None and fps <= 0):
            raise ValueError(f"'fps' must be a positive number, not {fps!r}")
        clip = video.open_clip(path, fps, c.video_fps, c.max_frames, p.vision.temporal_patch)
        grid = p.grid([clip.size], len(clip.sampled.indices))
        return clip, grid, clip.sampled.second_per_grid

    def load(self, s: int, j: int, *, decode: bool = True, slots: int | None = None) -> QwenSample:
        """Record ``j`` of file ``s`` as a sample; raises :class:`BadSample`.

        ``decode=False``: only headers are read (sizes, hence grids and token counts;
        a file that is no image is a bad record either way) and no row is built."""
        c, v = self.config, self.processor.vision
        record, media, where = self.files[s].read(j)
        items, seconds, grid_list = [], [], []
        for kind, path in media:
            try:
                item, grid, sec = self._media(record, kind, path)
            except video.NoDecoder:
                raise
            except (OSError, ValueError) as e:
                raise BadSample(
                    f"undecodable_{kind}", where, f"{kind} {path} does not decode: {e}"
                ) from None
            items.append(item)
            grid_list.append(grid)
            seconds.append(sec)
        counts = [t * h * w // v.merge_unit for t, h, w in grid_list]
        ids, sup = render(record["conversations"], self.tokenizer, self.tokens, counts)
        truncated = len(ids) > c.seq_len + 1
        if truncated:
            ids, sup = ids[: c.seq_len + 1], sup[: c.seq_len + 1]
            pads = np.isin(ids, (self.tokens.image_pad, self.tokens.video_pad)).sum()
            if pads != sum(counts):
                raise BadSample(
                    "image_truncated",
                    where,
                    f"longer than seq_len={c.seq_len} and the cut falls in an image's or "
                    "video's tokens",
                )
        check_loss_tokens(sup, c.loss_tokens_per_row, where)
        patches = sum(t * h * w for t, h, w in grid_list)
        if c.patches_per_row is not None and patches > c.patches_per_row:
            raise BadSample(
                "too_many_patches", where, f"{patches} patches, rows hold {c.patches_per_row}"
            )
        sample = QwenSample(ids, sup, list(media), truncated, patches, grid_list, seconds)
        if decode:
            sample.items = self._decode(sample, items, where)
        return sample

    def _decode(self, sample: QwenSample, media: list, where: str) -> list:
        """The sample's items' patches and grids (every image and video decoded)."""
        items = []
        for (kind, path), item in zip(sample.images, media, strict=True):
            try:
                if kind == "image":
                    items.append(self.processor(item))
                else:
                    items.append(self.processor.images(item.frames()))
            except video.NoDecoder:
                raise
            except (OSError, ValueError) as e:
                raise BadSample(
                    f"undecodable_{kind}", where, f"{kind} {path} does not decode: {e}"
                ) from None
        assert [g for _, g in items] == sample.grids, "the headers and the pixels disagree"
        return items

    def packer(self) -> Packer:
        """An empty step of rows (LLaVA's packer, a row's patches as its slots)."""
        c = self.config
        return Packer(
            c.global_batch,
            c.seq_len + 1,
            c.patches_per_row or 0,
            pack=c.pack,
            loss_tokens=c.loss_tokens_per_row,
            samples=c.samples_per_row,
        )

    def arrays(self, packer: Packer) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The batch of ``packer``'s rows and their loads (:func:`packing.row_arrays`)."""
        c, t = self.config, self.tokens
        return packing.row_arrays(
            packer,
            self.processor.vision,
            pad_id=self.tokenizer.pad_id,
            image_pad=t.image_pad,
            video_pad=t.video_pad,
            placeholder=c.placeholder,
            patches_per_row=c.patches_per_row,
        )

    def row(self, sample: QwenSample) -> dict[str, np.ndarray]:
        """``sample`` alone in a row (decoded): the row's arrays."""
        c = self.config
        one = Packer(1, c.seq_len + 1, c.patches_per_row or 0, pack=False)
        one.add(sample, sample.patches)
        return {k: v[0] for k, v in self.arrays(one)[0].items()}


class QwenLoader(Loader):
    """:class:`models.llava.loader.Loader` over :class:`QwenData`: a step's rows are its
    next ``global_batch`` good samples (every image decoded by the workers)."""

    setting_reasons = SETTING_REASONS

    def _build(self, stream, state: dict[str, Any]) -> Batch:
        c = self.data.config
        packer = self.data.packer()
        while not packer.full:
            _, sample = stream.peek()
            if isinstance(sample, BadSample):
                self._skip(sample, state)
                stream.pop()
                continue
            self._bad_in_a_row = 0
            if not packer.add(sample, sample.patches):
                break  # it starts the next step
            state["truncated"] += int(sample.truncated)
            stream.pop()
        pos, _ = stream.peek()
        state["counts"] = list(pos)
        arrays, loads = self.data.arrays(packer)
        order = rows_lib.assign(loads, c.bins, balance=c.balance)
        arrays = {k: v[order] for k, v in arrays.items()}
        metrics = rows_lib.metrics(loads[order], c.bins, c.seq_len)
        metrics["patches_per_step"] = metrics.pop("images_per_step")
        if "image_imbalance" in metrics:
            metrics["patch_imbalance"] = metrics.pop("image_imbalance")
        return Batch(arrays, metrics, {**state, "bad": dict(state["bad"])})


class QwenStream(llava_run.DataStream):
    """:class:`models.llava.run.DataStream` over a :class:`QwenLoader`."""

    def __init__(self, data: QwenData, bins: tuple[int, int, int], state: Any = None):
        data.config = dataclasses.replace(data.config, bins=bins)
        self.data = data
        self.loader = QwenLoader(data, state)
        self.metrics: dict[int, dict[str, float]] = {}

    def checkpoint(self) -> dict[str, Any]:
        return {"kind": "qwen", "state": self.loader.state}

    def summary(self) -> str:
        counts = summary_counts(self.loader.state)
        return ", ".join(f"{k} {v}" for k, v in counts.items()) or "no record skipped or truncated"


def build(
    data: Any, model: MLLMConfig, *, seq_len: int, seed: int, microbatches: int, grow_vocab: bool
) -> tuple[QwenData, MLLMConfig]:
    """The checked data and the model config with the tokenizer's vision token ids.

    Args:
        data: a :class:`hetjax.config.DataConfig` with ``sources`` and ``tokenizer``.
        model: a Qwen2.5-VL preset.
        grow_vocab: the LLM starts fresh: a larger tokenizer grows its vocabulary.

    Raises:
        ValueError: one line: a tokenizer that does not load, lacks Qwen's special tokens
            or does not fit the vocabulary; a bad record (without ``skip_bad_samples``);
            budgets that do not split over a microbatch's rows.
    """
    if data.template != "qwen2_vl":
        raise ValueError(
            f"template={data.template!r}: Qwen2.5-VL records take the qwen2_vl template; "
            "use template=qwen2_vl"
        )
    tok = HFTokenizer(data.tokenizer)
    llm = model.llm
    if tok.vocab_size > llm.vocab and grow_vocab:
        llm = dataclasses.replace(llm, vocab=tok.vocab_size)
    if tok.vocab_size > llm.vocab:
        raise ValueError(
            f"tokenizer {tok.path} has {tok.vocab_size} ids but the model's vocabulary is "
            f"{llm.vocab}; use a model with a vocabulary of at least {tok.vocab_size}"
        )
    ids = QwenTokens.of(tok)
    vision = dataclasses.replace(
        model.vision,
        video_token_id=ids.video_pad,
        vision_start_token_id=ids.vision_start,
        vision_end_token_id=ids.vision_end,
    )
    model = dataclasses.replace(model, llm=llm, vision=vision, image_token_id=ids.image_pad)
    cfg = QwenLoaderConfig(
        seq_len=seq_len,
        global_batch=data.global_batch,
        placeholder=ids.image_pad,
        video_fps=data.video_fps,
        max_frames=data.max_frames,
        balance=data.balance,
        skip_bad=data.skip_bad_samples,
        seed=seed,
        workers=data.workers,
        prefetch=data.prefetch,
        pack=data.pack,
    )
    processor = QwenImageProcessor(vision, data.min_pixels, data.max_pixels)
    out = QwenData(list(data.sources.items()), tok, processor, cfg, image_folder=data.image_folder)
    rows = max(1, data.global_batch // microbatches)
    measured = first_samples(out)
    if data.max_patches_per_microbatch is not None:
        per = llava_run.per_row("max_patches_per_microbatch", data.max_patches_per_microbatch, rows)
        if per % vision.merge_unit:
            up = -(-per // vision.merge_unit) * vision.merge_unit * rows
            raise ValueError(
                f"max_patches_per_microbatch={data.max_patches_per_microbatch} is {per} "
                f"patches per row, not a multiple of the {vision.merge_unit} the merger joins "
                f"into one token; use max_patches_per_microbatch={up}"
            )
        source = "--max-patches-per-microbatch"
    elif data.pack and measured.samples:
        per, source = packing.packed_patches(
            measured, data.global_batch, seq_len + 1, vision.merge_unit
        )
    else:
        per = max([p for _, p, _ in measured.samples], default=vision.merge_unit)
        source = (
            f"the most one of the first {measured.records} records has; a record with more is "
            "skipped (--max-patches-per-microbatch sets it)"
        )
    out.config = dataclasses.replace(cfg, patches_per_row=per)
    out.patch_budget = llava_run.budget_line(per, rows, source)
    if data.max_loss_tokens_per_microbatch is not None:
        budget = data.max_loss_tokens_per_microbatch
        loss = llava_run.per_row("max_loss_tokens_per_microbatch", budget, rows)
        source = "--max-loss-tokens-per-microbatch"
    else:
        loss, source = llava_run.derived_loss_tokens(out, measured)
    out.config = dataclasses.replace(out.config, loss_tokens_per_row=loss)
    out.loss_budget = llava_run.budget_line(loss, rows, source)
    if data.pack:
        if data.max_samples_per_row is not None:
            samples, source = data.max_samples_per_row, "--max-samples-per-row"
        else:
            samples, source = llava_run.derived_samples(out, measured)
        out.config = dataclasses.replace(out.config, samples_per_row=samples)
        out.samples_budget = llava_run.samples_line(samples, source)
    return out, model


def first_samples(data: QwenData, records: int = llava_run.PACKED_RECORDS) -> llava_run.Measured:
    """``(tokens, patches, supervised targets)`` of the first ``records`` records of the
    stream that load (headers only), what the derived budgets are measured on."""
    counts = [0] * len(data.files)
    n = min(records, sum(len(f) for f in data.files))
    drawn = [data.draw(counts) for _ in range(n)]

    def shape(s: int, j: int) -> tuple[int, int, int] | None:
        try:
            x = data.load(s, j, decode=False)
        except BadSample:  # skipped or stopped at by the loader, as it says
            return None
        return len(x.ids), x.patches, rows_lib.supervised_targets(x.supervised)

    with concurrent.futures.ThreadPoolExecutor(max(1, data.config.workers)) as pool:
        shapes = [x for x in pool.map(shape, *zip(*drawn, strict=True)) if x is not None]
    return llava_run.Measured(n, shapes)
