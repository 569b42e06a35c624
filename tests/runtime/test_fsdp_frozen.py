"""Frozen parts under fsdp: held in the compute dtype (``ParallelOptions.frozen_dtype``),
with no optimizer state, AND split over fsdp like trained parameters (issue 31 item 2).
Placement only: nothing is compiled but the optimizer-state init (``test_frozen_dtype.py``
checks that the bf16 holding trains bit-identically, ``test_fsdp_parity.py`` that frozen
parts train under fsdp as on one device)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import hetjax
from hetjax.inspect.memory import shard_bytes_per_device
from hetjax.meshes import FSDP_AXIS
from hetjax.runtime.fsdp import expected_bytes_per_device
from tests.runtime.parity import OPTIMIZER
from tests.runtime.test_frozen_dtype import FREEZE, bf16_model


def test_bf16_frozen_encoder_is_split_over_fsdp():
    model, init, _ = bf16_model()
    layouts = {"vision": hetjax.Layout(dp=2, fsdp=4), "llm": hetjax.Layout(fsdp=4, tp=2)}
    plan = hetjax.plan_run(model.train_graph(layouts, freeze=FREEZE), num_devices=8)
    ex = hetjax.Executor(
        plan,
        init,
        devices=jax.devices(),
        optimizer=OPTIMIZER,
        options=hetjax.ParallelOptions(frozen_dtype="bfloat16"),
    )
    frozen = ex.state.params[("vision", 0)]["vision"]
    matrices = [a for a in jax.tree.leaves(frozen) if a.dtype == jnp.bfloat16]
    assert matrices and all(FSDP_AXIS in jax.tree.leaves(tuple(a.sharding.spec)) for a in matrices)
    got, want = (
        max(shard_bytes_per_device(jax.tree.leaves(frozen)).values()),
        expected_bytes_per_device(frozen),
    )
    assert abs(got - want) <= 0.05 * want, (got, want)
    whole = sum(a.nbytes for a in jax.tree.leaves(frozen))
    assert got <= 1.05 * whole / 4, (got, whole)  # ~ 1 / fsdp of the bf16 holding
    prog = ex.programs[("vision", 0)]  # no optimizer state: it covers the trained parts
    assert prog.trainable == ("projector",)
    moments = {a.shape for a in jax.tree.leaves(ex.state.opt_state[("vision", 0)]) if a.ndim}
    assert moments <= {
        a.shape for a in jax.tree.leaves(ex.state.params[("vision", 0)]["projector"])
    }
