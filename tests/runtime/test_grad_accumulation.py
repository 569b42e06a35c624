"""Gradient accumulation, read from the stage programs XLA compiles (CPU).

A small bf16 LLM (odd widths, so a gradient's shape is no activation's) trains on one
2-device data-parallel stage with one and with two microbatches per step:

- one microbatch: no accumulator program runs, and the backward has no add of a
  gradient-sized array: it writes the step's gradients directly;
- two: the accumulator is zero-filled once per step and every backward adds into it in
  float32, in place (donated: its buffers are the outputs'); the weight-gradient matmuls
  write float32 themselves (no bf16 result converted before the add:
  ``hetjax.ops.dense``);
- both train (the loss falls on a repeated batch).

What is not asserted, because it stays: ``lax.scan`` zero-initialises the stacked
outputs its backward writes layer by layer (JAX's lowering of a scan's outputs), and the
embedding's gradient is a scatter-add into zeros.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hetjax
from hetjax import Layout
from hetjax.inspect import Recorder
from models.config import TOKENIZER_VOCAB, LLMConfig, MLLMConfig
from models.data import SyntheticConfig, SyntheticLlava
from models.mllm import MLLM

CONFIG = MLLMConfig(
    "odd",
    llm=LLMConfig(vocab=TOKENIZER_VOCAB, width=48, depth=3, heads=4, kv_heads=2, mlp=80),
    seq_len=40,
)
STAGE = ("llm", 0)
STEPS = 3
GLOBAL_BATCH = 4

# One HLO instruction: element type, shape, opcode (``ROOT %x = f32[1,3,80,48]{...} add(``).
_HLO = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*([a-z][a-z0-9]*)\[([0-9,]*)\]\S*\s+([\w\-]+)\(")
# StableHLO: a dot_general's result, a convert's operand and result types.
_DOT = re.compile(r"stablehlo\.dot_general.*->\s*tensor<([0-9x]+)x([a-z0-9]+)>")
_CONVERT = re.compile(
    r"stablehlo\.convert.*:\s*\(tensor<([0-9x]+)x(bf16)>\)\s*->\s*tensor<[0-9x]+xf32>"
)


class BackwardArgs:
    """Observer: the argument types of the stage's first backward call (to lower it again)."""

    def __init__(self):
        self.args = None

    def on_dispatch(self, event):
        if event.stage == STAGE and event.program == "bwd" and self.args is None:

            def sds(a):  # the normalizer is uncommitted: jit places it
                sharding = a.sharding if a.committed else None
                return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

            self.args = jax.tree.map(sds, event.inputs)


@pytest.fixture(scope="module", params=[1, 2], ids=["mb1", "mb2"])
def run(request):
    """(executor, recorder, backward argument types, losses) of STEPS steps on one batch."""
    model = MLLM(CONFIG, dtype=jnp.bfloat16)
    data = SyntheticLlava(SyntheticConfig.for_model(CONFIG, seq_len=CONFIG.seq_len, seed=0))
    plan = hetjax.plan_run(
        model.train_graph({"llm": Layout.parse("dp=2", module="llm")}),
        num_devices=2,
        mode="non-colocated",
        islands={"llm": 2},
        microbatches=request.param,
    )
    rec, args = Recorder(), BackwardArgs()
    ex = hetjax.Executor(
        plan,
        model.init(jax.random.key(0)),
        devices=jax.devices()[:2],
        optimizer=hetjax.AdamWConfig(warmup_steps=0),
        observers=[rec, args],
    )
    batch = data.batch(0, GLOBAL_BATCH)
    losses = [float(ex.step(batch)["loss"]) for _ in range(STEPS)]
    return ex, rec, args.args, losses


def gradient_shapes(compiled) -> set[tuple[int, ...]]:
    """Per-device shapes of the backward's gradient outputs (its first result)."""
    return {tuple(a.sharding.shard_shape(a.shape)) for a in jax.tree.leaves(compiled.out_info[0])}


def hlo_ops(text: str, opcode: str) -> list[tuple[str, tuple[int, ...]]]:
    """(element type, shape) of every ``opcode`` instruction, fusion bodies included."""
    out = []
    for line in text.splitlines():
        if (m := _HLO.match(line)) and m.group(3) == opcode:
            out.append((m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)))
    return out


def kernel_shapes() -> set[tuple[int, ...]]:
    """Per-layer shapes of the Dense kernels, as written ([d_in, *d_out]) and as a
    weight-gradient matmul's result ([*d_out, d_in])."""
    params = jax.eval_shape(lambda: MLLM(CONFIG).init(jax.random.key(0)))
    shapes = set()
    for path, a in jax.tree.leaves_with_path(params):
        if "kernel" in jax.tree_util.keystr(path):
            k = a.shape[1:] if "blocks" in jax.tree_util.keystr(path) else a.shape
            shapes |= {k, k[1:] + k[:1]}
    return shapes


def ends_with_any(dims: str, shapes: set[tuple[int, ...]]) -> bool:
    d = tuple(int(x) for x in dims.split("x"))
    return any(d[-len(s) :] == s for s in shapes)


def test_training_falls_in_bf16(run):
    *_, losses = run
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.05, losses


def test_accumulator_only_with_several_microbatches(run):
    ex, rec, _, _ = run
    bwd = rec.compiled[(STAGE, "bwd")]
    grads = gradient_shapes(bwd)
    assert {a.dtype for a in jax.tree.leaves(bwd.out_info[0])} == {jnp.dtype(jnp.float32)}
    adds = {shape: dtype for dtype, shape in hlo_ops(bwd.as_text(), "add") if shape in grads}
    # outputs written into a donated input's buffer: the accumulator, updated in place
    aliased = bwd.as_text().splitlines()[0].count("may-alias")
    if ex.microbatches == 1:
        # The backward's gradients are the step's: no accumulator made, none added to.
        assert (STAGE, "zeros") not in rec.calls and (STAGE, "zeros") not in rec.compiles
        assert adds == {} and aliased == 0, adds
    else:
        assert rec.calls[(STAGE, "zeros")] == STEPS
        assert rec.calls[(STAGE, "bwd")] == STEPS * ex.microbatches
        # Every gradient is added into its accumulator, in float32 (the embedding
        # table's add XLA may fold into its scatter-add: into the accumulator, not zeros).
        assert set(adds.values()) == {"f32"}, adds
        assert grads - set(adds) <= {(1, TOKENIZER_VOCAB, 48)}, adds
        assert aliased == len(jax.tree.leaves(bwd.out_info[0]))


def test_weight_gradient_matmuls_write_float32(run):
    ex, _, args, _ = run
    text = ex.programs[STAGE].bwd.lower(*args).as_text()  # StableHLO, before XLA's passes
    kernels = kernel_shapes()
    wgrad = [t for dims, t in _DOT.findall(text) if ends_with_any(dims, kernels)]
    # the forward (run inside the loss stage's backward) has activation dots only
    assert wgrad and set(wgrad) == {"f32"}, wgrad
    converted = [dims for dims, _ in _CONVERT.findall(text) if ends_with_any(dims, kernels)]
    assert converted == [], converted  # no bf16 weight gradient widened afterwards
