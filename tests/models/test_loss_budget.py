"""The loss budget (``--max-loss-tokens-per-microbatch``): supervised tokens per row the
LM head computes. Synthetic rows default to the exact bound; LLaVA rows to the most the
first records' rows hold; no row the loader builds ever has more (a packed row closes, a
record with more is skipped and counted), and a budget that cannot hold the data is one
line (no JAX)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from models.config import get_preset
from models.data import SyntheticConfig, SyntheticLlava
from models.llava import Loader
from models.llava import run as llava_run
from models.llava.rows import Packer, supervised_targets
from tests.models.test_llava_budget import BATCH, ROWS, SEQ_LEN, _build


def _batches(data, steps: int = 3) -> list:
    loader = Loader(data)
    try:
        return [loader.next() for _ in range(steps)]
    finally:
        loader.close()


def _most_per_row(batches) -> int:
    return max(int(np.count_nonzero(b.arrays["loss_mask"], axis=1).max()) for b in batches)


def test_synthetic_default_is_the_exact_bound_and_a_smaller_flag_is_one_line():
    cfg = get_preset("tiny")
    synthetic = SyntheticConfig.for_model(cfg, seq_len=cfg.seq_len, seed=0)
    need = synthetic.max_supervised_tokens()
    counts = np.count_nonzero(SyntheticLlava(synthetic).batch(0, 256)["loss_mask"], axis=1)
    assert counts.max() == need  # reached, never passed
    assert llava_run.synthetic_loss_tokens(None, synthetic, ROWS)[0] == need
    assert llava_run.synthetic_loss_tokens(need * ROWS, synthetic, ROWS) == (
        need,
        "--max-loss-tokens-per-microbatch",
    )
    with pytest.raises(ValueError, match=rf"use max_loss_tokens_per_microbatch={need * ROWS}$"):
        llava_run.synthetic_loss_tokens((need - 1) * ROWS, synthetic, ROWS)
    with pytest.raises(ValueError, match=rf"use max_loss_tokens_per_microbatch={2 * ROWS}$"):
        llava_run.synthetic_loss_tokens(ROWS + 1, synthetic, ROWS)  # does not split


@pytest.mark.parametrize("pack", [False, True])
def test_llava_default_is_derived_and_holds_every_row(pack, llava_dir):
    data = _build(llava_dir, pack=pack)
    per_row = data.config.loss_tokens_per_row
    measured = llava_run.first_samples(data)
    if pack:
        rows = llava_run.rows_lib.packed_rows(
            measured.samples, BATCH, SEQ_LEN + 1, data.config.images_per_row
        )
        most = max(r[2] for r in rows)
    else:
        most = max(s[2] for s in measured.samples)
    assert per_row == min(SEQ_LEN, math.ceil(most / llava_run.LOSS_ROUND) * llava_run.LOSS_ROUND)
    assert per_row < SEQ_LEN  # the head computes fewer positions than a row has
    assert data.loss_budget.startswith(f"{per_row} per row, {per_row * ROWS} per microbatch")
    assert f"supervise at most {most} tokens a row" in data.loss_budget
    assert _most_per_row(_batches(data)) <= per_row


def test_a_small_budget_closes_packed_rows_and_skips_records_over_it(llava_dir):
    # The demo records supervise up to 25 tokens: a budget of 16 a row refuses some.
    data = _build(llava_dir, pack=True, max_loss_tokens_per_microbatch=16 * ROWS)
    assert data.config.loss_tokens_per_row == 16
    assert data.loss_budget.endswith("--max-loss-tokens-per-microbatch")
    batches = _batches(data)
    assert _most_per_row(batches) <= 16
    assert batches[-1].state["bad"].get("too_many_loss_tokens", 0) > 0  # counted, not cut


def test_packer_closes_a_row_to_a_sample_whose_targets_do_not_fit():
    class S:  # n tokens, all supervised: n - 1 targets (the first is no target)
        def __init__(self, n):
            self.ids, self.supervised = np.arange(n, dtype=np.int32), np.ones(n, np.float32)
            self.images = []

    assert supervised_targets(S(6).supervised) == 5
    p = Packer(2, capacity=20, slots=1, pack=True, loss_tokens=8)
    assert p.add(S(6)) and p.add(S(6))  # 5 + 5 > 8: the second opens row 1
    assert p.add(S(4))  # 5 + 3 fits row 0
    assert [u[2] for u in p.used] == [8, 5]
    arrays, _ = p.arrays(pad_id=0, shape=None)
    np.testing.assert_array_equal(np.count_nonzero(arrays["loss_mask"], axis=1), [8, 5])
