"""Packed Qwen2.5-VL rows (``data.pack``): several record samples per LLM row, each with
its own mRoPE positions from 0 and its own attention segment, their images and videos
in one vision row. A packed row's loss is the unpacked rows' (equal by construction),
and training on packed rows with the LLM under cp=2 equals one device."""

from __future__ import annotations

import numpy as np
import pytest

import hetjax.config as hc
from models.config import get_preset
from models.llava.rows import Packer
from models.qwen import demo, flops, loader
from models.qwen.model import QwenVL
from tests.runtime.parity import case, check_matches_reference, reference_run

TINY = get_preset("qwen2.5-vl-tiny")
PIXELS = dict(min_pixels=28 * 28 * 2, max_pixels=28 * 28 * 4)
SEQ, BATCH = 96, 8


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return demo.make(str(tmp_path_factory.mktemp("qwen_packed")), train=24)


def _build(made, **data):
    d = hc.DataConfig(
        sources={made["train"]: 1.0},
        tokenizer=made["tokenizer"],
        image_folder=made["media"],
        global_batch=BATCH,
        template="qwen2_vl",
        workers=2,
        pack=True,
        **PIXELS,
        **data,
    )
    return loader.build(d, TINY, seq_len=SEQ, seed=0, microbatches=1, grow_vocab=True)


@pytest.fixture(scope="module")
def packed(made):
    """Packed data over demo records (images, two images, videos, text), 64 patches and
    16 supervised tokens a row, and its model."""
    budgets = dict(max_patches_per_microbatch=64 * BATCH, max_loss_tokens_per_microbatch=16 * BATCH)
    return _build(made, **budgets)


def test_packed_budgets_from_the_data(made):
    """Without flags, a packed row's patches are the 90% quantile of the first records'
    rows packed with no patch limit (at least one record's most), its samples and
    supervised tokens LLaVA's."""
    data, _ = _build(made)
    c = data.config
    assert c.pack and c.patches_per_row >= 32 and c.patches_per_row % 4 == 0
    assert data.patch_budget.startswith(f"{c.patches_per_row} per row, ")
    assert "90% of the 8 rows" in data.patch_budget and "a record's most (32)" in data.patch_budget
    assert c.samples_per_row >= 2 and data.samples_budget.startswith(f"{c.samples_per_row} per row")


def test_packed_rows_are_their_samples_alone(packed):
    """Each segment of a packed row has the tokens, mRoPE positions and supervision of
    its sample alone in a row (positions restart at 0), the vision row its samples'
    patches in order; the loss sum over packed rows is the unpacked rows' (rtol 1e-5)."""
    data, config = packed
    samples = [data.load(0, j) for j in range(10)]
    rows = Packer(3, SEQ + 1, data.config.patches_per_row, pack=True)
    samples = [s for s in samples if rows.add(s, s.patches)]
    arrays, loads = data.arrays(rows)
    np.testing.assert_array_equal(flops.row_patches(arrays), loads[:, 1])  # what balance weighs
    assert max(len(r) for r in rows.rows) >= 2 and loads[:, 1].tolist() == [
        sum(s.patches for s in r) for r in rows.rows
    ]
    for r, row_samples in enumerate(rows.rows):
        at, patch = 0, 0
        for k, s in enumerate(row_samples, start=1):
            alone, n, p = data.row(s), len(s.ids) - 1, s.patches
            assert (arrays["segment_ids"][r, at : at + n] == k).all()
            for key in ("tokens", "targets", "mrope_positions"):
                np.testing.assert_array_equal(arrays[key][r, at : at + n], alone[key][:n])
            np.testing.assert_array_equal(arrays["positions"][r, at : at + n], np.arange(n))
            np.testing.assert_array_equal(
                arrays["loss_mask"][r, at : at + n], alone["loss_mask"][:n]
            )
            np.testing.assert_array_equal(
                arrays["patches"][r, patch : patch + p], alone["patches"][:p]
            )
            at, patch = at + n + 1, patch + p
    one = Packer(len(samples), SEQ + 1, data.config.patches_per_row, pack=False)
    for s in samples:
        one.add(s, s.patches)
    unpacked, _ = data.arrays(one)
    assert arrays["loss_mask"].sum() == unpacked["loss_mask"].sum() > 0
    import jax

    flat, packed_model = QwenVL(config), QwenVL(config, packed=True, max_segments=5)
    params = flat.init(jax.random.key(0))
    want = jax.jit(flat.loss_sum)(params, unpacked)
    got = jax.jit(packed_model.loss_sum)(params, arrays)
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize(
    "c",
    [case("qwen2.5-vl-tiny", "colocated", 1, id="llm-cp2", vision="dp=8", llm="dp=2,cp=2,tp=2")],
)
def test_packed_training_matches_one_device(packed, c):
    """Two steps on a packed batch (segment ids and restarting positions split with the
    tokens over cp, the merged tokens routed to their placeholders' ranks) equal one
    device. The same batch twice: under cp the routed slots per rank follow each batch's
    placeholders (a few shapes, compiled once each), and the check counts no compile
    after the first step."""
    data, config = packed
    stream = loader.QwenStream(data, (1, 8, 2))
    try:
        batch = stream.batch(0)
    finally:
        stream.close()
    assert (batch["segment_ids"].max(1) >= 2).all() and (batch["segment_ids"].max(1) >= 3).any()
    model = QwenVL(
        config,
        packed=True,
        loss_tokens_per_row=data.config.loss_tokens_per_row,
        max_segments=data.config.samples_per_row + 1,
    )
    check_matches_reference(c, reference_run(model, [batch, batch]))
