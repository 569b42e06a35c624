"""A training run's LLaVA data from its resolved settings (what the CLI calls).

:func:`build` loads the tokenizer, fits the model's image placeholder to it, checks every
record file (the validation pass, before any parameter exists) and fixes the rows' image
slots; :class:`DataStream` hands the training loop one batch per step with its metrics and
the position a checkpoint stores.
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
    if budget is not None:
        if rows and budget % rows:
            up = math.ceil(budget / rows) * rows
            raise ValueError(
                f"max_images_per_microbatch={budget} does not split over a microbatch's {rows} "
                f"rows; use max_images_per_microbatch={up}"
            )
        slots, source = budget // rows, "--max-images-per-microbatch"
    elif data.pack and out.max_images:
        slots, source = packed_slots(out)
    else:
        slots = max(1, out.max_images)
        source = "the most images one record has (--max-images-per-microbatch sets it)"
    out.config = dataclasses.replace(cfg, images_per_row=slots)
    out.image_budget = f"{slots} per row, {slots * rows} per microbatch of {rows} rows: {source}"
    return out, model


# The packed default's sample: the records a run reads first, and the share of packed rows
# whose images fit the slots.
PACKED_RECORDS = 2048
PACKED_QUANTILE = 0.9


def packed_slots(data: LlavaData, records: int = PACKED_RECORDS) -> tuple[int, str]:
    """The image slots per packed row, from the data, and a line saying how.

    The first ``records`` records of the stream (all, if fewer; tokenized as the loader
    does, image headers read, pixels not decoded; records the loader would skip left out)
    are packed as the loader packs them but with no limit on a row's images
    (:func:`models.llava.rows.packed_images`). The slots are the :data:`PACKED_QUANTILE`
    quantile of those rows' images: the image-richest tenth of rows then closes to
    further image samples a little early (text-only samples still fill it), while every
    row stops paying the encoder for slots only a rare row would fill. At least the most
    images one record has (no record is skipped for its images), at most
    ``(seq_len + 1) // image_tokens`` (more placeholders never fit a row).
    """
    c = data.config
    bound = max(1, (c.seq_len + 1) // c.image_tokens)
    counts = [0] * len(data.files)
    n = min(records, sum(len(f) for f in data.files))
    drawn = [data.draw(counts) for _ in range(n)]

    def shape(s: int, j: int) -> tuple[int, int] | None:
        try:  # no record is refused for its images here: the slots are what is measured
            sample = data.load(s, j, decode=False, slots=max(bound, data.max_images))
        except BadSample:  # skipped or stopped at by the loader, as it says
            return None
        return len(sample.ids), len(sample.images)

    with concurrent.futures.ThreadPoolExecutor(max(1, c.workers)) as pool:
        samples = [x for x in pool.map(shape, *zip(*drawn, strict=True)) if x is not None]
    if not samples:  # every record drawn is one the loader skips: nothing to measure
        return max(1, min(bound, data.max_images)), (
            f"the most images one record has: none of the first {n} records loads to "
            "derive more from; --max-images-per-microbatch sets it"
        )
    per_row = np.asarray(rows_lib.packed_images(samples, c.global_batch, c.seq_len + 1))
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
