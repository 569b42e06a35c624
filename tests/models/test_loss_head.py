"""The LM head on supervised positions only (``LMHeadLoss(capacity=...)``).

The head gathers each row's supervised positions up to a static per-row budget and
computes the norm, the ``[C, V]`` logits and the float32 log-softmax there only. Checked:
the loss and its gradients (head parameters and the input activations) equal the
whole-row computation in FP32, on one device and inside a stage's parallel context (the
sequence stored zigzag and split over cp, the vocabulary over tp, with and without
sequence parallelism); the compiled head's matmuls scale with the budget, not the row;
a row over the budget is NaN on the device and one line on the host.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hetjax.inspect.hlo import matmul_flops
from hetjax.meshes import BATCH_AXES, STAGE_AXES, zigzag_permutation
from hetjax.ops.context import parallel_context
from models.config import get_preset
from models.data import SyntheticConfig, SyntheticLlava
from models.llm import LMHeadLoss
from models.mllm import MLLM

ROWS, CP = 4, 2
PRESET = get_preset("tiny")
SEQ = PRESET.seq_len  # 64: blocks of 32 under cp = 2


@pytest.fixture(scope="module")
def head():
    """Head parameters, one graph per budget, and a batch of synthetic loss masks."""
    data = SyntheticLlava(SyntheticConfig.for_model(PRESET, seq_len=SEQ, seed=7))
    batch = data.batch(0, ROWS)
    cap = data.config.max_supervised_tokens()  # 21 < 32
    graphs = {}
    for c in (None, cap):
        graphs[c], params = nnx.split(
            LMHeadLoss(PRESET.llm, rngs=nnx.Rngs(3), dtype=jnp.float32, capacity=c), nnx.Param
        )
    rng = np.random.default_rng(0)
    h = rng.normal(size=(ROWS, SEQ, PRESET.llm.width)).astype(np.float32)
    return graphs, params, cap, (h, batch["targets"], batch["loss_mask"])


def _loss_and_grads(graph, params, inputs, *, mesh=None, sp=False):
    """Loss and its gradients (parameters, ``h``) of one head, jitted; under ``mesh`` in a
    stage's parallel context with the inputs stored zigzag and split as a stage's are."""

    def f(params, h, targets, mask):
        with parallel_context(mesh, batch_axes=BATCH_AXES, sequence_parallel=sp):
            return nnx.merge(graph, params)(h, targets, mask)

    if mesh is None:
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(params, *inputs)
    perm = zigzag_permutation(SEQ, CP)
    seq = ("cp", "tp") if sp else "cp"
    h, targets, mask = (
        jax.device_put(x[:, perm], NamedSharding(mesh, P(BATCH_AXES, seq if x.ndim == 3 else "cp")))
        for x in inputs
    )
    loss, (gp, gh) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(params, h, targets, mask)
    gh_original = np.empty_like(np.asarray(gh))
    gh_original[:, perm] = np.asarray(gh)
    return loss, (gp, gh_original)


def _assert_close(got, want):
    loss, grads = got
    np.testing.assert_allclose(float(loss), float(want[0]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want[1]), strict=True):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6 * np.abs(b).max())


@pytest.mark.parametrize("layout", ["one-device", "dp2-cp2-tp2", "dp2-cp2-tp2-sp"])
def test_gathered_head_matches_the_whole_row(head, layout):
    graphs, params, cap, inputs = head
    want = _loss_and_grads(graphs[None], params, inputs)
    if layout == "one-device":
        got = _loss_and_grads(graphs[cap], params, inputs)
    else:
        mesh = Mesh(np.asarray(jax.devices()).reshape(2, 1, 1, CP, 2), STAGE_AXES)
        got = _loss_and_grads(graphs[cap], params, inputs, mesh=mesh, sp=layout.endswith("sp"))
    _assert_close(got, want)
    # Unsupervised positions get exactly no gradient, as in the whole-row head.
    unsupervised = np.asarray(inputs[2]) == 0
    assert not np.any(np.asarray(got[1][1])[unsupervised])


def test_head_matmuls_scale_with_the_budget_not_the_row(head):
    """The compiled forward + backward of the head: three matmuls (logits, d h, d W) over
    ``rows x budget`` positions, and no float32 ``[rows, L, vocab]`` anywhere."""
    graphs, params, cap, inputs = head
    d, v = PRESET.llm.width, PRESET.llm.vocab

    def hlo(graph):
        f = jax.value_and_grad(lambda p, *x: nnx.merge(graph, p)(*x), argnums=(0, 1))
        return jax.jit(f).lower(params, *inputs).compile().as_text()

    dense, gathered = hlo(graphs[None]), hlo(graphs[cap])
    assert matmul_flops(dense) == 3 * 2 * ROWS * SEQ * d * v
    assert matmul_flops(gathered) == 3 * 2 * ROWS * cap * d * v
    # What executed FLOPs count (MLLM.head_positions): the budget, per cp block.
    model = MLLM(PRESET, loss_tokens_per_row=cap)
    assert model.head_positions(SEQ) == cap and model.head_positions(SEQ, CP) == CP * cap
    assert MLLM(PRESET, loss_tokens_per_row=SEQ // 2).head_positions(SEQ, CP) == SEQ
    assert MLLM(PRESET).head_positions(SEQ) == SEQ
    assert f"f32[{ROWS},{SEQ},{v}]" in dense
    assert f"f32[{ROWS},{SEQ},{v}]" not in gathered


def test_a_row_over_the_budget_is_nan_on_device_and_one_line_on_host(head):
    graphs, params, cap, (h, targets, mask) = head
    over = np.asarray(mask).copy()
    over[2] = 0.0
    over[2, 1 : cap + 2] = 1.0  # row 2: one supervised token more than the budget
    got = _loss_and_grads(graphs[cap], params, (h, targets, over))
    assert np.isnan(float(got[0]))  # never a silently smaller sum
    model = MLLM(PRESET, loss_tokens_per_row=cap)
    model.check_loss_budget({"loss_mask": mask})  # within the budget: passes
    with pytest.raises(
        ValueError, match=rf"row 2 .* {cap + 1} supervised tokens .* {cap} per"
    ) as e:
        model.check_loss_budget({"loss_mask": over})
    assert "data.max_loss_tokens_per_microbatch" in str(e.value) and "\n" not in str(e.value)
