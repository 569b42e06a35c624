"""A checkpoint saved under fsdp resumes without it (the other way round is a row of
``test_checkpoint.py``'s ``test_resumes_into_another_layout``): the logical format holds
every array whole, whatever split it was saved from."""

from __future__ import annotations

import jax
import numpy as np

import hetjax
from hetjax.checkpoint import Checkpointer
from tests.checkpoint.test_checkpoint import (
    OPTIMIZER,
    SAVED,
    SAVED_LAYOUT,
    continue_from,
    plan,
    setup,
)

FSDP_LAYOUT = {"vision": "dp=2,fsdp=4", "llm": "fsdp=2,tp=2,pp=2"}


def test_fsdp_checkpoint_resumes_without_fsdp(tmp_path):
    model, params, batches = setup()
    ex = hetjax.Executor(
        plan(model, FSDP_LAYOUT), params, devices=jax.devices(), optimizer=OPTIMIZER
    )
    for b in batches[:SAVED]:
        ex.step(b)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(SAVED, ex, metadata={"model": {"preset": "tiny"}})
    ckpt.close()
    losses = [float(ex.step(b)["loss"]) for b in batches[SAVED:]]  # the run goes on

    other = hetjax.Executor(plan(model, SAVED_LAYOUT), devices=jax.devices(), optimizer=OPTIMIZER)
    np.testing.assert_allclose(continue_from(tmp_path, other), losses, rtol=1e-5)
