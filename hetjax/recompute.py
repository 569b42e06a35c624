"""Activation recompute policies: the one definition the config, the graph and the planner import.

What a trained pipeline stage keeps between its forward and its backward (see
:mod:`hetjax.runtime.vjp` for how the engine runs each):

- ``none`` keeps the residuals of ``jax.vjp`` and replays nothing;
- ``selective`` keeps the outputs of the weight matmuls (dot_generals without batch
  dimensions) and recomputes the rest: element-wise ops and the attention core (QK^T,
  softmax, PV), and MoE experts (their matmuls batch over experts);
- ``full`` keeps the stage input and replays the whole forward.

It sits outside the packages that use it (it imports nothing of hetjax), so the config
tree can name the policies without importing the runtime.
"""

from __future__ import annotations

import typing
from typing import Literal

Recompute = Literal["none", "selective", "full"]
RECOMPUTE_POLICIES: tuple[Recompute, ...] = typing.get_args(Recompute)
# The default activation policy. Measured (experiments.bench_engine, README; small
# preset): `none` runs no forward twice (compiled FLOPs 1.000x the fused reference
# step's), `selective` 1.012x, `full` 1.20x (every trained stage but the loss stage
# replays its forward). `none` costs stash memory (XLA attention's L^2 scores are
# residuals), which 1F1B bounds per stage (P - s microbatches). Megatron also
# recomputes nothing by default.
DEFAULT_RECOMPUTE: Recompute = "none"
