"""Held-out answers: does the model's greedy next token reproduce every supervised token?

Teacher-forced: for each row, the argmax of the logits at every supervised position must
be that position's target (the assistant's reply and its end-of-turn token). A row is
right only when all of its supervised tokens are, so a colour or shape answer counts
only when the model read the image.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@functools.partial(jax.jit, static_argnums=0)
def _predictions(model, params, batch):
    llm = model.modules["llm"]
    h = llm.apply_pre(params["llm"]["pre"], batch["tokens"], **model.encode(params, batch))
    h = llm.apply_blocks(params["llm"]["blocks"], h)
    return jnp.argmax(llm.bind("post", params["llm"]["post"]).logits(h), axis=-1)


def answer_accuracy(model: Any, params: Any, batch: Mapping[str, np.ndarray]) -> np.ndarray:
    """Per row: 1.0 when every supervised target is predicted, else 0.0; rows without a
    supervised token are ``nan``.

    Args:
        model: the :class:`models.mllm.MLLM` the params belong to.
        params: its parameters (full, one device).
        batch: ``tokens``, ``targets``, ``loss_mask`` and the images.
    """
    pred = np.asarray(_predictions(model, params, {k: jnp.asarray(v) for k, v in batch.items()}))
    mask = batch["loss_mask"] > 0
    wrong = ((pred != batch["targets"]) & mask).any(axis=1)
    return np.where(mask.any(axis=1), (~wrong).astype(np.float64), np.nan)
