"""A training run's LLaVA data from its resolved settings (what the CLI calls).

:func:`build` loads the tokenizer, fits the model's image placeholder to it, checks every
record file (the validation pass, before any parameter exists) and fixes the rows' image
slots, loss budget and (packed) samples per row; :class:`DataStream` hands the training
loop one batch per step with its metrics and the position a checkpoint stores.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import time
from collections.abc import Collection
from typing import Any

import numpy as np

from models import tokenizer
from models.config import MLLMConfig
from models.data import SyntheticConfig
from models.llava import rows as rows_lib
from models.llava.images import ImageProcessor
from models.llava.loader import LlavaData, Loader, LoaderConfig, summary_counts
from models.llava.records import BadSample
from models.llava.text import HFTokenizer


def build(
    data: Any,
    model: MLLMConfig,
    *,
    seq_len: int,
    seed: int,
    microbatches: int,
    grow_vocab: bool = False,
) -> tuple[LlavaData, MLLMConfig]:
    """The checked data and the model config with the tokenizer's ``<image>`` id.

    Args:
        data: a :class:`hetjax.config.DataConfig` with ``sources``.
        model: the model preset.
        grow_vocab: the LLM starts fresh: a tokenizer larger than its vocabulary grows it
            to the tokenizer's size (else that is an error).

    Raises:
        ValueError: one line: a tokenizer that does not load or does not fit the model's
            vocabulary, a bad record (without ``skip_bad_samples``), an image budget that
            does not split over a microbatch's rows.
    """
    tok = HFTokenizer(data.tokenizer)
    if tok.vocab_size > model.llm.vocab and grow_vocab:
        model = dataclasses.replace(model, llm=dataclasses.replace(model.llm, vocab=tok.vocab_size))
    if tok.vocab_size > model.llm.vocab:
        raise ValueError(
            f"tokenizer {tok.path} has {tok.vocab_size} ids but the model's vocabulary is "
            f"{model.llm.vocab}; use a model with a vocabulary of at least {tok.vocab_size} "
            "(model.vocab_size, for a fresh LLM)"
        )
    if tok.image_id is not None:
        model = dataclasses.replace(model, image_token_id=tok.image_id)
    vision = model.vision
    rows = data.global_batch // microbatches
    cfg = LoaderConfig(
        seq_len=seq_len,
        global_batch=data.global_batch,
        image_tokens=vision.num_tokens if vision else 0,
        placeholder=tokenizer.IMAGE if model.image_token_id is None else model.image_token_id,
        images_per_row=1,
        template=data.template,
        pack=data.pack,
        balance=data.balance,
        skip_bad=data.skip_bad_samples,
        seed=seed,
        workers=data.workers,
        prefetch=data.prefetch,
    )
    processor = (
        ImageProcessor.for_encoder(vision.kind, vision.image_size, pad=data.image_aspect == "pad")
        if vision
        else None
    )
    out = LlavaData(list(data.sources.items()), tok, processor, cfg, image_folder=data.image_folder)
    if out.max_images and vision is None:
        raise ValueError(f"the records have images but model {model.name!r} has no vision encoder")
    budget = data.max_images_per_microbatch
    measured = None  # the first records' shapes, loaded once for the derived defaults
    if budget is not None:
        slots = per_row("max_images_per_microbatch", budget, rows)
        source = "--max-images-per-microbatch"
    elif data.pack and out.max_images:
        measured = first_samples(out)
        slots, source = packed_slots(out, measured=measured)
    else:
        slots = max(1, out.max_images)
        source = "the most images one record has (--max-images-per-microbatch sets it)"
    out.config = dataclasses.replace(cfg, images_per_row=slots)
    out.image_budget = budget_line(slots, rows, source)
    budget = data.max_loss_tokens_per_microbatch
    if budget is not None:
        loss, source = (
            per_row("max_loss_tokens_per_microbatch", budget, rows),
            "--max-loss-tokens-per-microbatch",
        )
    else:
        loss, source = derived_loss_tokens(out, measured or first_samples(out))
    out.config = dataclasses.replace(out.config, loss_tokens_per_row=loss)
    out.loss_budget = budget_line(loss, rows, source)
    if data.pack:
        if data.max_samples_per_row is not None:
            samples, source = data.max_samples_per_row, "--max-samples-per-row"
        else:
            samples, source = derived_samples(out, measured or first_samples(out))
        out.config = dataclasses.replace(out.config, samples_per_row=samples)
        out.samples_budget = samples_line(samples, source)
    return out, model


def budget_line(per: int, rows: int, source: str) -> str:
    """What the run summary says of a per-row budget: its sizes and where it came from."""
    return f"{per} per row, {per * rows} per microbatch of {rows} rows: {source}"


def per_row(name: str, budget: int, rows: int) -> int:
    """A per-microbatch budget ``name`` split over a microbatch's ``rows``.

    Raises:
        ValueError: it does not split evenly (names the next budget that does).
    """
    rows = max(rows, 1)  # fewer rows than microbatches: the trainer's batch check says so
    if budget % rows:
        up = math.ceil(budget / rows) * rows
        raise ValueError(
            f"{name}={budget} does not split over a microbatch's {rows} rows; use {name}={up}"
        )
    return budget // rows


def synthetic_loss_tokens(budget: int | None, data: SyntheticConfig, rows: int) -> tuple[int, str]:
    """The synthetic rows' loss budget per row and a line saying where it came from: the
    flag's share of a microbatch, or (default) the most any synthetic sample supervises,
    an exact bound (:meth:`models.data.SyntheticConfig.max_supervised_tokens`).

    Raises:
        ValueError: the flag's share of a row is below that bound (one line, the fix).
    """
    need = data.max_supervised_tokens()
    if budget is None:
        return (
            need,
            "the most a synthetic sample supervises (--max-loss-tokens-per-microbatch sets it)",
        )
    cap = per_row("max_loss_tokens_per_microbatch", budget, rows)
    if cap < need:
        raise ValueError(
            f"max_loss_tokens_per_microbatch={budget} is {cap} supervised tokens per row of a "
            f"{rows}-row microbatch, but synthetic samples supervise up to {need}; use "
            f"max_loss_tokens_per_microbatch={need * rows}"
        )
    return cap, "--max-loss-tokens-per-microbatch"


# The packed default's sample: the records a run reads first, and the share of packed rows
# whose images fit the slots.
PACKED_RECORDS = 2048
PACKED_QUANTILE = 0.9


def first_samples(data: LlavaData, records: int = PACKED_RECORDS) -> Measured:
    """The first ``records`` records of the stream (all, if fewer) as the loader loads them
    (tokenized, image headers read, pixels not decoded; records it would skip left out):
    what the derived budgets are measured on. No record is refused for its images or its
    supervised tokens here: those are what is measured."""
    c = data.config
    bound = max(1, (c.seq_len + 1) // c.image_tokens) if c.image_tokens else 1
    counts = [0] * len(data.files)
    n = min(records, sum(len(f) for f in data.files))
    drawn = [data.draw(counts) for _ in range(n)]

    def shape(s: int, j: int) -> tuple[int, int, int] | None:
        try:
            sample = data.load(s, j, decode=False, slots=max(bound, data.max_images))
        except BadSample:  # skipped or stopped at by the loader, as it says
            return None
        return len(sample.ids), len(sample.images), rows_lib.supervised_targets(sample.supervised)

    with concurrent.futures.ThreadPoolExecutor(max(1, c.workers)) as pool:
        shapes = [x for x in pool.map(shape, *zip(*drawn, strict=True)) if x is not None]
    return Measured(n, shapes)


@dataclasses.dataclass(frozen=True)
class Measured:
    """:func:`first_samples`: how many records were drawn, and ``(tokens, images,
    supervised targets)`` of those that load."""

    records: int
    samples: list[tuple[int, int, int]]


def packed_slots(
    data: LlavaData, records: int = PACKED_RECORDS, *, measured: Measured | None = None
) -> tuple[int, str]:
    """The image slots per packed row, from the data, and a line saying how.

    The first ``records`` records (:func:`first_samples`, or ``measured``) are packed as
    the loader packs them but with no limit on a row's images
    (:func:`models.llava.rows.packed_images`). The slots are the :data:`PACKED_QUANTILE`
    quantile of those rows' images: the image-richest tenth of rows then closes to
    further image samples a little early (text-only samples still fill it), while every
    row stops paying the encoder for slots only a rare row would fill. At least the most
    images one record has (no record is skipped for its images), at most
    ``(seq_len + 1) // image_tokens`` (more placeholders never fit a row).
    """
    c = data.config
    bound = max(1, (c.seq_len + 1) // c.image_tokens)
    measured = measured or first_samples(data, records)
    n, samples = measured.records, measured.samples
    if not samples:  # every record drawn is one the loader skips: nothing to measure
        return max(1, min(bound, data.max_images)), (
            f"the most images one record has: none of the first {n} records loads to "
            "derive more from; --max-images-per-microbatch sets it"
        )
    per_row = np.asarray(
        rows_lib.packed_images([(t, i) for t, i, _ in samples], c.global_batch, c.seq_len + 1)
    )
    q = int(np.quantile(per_row, PACKED_QUANTILE, method="higher"))
    slots = min(bound, max(q, data.max_images))
    pct = round(PACKED_QUANTILE * 100)
    return slots, (
        f"derived from the data (--pack): {pct}% of the {len(per_row)} rows in the full "
        f"steps of the first {n} records ({n - len(samples)} skipped), packed with no slot "
        f"limit, hold at most {q} images (mean {per_row.mean():.1f}, max {per_row.max()}); "
        f"at least a record's most ({data.max_images}), at most a row's {bound}; "
        "--max-images-per-microbatch sets it"
    )


# Derived loss budgets are rounded up to a multiple of this (a margin over the measured
# rows, and whole tiles for the head's matmul).
LOSS_ROUND = 8


def derived_loss_tokens(data: LlavaData, measured: Measured) -> tuple[int, str]:
    """The supervised targets per row the LM head computes, from the data, and a line
    saying how: the most one row of the measured records holds (one record a row, or
    packed as the loader packs them with the run's image slots), rounded up to a
    multiple of :data:`LOSS_ROUND`, at most ``seq_len`` (every position: no saving). A
    later record with more is skipped and counted (``too_many_loss_tokens``), never cut;
    a packed row closes to a sample whose targets would not fit."""
    c = data.config
    n, samples = measured.records, measured.samples
    if not samples:
        return c.seq_len, (
            f"every position: none of the first {n} records loads to derive it from; "
            "--max-loss-tokens-per-microbatch sets it"
        )
    if c.pack:
        rows = rows_lib.packed_rows(samples, c.global_batch, c.seq_len + 1, c.images_per_row)
        most, how = max(r[2] for r in rows), f"the {len(rows)} packed rows of"
    else:
        most, how = max(x[2] for x in samples), "one row each,"
    loss = min(c.seq_len, max(1, math.ceil(most / LOSS_ROUND) * LOSS_ROUND))
    return loss, (
        f"derived from the data: {how} the first {n} records ({n - len(samples)} skipped) "
        f"supervise at most {most} tokens a row, rounded up to {LOSS_ROUND}s, at most "
        f"seq_len; a record with more is skipped; --max-loss-tokens-per-microbatch sets it"
    )


def derived_samples(data: LlavaData, measured: Measured) -> tuple[int, str]:
    """The samples a packed row holds at most, from the data, and a line saying how: the
    most one row holds when the measured records pack as the loader packs them (the run's
    image slots and loss budget, no limit on samples). A later row reaching it closes to
    further samples (they start other rows), so the bound holds for every row; each
    sample it allows costs the fused attention's statistics one ``[heads, L]`` float32
    per row, so it is not rounded up."""
    c = data.config
    n, samples = measured.records, measured.samples
    if not samples:
        return 1, (
            f"one sample a row: none of the first {n} records loads to derive more from; "
            "--max-samples-per-row sets it"
        )
    rows = rows_lib.packed_rows(
        samples, c.global_batch, c.seq_len + 1, c.images_per_row, loss_tokens=c.loss_tokens_per_row
    )
    most = max(r[3] for r in rows)
    mean = np.mean([r[3] for r in rows])
    return most, (
        f"derived from the data: the {len(rows)} packed rows of the first {n} records "
        f"({n - len(samples)} skipped) hold at most {most} samples (mean {mean:.1f}); a row "
        "closes at it; --max-samples-per-row sets it"
    )


def samples_line(samples: int, source: str) -> str:
    """What the run summary says of the samples per packed row: the bound, the attention
    segments it makes (:func:`models.llava.rows.attention_segments`) and its source."""
    segments = rows_lib.attention_segments(samples)
    return f"{samples} per row ({segments} attention segments with the padding): {source}"


class DataStream:
    """One batch per step from a loader position (``state``; ``None``: the start).

    Args:
        data: from :func:`build`.
        bins: ``(microbatches, encoder dp, llm dp)`` for balancing and imbalance metrics.
        state: a checkpoint's ``data.state``.
        image_rows: the global rows whose images this process decodes (a multi-process
            run's local rows, :func:`hetjax.runtime.feed.local_rows`); ``None``: all.
    """

    def __init__(
        self,
        data: LlavaData,
        bins: tuple[int, int, int],
        state: Any = None,
        *,
        image_rows: Collection[int] | None = None,
    ):
        data.config = dataclasses.replace(data.config, bins=bins)
        self.data = data
        self.loader = Loader(data, state, image_rows=image_rows)
        self.metrics: dict[int, dict[str, float]] = {}

    def batch(self, step: int) -> dict[str, Any]:
        start = time.perf_counter()
        b = self.loader.next()  # waits only when the producer is behind
        self.metrics[step] = {**b.metrics, "data_wait_s": time.perf_counter() - start}
        return b.arrays

    def step_metrics(self, step: int) -> dict[str, float]:
        """The data metrics of step ``step``'s batch (read once)."""
        return self.metrics.pop(step, {})

    def checkpoint(self) -> dict[str, Any]:
        """What a checkpoint records: the position after the last batch handed out."""
        return {"kind": "llava", "state": self.loader.state}

    def summary(self) -> str:
        counts = summary_counts(self.loader.state)
        skipped = ", ".join(f"{k} {v}" for k, v in counts.items())
        return skipped or "no record skipped or truncated"

    def close(self) -> None:
        self.loader.close()


class SyntheticStream:
    """:class:`DataStream`'s interface over :class:`models.data.SyntheticLlava` (a
    function of seed and step: the position is the step)."""

    def __init__(self, dataset: Any, global_batch: int, seed: int):
        self.dataset, self.global_batch, self.seed = dataset, global_batch, seed
        self.next_step = 0

    def batch(self, step: int) -> dict[str, Any]:
        self.next_step = step + 1
        return self.dataset.batch(step, self.global_batch)

    def step_metrics(self, step: int) -> dict[str, float]:
        return {}

    def checkpoint(self) -> dict[str, Any]:
        return {"kind": "synthetic", "seed": self.seed, "next_step": self.next_step}

    def summary(self) -> str:
        return "synthetic"

    def close(self) -> None:
        pass
