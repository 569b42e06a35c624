"""The Llama block's fused projections: q/k/v as one matmul, gate|up as one.

Asserted on the compiled CPU programs (what XLA runs, not what the model code says):
one block's forward and backward run exactly four projection matmuls each way (q/k/v,
attention out, gate|up, down), and a tensor-parallel split of the fused kernels keeps
every kv group's q/k/v and every column's gate/up on one rank, so the only collectives
are Megatron's all-reduces of the residual stream. The HF conversion of the fused
leaves is checked against transformers' logits in ``test_hf.py``.
"""

from __future__ import annotations

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import hetjax
from hetjax.inspect import collectives
from hetjax.meshes.rules import param_shardings
from models.config import LLMConfig, get_preset
from models.hf.rules import Rule, hf_shapes, read_leaf, to_hf
from models.layers import DecoderBlock
from models.llm import make_llm
from models.mllm import MLLM

# Widths chosen so that a fused projection's (output size, contracted size) signatures
# differ from every other matmul's and from those of separate q, k, v, gate, up.
B, L, D, H, G, F = 1, 8, 48, 4, 2, 40
T, K = B * L, D // H
QKV, GATE_UP = (H + 2 * G) * K, 2 * F


@pytest.fixture(scope="module")
def block():
    llm = make_llm(LLMConfig(vocab=64, width=D, depth=1, heads=H, kv_heads=G, mlp=F), {})
    params = llm.init(jax.random.key(0))["blocks"]
    h = jax.random.normal(jax.random.key(1), (B, L, D))

    def loss(p, h):
        return jnp.sum(jnp.sin(llm.apply_blocks(p, h)))

    return llm, params, h, jax.jit(jax.value_and_grad(loss))


_DEF = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*[a-z0-9]+\[([0-9,]*)\]")


def matmul_signatures(hlo: str) -> Counter:
    """(output elements, contracted size) -> count, for the dots without batch dims
    (attention's are batched over heads), whatever 2-D form XLA gave them."""
    shapes = {
        m.group(1): [int(x) for x in m.group(2).split(",") if x]
        for m in map(_DEF.match, hlo.splitlines())
        if m
    }
    out: Counter = Counter()
    for line in hlo.splitlines():
        if " dot(" not in line or "batch_dims" in line:
            continue
        lhs = shapes[re.search(r"dot\(%([\w.\-]+)", line).group(1)]
        dims = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", line).group(1).split(",")
        out_shape = shapes[_DEF.match(line).group(1)]
        out[(int(np.prod(out_shape)), int(np.prod([lhs[int(i)] for i in dims])))] += 1
    return out


def test_block_runs_one_qkv_and_one_gate_up_matmul(block):
    _, params, h, step = block
    got = matmul_signatures(step.lower(params, h).compile().as_text())
    projections = {"qkv": (D, QKV), "o": (D, D), "gate_up": (D, GATE_UP), "down": (F, D)}
    want: Counter = Counter()
    for d_in, d_out in projections.values():
        want[(T * d_out, d_in)] += 1  # forward
        want[(T * d_in, d_out)] += 1  # input gradient
        want[(d_in * d_out, T)] += 1  # weight gradient
    assert got == want  # separate q, k, v (or gate, up) would add 3 x 3 (3 x 1) matmuls


def test_tp_split_keeps_kv_groups_and_mlp_columns_whole(block):
    llm, params, h, step = block
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    shardings = param_shardings(llm.logical_axes()["blocks"], mesh)
    assert shardings["qkv"]["kernel"].spec == P(None, None, "tp", None, None)  # [S, D, G, ..]
    assert shardings["gate_up"]["kernel"].spec == P(None, None, None, "tp")  # [S, D, 2, F]
    placed = jax.device_put(params, shardings)
    h_rep = jax.device_put(h, NamedSharding(mesh, P()))
    found = collectives(step.lower(placed, h_rep).compile().as_text(), 2)
    # forward: after attention out and down; backward: the input gradients of qkv, gate_up
    assert [(c.kind, c.shapes) for c in found] == [("all-reduce", ((B, L, D),))] * 4
    (loss, grads), (loss_ref, grads_ref) = step(placed, h_rep), step(params, h)
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _fused(kind: str, tensors: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """HF ``tensors`` -> the fused leaf of ``shape``, through the loader's rule."""
    rule = Rule(kind, tuple(str(i) for i in range(len(tensors))))
    assert hf_shapes(rule, shape) == [t.shape for t in tensors]
    leaf = read_leaf(rule, lambda name, idx: tensors[int(name)][idx], shape, 3)
    out = leaf(tuple(slice(0, n) for n in shape))  # the slices LazyTensor passes
    for a, b in zip(to_hf(rule, out, 3), tensors, strict=True):
        np.testing.assert_array_equal(a, b)  # and back
    return out


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 1), (4, 4), (8, 2)])
def test_hf_fused_leaves_round_trip(heads, kv_heads):
    """HF q/k/v and gate/up -> fused leaves -> HF is the identity (MQA, MHA, GQA), and
    query head ``g * R + r`` lands in kv group ``g`` (transformers' ``repeat_kv``)."""
    rng, d, k, f, r = np.random.default_rng(0), 16, 4, 12, heads // kv_heads
    q, kk, v = (rng.normal(size=(n * k, d)) for n in (heads, kv_heads, kv_heads))
    qkv = _fused("gqa", [q, kk, v], (d, kv_heads, r + 2, k))
    last = kv_heads - 1
    np.testing.assert_array_equal(qkv[:, last, r - 1], q[(heads - 1) * k :].T)
    np.testing.assert_array_equal(qkv[:, last, r], kk[last * k :].T)
    np.testing.assert_array_equal(qkv[:, last, r + 1], v[last * k :].T)
    gate, up = rng.normal(size=(f, d)), rng.normal(size=(f, d))
    gate_up = _fused("stack", [gate, up], (d, 2, f))
    np.testing.assert_array_equal(gate_up, np.stack([gate.T, up.T], axis=1))


def test_heads_not_a_multiple_of_kv_heads_is_one_line():
    with pytest.raises(ValueError, match=r"heads=6 is not a multiple of kv_heads=4"):
        DecoderBlock(24, 6, 4, 8, rope_theta=1e4, eps=1e-5, rngs=None, dtype=jnp.float32)


def test_a_checkpoint_with_separate_projections_is_one_line(tmp_path):
    """Checkpoints written before the fusion (q, k, v, gate, up leaves) are refused in
    one line naming an old leaf, not converted: train from an HF export instead."""
    from hetjax import checkpoint
    from hetjax.checkpoint import CheckpointError

    model = MLLM(get_preset("tiny"))
    params = model.init(jax.random.key(0))
    blocks = dict(params["llm"]["blocks"])
    qkv, gate_up = blocks.pop("qkv")["kernel"], blocks.pop("gate_up")["kernel"]
    r = qkv.shape[3] - 2
    blocks["q"] = {"kernel": qkv[:, :, :, :r].reshape(*qkv.shape[:2], -1)}
    blocks["k"] = {"kernel": qkv[:, :, :, r].reshape(*qkv.shape[:2], -1)}
    blocks["v"] = {"kernel": qkv[:, :, :, r + 1].reshape(*qkv.shape[:2], -1)}
    blocks["gate"], blocks["up"] = {"kernel": gate_up[:, :, 0]}, {"kernel": gate_up[:, :, 1]}
    old = {**params, "llm": {**params["llm"], "blocks": blocks}}

    def trainer(p):
        tx = hetjax.make_optimizer(hetjax.AdamWConfig(total_steps=10))
        return hetjax.ReferenceTrainer(model.loss_sum, p, tx, devices=jax.devices()[:1])

    checkpoint.save(tmp_path / "old", trainer(old), 1)
    with pytest.raises(
        CheckpointError,
        match=r"another model: its parameter llm/blocks/gate/kernel \(4, 64, 128\) is",
    ) as e:
        checkpoint.restore(tmp_path / "old", trainer(params))
    assert "\n" not in str(e.value)
