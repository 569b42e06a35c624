"""Samples per packed row (``--max-samples-per-row``): the static bound cuDNN's packed
attention layout is built for. Derived from the data (or the flag), held by every row
the loader builds (a row closes at it), checked on every batch (one line), and passed
down to every LLM block: the bf16 model lowered for CUDA runs the packed kernel with
``max_seg_per_batch`` = the bound and no bias, and in float32 the fused call's XLA twin
gives the plain path's loss and gradients on the loader's packed rows."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hetjax.config as hc
from hetjax.ops import fused_attention, ring_kernels
from models.config import get_preset
from models.llava import run as llava_run
from models.llava.rows import Packer, attention_segments
from models.llava.task import LlavaBatches, LlavaTask
from models.mllm import MLLM
from tests.models.test_llava_budget import BATCH, SEQ_LEN, _build
from tests.models.test_loss_budget import _batches
from tests.ops.test_fused_attention import (
    BIAS_BWD,
    BIAS_FWD,
    BWD,
    FWD,
    cudnn_calls,
    cudnn_calls_in,
    fake_gpu,
)
from tests.ops.test_ring_attention import packed_rows
from tests.test_config import one_line

__all__ = ["fake_gpu"]  # a fixture the lowering test uses


def _runs(segment_ids_BxL: np.ndarray) -> np.ndarray:
    """Runs of equal segment ids per row: what the packed layout counts."""
    return 1 + np.count_nonzero(segment_ids_BxL[:, 1:] != segment_ids_BxL[:, :-1], axis=1)


@pytest.fixture(scope="module")
def derived(llava_dir):
    """A packed run's data with the default bound, and three of its batches."""
    data = _build(llava_dir, pack=True)
    return data, [b.arrays for b in _batches(data)]


# -- the data side ----------------------------------------------------------------------


def test_packer_closes_a_row_at_its_samples():
    class S:  # n tokens, no supervision, no image
        def __init__(self, n):
            self.ids, self.supervised = np.arange(n, dtype=np.int32), np.zeros(n, np.float32)
            self.images = []

    p = Packer(2, capacity=20, slots=1, pack=True, samples=2)
    assert p.add(S(3)) and p.add(S(3))  # row 0 holds two samples: closed
    assert p.add(S(3))  # row 1, though row 0 has the room
    assert [u[3] for u in p.used] == [2, 1]
    seg = p.arrays(pad_id=0, shape=None)[0]["segment_ids"]
    np.testing.assert_array_equal(seg.max(axis=1), [2, 1])
    assert (_runs(seg) <= attention_segments(2)).all()  # the padding is a run of its own
    np.testing.assert_array_equal(_runs(seg), [3, 2])


def test_default_is_derived_from_the_data_and_holds_every_row(derived):
    data, batches = derived
    per_row = data.config.samples_per_row
    c = data.config
    rows = llava_run.rows_lib.packed_rows(
        llava_run.first_samples(data).samples,
        BATCH,
        SEQ_LEN + 1,
        c.images_per_row,
        loss_tokens=c.loss_tokens_per_row,
    )
    assert per_row == max(r[3] for r in rows) > 1  # rows really pack
    assert f"hold at most {per_row} samples" in data.samples_budget
    assert data.samples_budget.startswith(f"{per_row} per row ({per_row + 1} attention segments")
    seg = np.concatenate([b["segment_ids"] for b in batches])
    assert seg.max() <= per_row
    assert _runs(seg).max() <= attention_segments(per_row)


def test_the_flag_wins_and_closes_rows(llava_dir, derived):
    data = _build(llava_dir, pack=True, max_samples_per_row=2)
    assert data.config.samples_per_row == 2
    assert data.samples_budget.endswith(": --max-samples-per-row")
    seg = np.concatenate([b.arrays["segment_ids"] for b in _batches(data)])
    assert seg.max() == 2 < derived[0].config.samples_per_row  # closed early, and reached
    assert _runs(seg).max() <= 3


@pytest.mark.parametrize(
    "data, pattern",
    [
        (
            {"max_samples_per_row": 4},
            r"^data.max_samples_per_row bounds packed rows; give data.pack$",
        ),
        ({"max_samples_per_row": 0}, r"data.max_samples_per_row.*a positive integer"),
    ],
)
def test_bad_setting_is_one_line(data, pattern):
    with pytest.raises(hc.InvalidConfigError) as excinfo:
        hc.from_dict({"data": data})
    one_line(excinfo, pattern)


def test_a_batch_over_the_bound_is_one_line(derived):
    data, batches = derived
    cfg = get_preset("tiny")
    with pytest.raises(ValueError, match="max_segments bounds packed rows; pass packed=True"):
        MLLM(cfg, max_segments=3)
    model = MLLM(cfg, packed=True, max_segments=attention_segments(data.config.samples_per_row))
    for batch in batches:
        model.check_segments(batch)  # the loader's rows hold the bound
    runs = _runs(batches[0]["segment_ids"])
    row = int(np.argmax(runs))
    tight = MLLM(cfg, packed=True, max_segments=int(runs[row]) - 1)
    with pytest.raises(ValueError) as excinfo:
        tight.check_segments(batches[0])
    one_line(
        excinfo,
        rf"^row {row} of the batch has {runs[row]} segments",
        rf"raise data.max_samples_per_row to at least {runs[row] - 1}$",
    )


def test_the_task_builds_its_model_with_the_bound_and_checks_every_batch(llava_dir, derived):
    data, batches = derived
    cfg = hc.TrainConfig(
        model=hc.ModelConfig(seq_len=SEQ_LEN),
        data=hc.DataConfig(
            global_batch=BATCH,
            sources={llava_dir["train"]: 1.0},
            image_folder=llava_dir["images"],
            tokenizer=llava_dir["tokenizer"],
            pack=True,
            max_samples_per_row=3,
        ),
    )
    task = LlavaTask(cfg)
    assert task.mllm.max_segments == 4
    assert task.summary()["samples per row"].startswith("3 per row (4 attention segments")
    source = LlavaBatches(task)
    source.stream = SimpleNamespace(batch=lambda step: batches[step])  # rows of the default
    over = [i for i, b in enumerate(batches) if _runs(b["segment_ids"]).max() > 4]
    assert over  # the default's rows hold more samples than 3
    with pytest.raises(ValueError, match="raise data.max_samples_per_row to at least"):
        source.batch(over[0])


# -- the model side ---------------------------------------------------------------------


@pytest.mark.parametrize("bound", [4, None])
def test_bf16_packed_llm_lowers_to_the_packed_kernel_without_bias(fake_gpu, bound):
    """The bound reaches every block: the packed kernel (q/k/v, lengths and offsets) with
    ``max_seg_per_batch`` = the bound, forward and backward; without one, the bias."""
    cfg = get_preset("tiny")
    model = MLLM(cfg, dtype=jnp.bfloat16, packed=True, max_segments=bound)
    llm = model.modules["llm"]
    blocks = model.init(jax.random.key(0))["llm"]["blocks"]
    seg, pos = (jnp.asarray(x) for x in packed_rows([[20, 30, 10], [64]], cfg.seq_len))
    h = jnp.ones((2, cfg.seq_len, cfg.llm.width), jnp.bfloat16)
    stage = lambda blocks, h, _: llm.apply_blocks(blocks, h, segment_ids=seg, positions=pos)
    calls = cudnn_calls(stage, blocks, h, jnp.zeros(()))
    if bound is None:
        assert sorted(calls) == [(BIAS_FWD, 4, "NO_MASK", 1), (BIAS_BWD, 7, "NO_MASK", 1)]
    else:
        assert sorted(calls) == [(FWD, 7, "PADDING_CAUSAL", 4), (BWD, 10, "PADDING_CAUSAL", 4)]


@pytest.mark.parametrize("replicas", [1, 2])
def test_bf16_packed_llm_lowers_under_the_executors_replica_vmap(fake_gpu, replicas):
    """The executor maps every stage program over its data-parallel replicas
    (``jax.vmap``, :mod:`hetjax.runtime.replicas`), one replica included: the packed
    kernel lowers there too, forward and backward, once for all replicas (the mapped axis
    folded into the batch, :mod:`hetjax.ops.vmap_fold`; JAX's own cuDNN batching rule
    reshapes the packed layout's ``[B, M]`` segment lengths to ``[B]`` and fails)."""
    cfg = get_preset("tiny")
    model = MLLM(cfg, dtype=jnp.bfloat16, packed=True, max_segments=4)
    llm = model.modules["llm"]
    blocks = model.init(jax.random.key(0))["llm"]["blocks"]
    rows = [[20, 30, 10], [64], [8, 8, 48], [40, 24]][: 2 * replicas]
    seg, pos = (jnp.asarray(x).reshape(replicas, 2, -1) for x in packed_rows(rows, cfg.seq_len))
    h = jnp.ones((replicas, 2, cfg.seq_len, cfg.llm.width), jnp.bfloat16)

    def replica(blocks, h, seg, pos):
        stage = lambda b, h: llm.apply_blocks(b, h, segment_ids=seg, positions=pos)
        loss = lambda b, h: jnp.sum(stage(b, h).astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1))(blocks, h)

    program = jax.jit(jax.vmap(replica, in_axes=(None, 0, 0, 0)))
    text = program.trace(blocks, h, seg, pos).lower(lowering_platforms=("cuda",)).as_text()
    want = [(FWD, 7, "PADDING_CAUSAL", 4), (BWD, 10, "PADDING_CAUSAL", 4)]
    assert sorted(cudnn_calls_in(text)) == want  # one each, in the layers' scans


@pytest.fixture
def xla_twin(monkeypatch):
    """Float32 packed rows through the fused path's call, in its XLA twin (the kernel's
    lengths-and-offsets mask): the path a bf16 GPU run takes, in maths the CPU runs."""
    monkeypatch.setattr(ring_kernels, "fused_attention_applies", lambda q, k: True)
    twin = lambda *a, implementation, **kw: fused_attention.packed_fused_attention(
        *a, implementation="xla", **kw
    )
    monkeypatch.setattr(ring_kernels, "packed_fused_attention", twin)


def test_fused_packed_rows_train_like_the_plain_path(derived, tok, xla_twin):
    """On the loader's rows (rows at the bound, trailing padding) the fused call with the
    run's bound gives the plain path's loss and gradients (FP32). One segment fewer only
    merges a full row's trailing padding into its last sample (no supervised output
    changes); two fewer merge two samples, and the loss changes."""
    data, batches = derived
    cfg = dataclasses.replace(get_preset("tiny"), image_token_id=tok.image_id)
    batch = {k: jnp.asarray(v) for k, v in batches[0].items()}
    bound = attention_segments(data.config.samples_per_row)
    assert _runs(batches[0]["segment_ids"]).max() == bound  # reached: the row ends in padding

    def model(max_segments):
        slots = data.config.images_per_row
        return MLLM(cfg, images_per_row=slots, packed=True, max_segments=max_segments)

    params = model(None).init(jax.random.key(0))  # parameters do not depend on the bound
    plain = jax.jit(jax.value_and_grad(model(None).loss_sum))
    want_loss, want_grads = plain(params, batch)
    loss, grads = jax.jit(jax.value_and_grad(model(bound).loss_sum))(params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for (path, g), w in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads), strict=True
    ):
        scale = float(jnp.max(jnp.abs(w)))  # atol: the ring tests' 1e-6 of order-1 gradients
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * scale, err_msg=str(path))
    # The loss of the rows at the bound alone (the others' loss mask zeroed).
    at_bound = _runs(batches[0]["segment_ids"]) == bound
    rows = {**batch, "loss_mask": batch["loss_mask"] * jnp.asarray(at_bound)[:, None]}
    want = float(plain(params, rows)[0])
    merged = {m: float(jax.jit(model(m).loss_sum)(params, rows)) for m in (bound - 1, bound - 2)}
    np.testing.assert_allclose(merged[bound - 1], want, rtol=1e-5)
    assert abs(merged[bound - 2] / want - 1) > 1e-4, (merged, want)  # ten times the rtol
