"""The small LLaVA data set the data tests share: made once per session (demo records,
Pillow images, a BPE tokenizer trained with ``tokenizers``)."""

from __future__ import annotations

import dataclasses

import pytest

from models.llava import HFTokenizer, ImageProcessor, LlavaData, LoaderConfig, demo

IMAGE_TOKENS = 16  # the tiny ViT: 16 x 16 images, 4 x 4 patches


@pytest.fixture(scope="session")
def llava_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("llava")
    return demo.make(str(out), train=96, heldout=16, long_captions=True)


@pytest.fixture(scope="session")
def tok(llava_dir):
    return HFTokenizer(llava_dir["tokenizer"])


def make_data(paths, tok, sources=None, **overrides) -> LlavaData:
    """A :class:`LlavaData` over ``sources`` (default: the train file) with test rows."""
    base = LoaderConfig(
        seq_len=96,
        global_batch=8,
        image_tokens=IMAGE_TOKENS,
        placeholder=tok.image_id,
        images_per_row=2,
        workers=2,
    )
    folder = overrides.pop("image_folder", paths["images"])
    return LlavaData(
        sources or [(paths["train"], 1.0)],
        tok,
        ImageProcessor.for_encoder("vit", 16),
        dataclasses.replace(base, **overrides),
        image_folder=folder,
    )
