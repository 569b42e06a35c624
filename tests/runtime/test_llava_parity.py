"""Rows with 0, 1 and 2 images (static image slots, unused ones zero) train to the
single-device reference's numbers colocated and non-colocated, both with cp=2:
each image's tokens land at its own placeholders (the cp case routes them by token id to
the rank that stores their positions), and unused slots get no gradient."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from models.config import get_preset
from models.llava import Loader
from models.mllm import MLLM
from tests.models.llava_fixtures import make_data
from tests.runtime.parity import case, check_matches_reference, reference_run

STEPS = 2


@pytest.fixture(scope="module")
def llava_reference(llava_dir, tok):
    loader = Loader(make_data(llava_dir, tok, global_batch=16, seed=3))
    batches = [loader.next().arrays for _ in range(STEPS)]
    loader.close()
    images = (np.abs(batches[0]["images"]).sum(axis=(2, 3, 4)) > 0).sum(axis=1)
    assert {0, 1, 2} <= set(images.tolist()), images  # the mix this test is about
    cfg = dataclasses.replace(get_preset("tiny"), image_token_id=tok.image_id)
    return reference_run(MLLM(cfg, images_per_row=2), batches)


@pytest.mark.parametrize(
    "c",
    [
        # cp=2 in both: image tokens routed to the cp rank of their placeholders, within
        # one device set and across islands (split over cp, then one all-to-all).
        case("tiny", "colocated", 2, id="colocated-cp2", vision="dp=8", llm="dp=2,cp=2,tp=2"),
        case("tiny", "non-colocated", 2, id="islands-cp2", vision="dp=4", llm="dp=1,cp=2,tp=2"),
    ],
)
def test_variable_images_match_reference(c, llava_reference):
    check_matches_reference(c, llava_reference)
