"""Packed rows train like their samples alone: several samples per row (``--pack``) give
the loss of the same samples one per row (the mean over the step's supervised tokens),
because attention stays within a sample and RoPE positions restart per sample; and a
packed batch trains to the single-device reference's numbers under cp=2 (the segment ids
and positions travel the ring with K/V, stored zigzag like the tokens) and pp=2 on
islands (every pipeline stage's blocks read them)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from models.config import get_preset
from models.llava.rows import Packer
from models.mllm import MLLM
from tests.models.llava_fixtures import make_data
from tests.runtime.parity import case, check_matches_reference, reference_run

STEPS = 2
ROWS = 8  # packed rows per step
SLOTS = 4  # image slots per row
SEQ_LEN = 128  # two image samples fit a row


def packed_and_single(data, tok, steps: int, rows: int) -> list[tuple[dict, dict]]:
    """Per step: ``rows`` packed rows of consecutive samples (first fit), and the same
    samples one per row."""
    c, counts, pending = data.config, [0], None
    out = []
    for _ in range(steps):
        packed = Packer(rows, c.seq_len + 1, c.images_per_row, pack=True)
        samples = []
        while True:
            sample = pending or data.load(*data.draw(counts))
            pending = None
            if not packed.add(sample):
                pending = sample  # it starts the next step
                break
            samples.append(sample)
        single = Packer(len(samples), c.seq_len + 1, c.images_per_row, pack=False)
        assert all(single.add(s) for s in samples)
        shape = (16, 16, 3)
        out.append(tuple(p.arrays(pad_id=tok.pad_id, shape=shape)[0] for p in (packed, single)))
    return out


@pytest.fixture(scope="module")
def batches(llava_dir, tok):
    data = make_data(llava_dir, tok, images_per_row=SLOTS, seq_len=SEQ_LEN)
    return packed_and_single(data, tok, STEPS, ROWS)


@pytest.fixture(scope="module")
def model_config(tok):
    return dataclasses.replace(get_preset("tiny"), image_token_id=tok.image_id)


@pytest.fixture(scope="module")
def packed_reference(batches, model_config):
    model = MLLM(model_config, images_per_row=SLOTS, packed=True)
    return reference_run(model, [p for p, _ in batches])


def test_packed_loss_equals_the_samples_unpacked(
    batches,
    model_config,
    packed_reference,
    tok,
):
    packed0, single0 = batches[0]
    # The step really packs: fewer rows than samples, images in later segments too.
    assert len(single0["tokens"]) > ROWS
    seg = packed0["segment_ids"]
    assert (seg.max(axis=1) >= 2).sum() >= 2
    assert ((packed0["tokens"] == tok.image_id) & (seg >= 2)).any()
    single = reference_run(MLLM(model_config, images_per_row=SLOTS), [s for _, s in batches])
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(
            [m[key] for m in packed_reference.metrics],
            [m[key] for m in single.metrics],
            rtol=1e-5,
            atol=0,
            err_msg=key,
        )
    np.testing.assert_array_equal(
        [m["supervised_tokens"] for m in packed_reference.metrics],
        [m["supervised_tokens"] for m in single.metrics],
    )
    # Without the mask and the restarted positions the packed loss is another number
    # (close at initialisation, where every prediction is near uniform).
    plain = {k: v for k, v in packed0.items() if k not in ("segment_ids", "positions")}
    unmasked = MLLM(model_config, images_per_row=SLOTS).loss_sum(packed_reference.params, plain)
    ratio = float(unmasked) / packed0["loss_mask"].sum() / packed_reference.metrics[0]["loss"]
    assert abs(ratio - 1) > 1e-4, ratio  # ten times the tolerance above


def test_unpacked_model_refuses_packed_rows(batches, model_config, packed_reference):
    with pytest.raises(ValueError, match="packed rows"):
        jax.eval_shape(
            MLLM(model_config, images_per_row=SLOTS).loss_sum,
            packed_reference.params,
            batches[0][0],
        )


@pytest.mark.parametrize(
    "c",
    [
        # Islands: vision dp=4 on 4 devices, the LLM's two pipeline stages with cp=2 each.
        case("tiny", "non-colocated", 2, id="islands-pp2-cp2", vision="dp=4", llm="cp=2,pp=2"),
        # Colocated: the LLM's cp=2 with dp=2 and tp=2 (per-replica vmap of the ring).
        case("tiny", "colocated", 1, id="colocated-cp2", vision="dp=8", llm="dp=2,cp=2,tp=2"),
    ],
)
def test_packed_batch_matches_reference(c, packed_reference):
    check_matches_reference(c, packed_reference)
