"""The LM head on supervised positions only, through the executor, vs the whole-row head.

A model with a loss budget (``MLLM(loss_tokens_per_row=...)``: the head gathers each
row's supervised positions) trains to the single-device reference run of the SAME model
with the dense head (``tests/runtime/parity.py``'s harness and its cached reference): the
parameters after one step within atol 1e-6, losses and gradient norms within rtol 1e-5.
The case is the head's hardest layout: the LLM per cp rank (``cp_local``: each rank
gathers within its own zigzag block inside the ``shard_map``), the vocabulary over tp,
sequence parallelism and two data-parallel replicas; the GSPMD cp path (cp blocks of a
row) and the one-device path are checked at the head in ``tests/models/test_loss_head.py``.
"""

from __future__ import annotations

import dataclasses

from models.config import get_preset
from models.data import SyntheticConfig
from models.mllm import MLLM
from tests.runtime import parity

STEPS = 3  # of the cached 10-step reference: one step for the parameters, two for losses


def test_gathered_head_trains_like_the_whole_row_head():
    case = parity.case(
        "tiny",
        "colocated",
        1,
        options=("sequence_parallel",),
        id="dp2cp2tp2-sp",
        vision="dp=8",
        llm="dp=2,cp=2,tp=2",
    ).values[0]
    dense = parity.reference("tiny", 8)
    cfg = get_preset("tiny")
    budget = SyntheticConfig.for_model(cfg, seq_len=cfg.seq_len, seed=0).max_supervised_tokens()
    assert budget < cfg.seq_len // 2  # below a cp block: the gathered path
    ref = dataclasses.replace(
        dense,
        model=MLLM(cfg, loss_tokens_per_row=budget),
        batches=dense.batches[:STEPS],
        metrics=dense.metrics[:STEPS],
    )
    ex = parity.check_matches_reference(case, ref)
    assert ex.programs[("llm", 0)].cp_local
