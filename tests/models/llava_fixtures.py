"""Loaders over the small LLaVA data set the data tests share (the ``llava_dir`` and
``tok`` fixtures of tests/conftest.py: demo records, Pillow images, a BPE tokenizer
trained with ``tokenizers``, made once per session)."""

from __future__ import annotations

import dataclasses

from models.llava import ImageProcessor, LlavaData, LoaderConfig

IMAGE_TOKENS = 16  # the tiny ViT: 16 x 16 images, 4 x 4 patches


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
