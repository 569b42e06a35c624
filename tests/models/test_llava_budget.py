"""The rows' image slots (``--max-images-per-microbatch``): the flag wins; unpacked, the
default is the most images one record has; packed, it is derived from the data so that a
row holds several image samples (no JAX)."""

from __future__ import annotations

import numpy as np
import pytest

import hetjax.config as hc
from models.config import get_preset
from models.llava import Loader
from models.llava import run as llava_run
from models.llava.rows import packed_images
from tests.models.llava_fixtures import IMAGE_TOKENS

SEQ_LEN, BATCH, MICROBATCHES = 192, 8, 2
ROWS = BATCH // MICROBATCHES  # rows per microbatch
BOUND = (SEQ_LEN + 1) // IMAGE_TOKENS  # image placeholders that fit one row


def _build(paths, **data):
    d = hc.DataConfig(
        global_batch=BATCH,
        sources={paths["train"]: 1.0},
        image_folder=paths["images"],
        tokenizer=paths["tokenizer"],
        workers=2,
        **data,
    )
    return llava_run.build(d, get_preset("tiny"), seq_len=SEQ_LEN, seed=0, microbatches=2)[0]


def _metrics(data, steps: int = 3) -> list[dict]:
    loader = Loader(data)
    try:
        return [loader.next().metrics for _ in range(steps)]
    finally:
        loader.close()


def test_packed_images_counts_the_rows_of_full_steps():
    # Rows of 10 tokens, 2 per step: (4, 2) and (4, 3) share row 0 (5 images: no slot
    # limit), (5, 1) and (5, 0) fill row 1, (3, 1) fits no row and starts step 2, which
    # is unfinished and not counted.
    samples = [(4, 2), (4, 3), (5, 1), (5, 0), (3, 1)]
    assert packed_images(samples, num_rows=2, capacity=10) == [5, 1]
    # No step filled: the unfinished one counts.
    assert packed_images([(3, 1), (9, 2)], num_rows=2, capacity=10) == [1, 2]


def test_unpacked_default_is_the_most_images_of_a_record(llava_dir):
    data = _build(llava_dir)
    assert data.max_images == 2  # the demo set's two-image records
    assert data.config.images_per_row == 2
    assert data.image_budget == (
        f"2 per row, {2 * ROWS} per microbatch of {ROWS} rows: the most images one record "
        "has (--max-images-per-microbatch sets it)"
    )


def test_packed_default_lets_rows_hold_several_image_samples(llava_dir):
    derived = _build(llava_dir, pack=True)
    one = _build(llava_dir, pack=True, max_images_per_microbatch=ROWS)  # the flag wins
    slots = derived.config.images_per_row
    assert derived.max_images < slots <= BOUND
    assert one.config.images_per_row == 1
    assert one.image_budget == (
        f"1 per row, {ROWS} per microbatch of {ROWS} rows: --max-images-per-microbatch"
    )
    budget = derived.image_budget
    assert budget.startswith(f"{slots} per row, {slots * ROWS} per microbatch of {ROWS} rows: ")
    assert "derived from the data (--pack)" in budget and f"at most a row's {BOUND}" in budget
    got, base = _metrics(derived), _metrics(one)
    # Rows hold several image samples, so packing cuts padding much further.
    assert all(m["images_per_step"] > BATCH for m in got)
    pad, pad_one = (np.mean([m["padding_fraction"] for m in ms]) for ms in (got, base))
    assert pad < pad_one / 2, (pad, pad_one)


def test_packed_default_is_the_quantile_of_the_loaders_own_rows(llava_dir):
    """The derivation against the loader itself: with as many slots as fit a row, the
    steps the first records fill (every record here: 96 < PACKED_RECORDS) put images in
    rows; the default is their 90th percentile, at least a record's most."""
    derived = _build(llava_dir, pack=True)
    unlimited = _build(llava_dir, pack=True, max_images_per_microbatch=BOUND * ROWS)
    records = sum(len(f) for f in unlimited.files)
    assert records < llava_run.PACKED_RECORDS
    loader = Loader(unlimited)
    per_row = []
    try:
        while True:
            batch = loader.next()
            if sum(batch.state["counts"]) >= records:
                break  # the sample that ends this step lies past the derivation's records
            images = batch.arrays["images"]  # [B, slots, H, W, C]; unused slots are zeros
            per_row += (np.abs(images).reshape(*images.shape[:2], -1).max(-1) > 0).sum(1).tolist()
    finally:
        loader.close()
    assert len(per_row) >= 2 * BATCH  # several full steps
    q = int(np.quantile(per_row, llava_run.PACKED_QUANTILE, method="higher"))
    assert derived.config.images_per_row == min(BOUND, max(q, derived.max_images))
    assert f"hold at most {q} images" in derived.image_budget
    assert f"the {len(per_row)} rows" in derived.image_budget


@pytest.mark.parametrize("pack", [False, True])
def test_a_budget_that_does_not_split_over_rows_still_stops(pack, llava_dir):
    with pytest.raises(ValueError, match="use max_images_per_microbatch=8"):
        _build(llava_dir, pack=pack, max_images_per_microbatch=ROWS + 1)


def test_packed_default_without_a_loadable_record_is_a_records_most(llava_dir):
    data = _build(llava_dir)
    slots, source = llava_run.packed_slots(data, records=0)
    assert slots == data.max_images == 2
    assert source.startswith("the most images one record has: none of the first 0 records")
