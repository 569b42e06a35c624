"""Fully sharded data parallelism (``fsdp``) vs the single-device reference, and that it is
really FSDP.

Parity (the harness of ``tests/runtime/parity.py``: parameters after one step within
atol 1e-6, losses and norms within rtol 1e-5 at each of 10 steps, nothing compiled after
the first step) over a covering set of layouts: fsdp in the encoder and the LLM, with tp
(A), with pp across islands and microbatches (B), with ZeRO-1 over the remaining dp (C),
with cp, run per cp rank in a region manual over dp, fsdp and cp (its gradients reduced
over cp once per step), with tp = 1 (D) and tp = 2 (E), the homogeneous baseline (F), a
dropless MoE LLM with ep (G), ``full`` recompute (H) and a frozen encoder under
``selective`` (I). A and B run by default, the rest are ``slow`` (CI runs them).

What makes it FSDP, checked on A's executor after its 10 steps (no new compile):

- every device holds ``1 / fsdp`` of the parameters and the optimizer moments it would
  hold without fsdp (within 5%; measured from the arrays' addressable shards), and the
  gradients leave the backward split the same way;
- the encoder's forward all-gathers each layer's weights inside the layer loop (once per
  layer: executions = depth), their bytes the ideal (each weight's gathered bytes once);
  its backward gathers them again and reduce-scatters each layer's gradient there
  (XLA:CPU: the all-reduce + dynamic slice a reduce-scatter is made of) - and no
  activation-sized residual of theirs is stashed between the two.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from hetjax.inspect import Recorder, collectives, varied_axes
from hetjax.inspect.memory import shard_bytes_per_device
from hetjax.meshes import FSDP_AXIS, gathered_spec
from hetjax.runtime.fsdp import expected_bytes_per_device
from models.config import get_preset
from models.mllm import MLLM
from tests.runtime import parity
from tests.runtime.parity import (
    STEPS,
    Case,
    assert_cp_reduced_once_per_step,
    check_matches_reference,
    reference,
)

GLOBAL_BATCH = 8
case = functools.partial(parity.case, slow=True)

A = case(
    "tiny",
    "colocated",
    1,
    slow=False,
    id="A-colocated-vis_dp2fsdp4-llm_fsdp4tp2",
    vision="dp=2,fsdp=4",
    llm="fsdp=4,tp=2",
)
CASES = [
    case(
        "tiny",
        "non-colocated",
        2,
        slow=False,
        id="B-noncolocated-vis_dp2fsdp2-llm_fsdp2pp2-mb2",
        vision="dp=2,fsdp=2",
        llm="fsdp=2,pp=2",
    ),
    case(
        "tiny",
        "colocated",
        1,
        options=("zero1",),
        id="C-colocated-vis_dp2fsdp4-llm_dp2fsdp2tp2-zero1",
        vision="dp=2,fsdp=4",
        llm="dp=2,fsdp=2,tp=2",
    ),
    case(
        "tiny",
        "non-colocated",
        2,
        id="D-noncolocated-vis_dp4-llm_fsdp2cp2-mb2",
        vision="dp=4",
        llm="fsdp=2,cp=2",
    ),
    case(
        "tiny",
        "colocated",
        1,
        id="E-colocated-llm_fsdp2cp2tp2",
        vision="dp=8",
        llm="fsdp=2,cp=2,tp=2",
    ),
    case(
        "tiny",
        "homogeneous",
        1,
        id="F-homogeneous-llm_dp2fsdp2tp2",
        vision="dp=8",
        llm="dp=2,fsdp=2,tp=2",
    ),
    case(
        "tiny-moe",
        "colocated",
        1,
        id="G-moe-llm_dp2fsdp2ep2tp2",
        vision="dp=8",
        llm="dp=2,fsdp=2,ep=2,tp=2",
    ),
    case(
        "tiny",
        "non-colocated",
        2,
        recompute="full",
        id="H-noncolocated-full-recompute",
        vision="dp=2,fsdp=2",
        llm="fsdp=2,pp=2",
    ),
    case(
        "tiny",
        "colocated",
        1,
        recompute="selective",
        freeze=("vision",),
        id="I-colocated-frozen-vision-selective",
        vision="dp=2,fsdp=4",
        llm="fsdp=4,tp=2",
    ),
]


def run_case(c: Case, observers=()):
    frozen = MLLM(get_preset(c.preset)).frozen_parts(c.freeze) if c.freeze else frozenset()
    return check_matches_reference(c, reference(c.preset, GLOBAL_BATCH, frozen), observers)


@pytest.fixture(scope="module")
def run_a():
    """Case A checked against the reference, its executor and its compiled programs."""
    rec = Recorder()
    return run_case(A.values[0], (rec,)), rec


def test_a_matches_single_device_reference(run_a):
    ex, _ = run_a
    assert {p.mesh.shape[FSDP_AXIS] for p in ex.programs.values()} == {4}


@pytest.mark.parametrize("case", CASES)
def test_matches_single_device_reference(case):
    rec = Recorder()
    ex = run_case(case, (rec,))
    if case.parsed["llm"].cp > 1 and get_preset(case.preset).llm.moe is None:
        # Per cp rank (manual over dp, fsdp and cp): reduced over cp once per step.
        assert all(p.map.fsdp_manual for k, p in ex.programs.items() if k[0] == "llm")
        assert_cp_reduced_once_per_step(rec, ex, STEPS)


def test_state_is_split_over_fsdp(run_a):
    ex, _ = run_a
    for key, prog in ex.programs.items():
        params, opt = ex.state.params[key], ex.state.opt_state[key]
        moments = [a for a in jax.tree.leaves(opt) if a.ndim]  # Adam's mu and nu
        for what, tree in (("params", params), ("moments", moments)):
            got, want = (
                max(shard_bytes_per_device(jax.tree.leaves(tree)).values()),
                expected_bytes_per_device(tree),
            )
            assert abs(got - want) <= 0.05 * want, (key, what, got, want)
            whole = sum(a.nbytes for a in jax.tree.leaves(tree)) // prog.mesh.shape["tp"]
            assert got <= 1.05 * whole / 4, (key, what, got, whole)  # ~ whole / fsdp
        # Gradients leave the backward split over fsdp like their parameters.
        trained = jax.tree.leaves(prog.trainable_of(prog.param_shardings))
        acc = jax.tree.leaves(prog.acc_shardings)
        assert [tuple(s.spec)[1:] for s in acc] == [tuple(s.spec) for s in trained], key
        assert any(FSDP_AXIS in jax.tree.leaves(tuple(s.spec)) for s in acc), key


def test_encoder_gathers_each_layer_in_the_loop_and_reduce_scatters_its_gradient(run_a):
    ex, rec = run_a
    key = ("vision", 0)
    prog, depth = ex.programs[key], get_preset("tiny").vision.depth
    assert prog.keeps_residuals  # its forward and backward are separate programs

    def over_fsdp(program: str, kind: str) -> list:
        return _over_fsdp(ex, rec, key, program, kind)

    blocks = ex.state.params[key]["vision"]["blocks"]
    matrices = [a for a in jax.tree.leaves(blocks) if a.ndim == 3]  # [layers, d_in, d_out]
    layer_shapes = {tuple(_gathered_shard(a)[1:]) for a in matrices}

    fwd = over_fsdp("fwd", "all-gather")
    in_loop = [c for c in fwd if c.executions == depth]
    # a matrix's last two dims (a leading replica dim of 1 may or may not be there)
    gathered = {s[-2:] for c in in_loop for s in c.shapes if len(s) >= 2}
    assert layer_shapes <= gathered, (layer_shapes, gathered)
    # Each weight once per layer: the forward's gathers are the ideal bytes (all leaves).
    ideal = sum(
        int(np.prod(_gathered_shard(a))) * a.dtype.itemsize
        for a in jax.tree.leaves(ex.state.params[key])
        if FSDP_AXIS in jax.tree.leaves(tuple(a.sharding.spec))
    )
    got = sum(c.nbytes * c.executions for c in fwd)
    assert abs(got - ideal) <= 0.1 * ideal, (got, ideal)

    bwd_gathers = [c for c in over_fsdp("bwd", "all-gather") if c.executions == depth]
    assert layer_shapes <= {s[-2:] for c in bwd_gathers for s in c.shapes if len(s) >= 2}
    scattered = [c for c in over_fsdp("bwd", "all-reduce") if c.executions == depth]
    # (a weight gradient may be reduced transposed: dense writes it [d_out, d_in])
    assert {tuple(sorted(s)) for s in layer_shapes} <= {
        tuple(sorted(s[-2:])) for c in scattered for s in c.shapes if len(s) >= 2
    }
    # ... and no gathered weight is stashed between the two: what the forward returns
    # beside its output and is whole over fsdp is vectors only (norm scales, biases).
    compiled = rec.compiled[(key, "fwd")]
    outs = zip(
        jax.tree.leaves(compiled.out_info), jax.tree.leaves(compiled.output_shardings), strict=True
    )
    whole = [o.shape for o, s in outs if FSDP_AXIS not in jax.tree.leaves(tuple(s.spec))]
    assert whole and all(np.prod(s) <= depth * 2 * 64 for s in whole), whole


def _over_fsdp(ex, rec: Recorder, key, program: str, kind: str) -> list:
    """The collectives of ``kind`` over the fsdp axis alone in stage ``key``'s compiled
    ``program`` (with their loop executions)."""
    mesh = ex.programs[key].mesh
    return [
        c
        for c in collectives(rec.compiled[(key, program)].as_text(), mesh.size)
        if c.kind == kind and varied_axes(c, mesh) == {FSDP_AXIS}
    ]


def _gathered_shard(a: jax.Array) -> tuple[int, ...]:
    """``a``'s shape per device once gathered over fsdp (still split over tp)."""
    whole = jax.sharding.NamedSharding(a.sharding.mesh, gathered_spec(a.sharding.spec))
    return whole.shard_shape(a.shape)


def test_cost_model_counts_the_collectives_xla_cpu_runs(run_a):
    """On XLA:CPU the engine gathers each parameter array on its own (chained, see
    :mod:`hetjax.runtime.fsdp`), and the cost model prices what runs
    (:func:`hetjax.plan.stage.fsdp_calls`): per stage and pass, the all-gathers and the
    gradient reduce-scatters (XLA:CPU: all-reduces, combined per layer) over fsdp, loop
    executions counted, are the model's counts (a loss stage's backward program runs
    its forward too)."""
    from hetjax.plan import get_profile, parts
    from hetjax.plan.stage import fsdp_calls

    ex, rec = run_a
    cfg = get_preset("tiny")
    shapes = {"vision": parts.encoder_shape(cfg), "llm": parts.llm_shape(cfg, cfg.seq_len)}

    def over_fsdp(key, program: str, kind: str = "all-gather") -> int:
        return sum(c.executions for c in _over_fsdp(ex, rec, key, program, kind))

    for key in ex.programs:  # one stage per module (pp=1): first and last
        shape = shapes[key[0]]
        fwd, bwd, scatters = fsdp_calls(shape, shape.depth, True, True, get_profile("cpu"))
        if (key, "fwd") in rec.compiled:
            assert over_fsdp(key, "fwd") == fwd, key
            assert over_fsdp(key, "bwd") == bwd, key
        else:  # the loss stage
            assert over_fsdp(key, "bwd") == fwd + bwd, key
        assert over_fsdp(key, "bwd", "all-reduce") == scatters, key
