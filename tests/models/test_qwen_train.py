"""Qwen2.5-VL trains under the heterogeneous executor to the single-device numbers.

One reference run (two steps of ``qwen2.5-vl-tiny`` on synthetic batches that mix image
sizes, two images per sample, text-only samples and a 4-frame video, with the trainer's
patch and loss budgets) is shared by every layout: colocated with the tower tensor
parallel, non-colocated with the tower pipelined over its periods (its per-block
positions and window/frame ids on every stage), the LLM with cp=2 (the merged
tokens routed to the cp rank of their placeholders, the mRoPE positions split with the
tokens), the tower with cp=2 (its patches split over cp, window and frame attention a
non-causal segment-masked ring), the homogeneous baseline with cp=2, and the pipelined
tower's rows dealt over its ranks by real patches (``rebalance``, the rows' positions and
window/frame ids moving with them on both stages). Then the entry point's own run and its
one-line errors.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import hetjax.config as hc
from experiments import llava_train
from experiments.cli import ConfigError
from models.config import get_preset
from models.qwen import grids
from models.qwen.data import QwenSyntheticConfig, SyntheticQwen, patchify
from models.qwen.model import QwenVL
from models.qwen.task import QwenTask
from tests.runtime.parity import case, check_matches_reference, reference_run

STEPS, BATCH, SEQ, SEED = 2, 8, 48, 3


@pytest.fixture(scope="module")
def qwen_reference():
    cfg = get_preset("qwen2.5-vl-tiny")
    data = SyntheticQwen(QwenSyntheticConfig(cfg.vision, SEQ, cfg.image_token_id, 64, seed=SEED))
    batches = [data.batch(s, BATCH) for s in range(STEPS)]
    for b in batches:  # the mix this test is about, in every step
        runs = (b["tokens"] == cfg.image_token_id).sum(1)
        frames = b["frame_ids"].max(1) + 1
        assert 0 in runs and (frames >= 2).any() and len(set(runs.tolist())) >= 3, runs
    model = QwenVL(cfg, loss_tokens_per_row=data.config.max_supervised_tokens())
    return reference_run(model, batches)


@pytest.mark.parametrize(
    "c",
    [
        case(
            "qwen2.5-vl-tiny",
            "colocated",
            2,
            id="colocated",
            vision="dp=4,tp=2",
            llm="dp=2,tp=2,pp=2",
        ),
        case(
            "qwen2.5-vl-tiny",
            "non-colocated",
            2,
            id="islands-vision-pp2",
            vision="dp=2,pp=2",
            llm="dp=2,tp=2",
        ),
        case("qwen2.5-vl-tiny", "colocated", 1, id="llm-cp2", vision="dp=8", llm="dp=2,cp=2,tp=2"),
        # the tower's patches split over cp: its windows' and frames' keys come round the ring
        case(
            "qwen2.5-vl-tiny",
            "colocated",
            2,
            id="vision-cp2",
            vision="dp=2,cp=2,tp=2",
            llm="dp=4,tp=2",
        ),
        # the baseline: the tower inherits the LLM's first stage, cp included
        case(
            "qwen2.5-vl-tiny",
            "homogeneous",
            2,
            id="homogeneous-cp2",
            vision="dp=2,cp=2,tp=2",
            llm="dp=2,cp=2,tp=2",
        ),
        # rows dealt to the tower's 2 ranks by real patches (2 rows each per microbatch),
        # their positions and window/frame ids with them on both of its stages
        case(
            "qwen2.5-vl-tiny",
            "non-colocated",
            2,
            id="islands-vision-pp2-rebalance",
            rebalance=("vision",),
            vision="dp=2,pp=2",
            llm="dp=2,tp=2",
        ),
        # across islands the tokens cross split over cp, then one all-to-all to their owners
        case(
            "qwen2.5-vl-tiny",
            "non-colocated",
            2,
            id="islands-llm-cp2",
            vision="dp=4",
            llm="dp=1,cp=2,tp=2",
        ),
    ],
)
def test_layouts_match_one_device(c, qwen_reference):
    ex = check_matches_reference(c, qwen_reference)
    # cp: the merged tokens travel routed to their placeholders' ranks (homogeneous: the
    # tower already has the LLM's layout, its tokens arrive whole per cp rank)
    assert bool(ex.plan.routed) == (c.parsed["llm"].cp > 1 and c.mode != "homogeneous")


def test_rebalance_deals_the_towers_rows_by_patches():
    """On the mixed image sizes of the synthetic data, ``rebalance`` weighs a row by its
    real patches (not its images): the busiest of the tower's ranks holds fewer patches
    than in the rows' order, and each row's positions and frame/window ids move with
    its patches."""
    from hetjax import Layout
    from hetjax.runtime.rebalance import Rebalance
    from models.qwen.flops import row_patches

    model = QwenVL(get_preset("qwen2.5-vl-tiny"))
    spec = model.train_graph({"vision": Layout(dp=2), "llm": Layout(dp=2)}).module("vision")
    data = SyntheticQwen(
        QwenSyntheticConfig(model.config.vision, SEQ, model.config.image_token_id, 64, seed=0)
    )
    before = after = 0.0
    for step in range(4):
        batch = data.batch(step, 16)
        patches = row_patches(batch)
        assert len(set(patches.tolist())) >= 4, patches  # mixed sizes, text-only rows
        dealt = Rebalance(spec, batch, 2, 2)
        m = dealt.metrics("vision")
        assert m["imbalance/vision"] <= m["imbalance_without/vision"], m
        before, after = before + m["imbalance_without/vision"], after + m["imbalance/vision"]
        for mb in range(2):
            rows = slice(mb * 8, (mb + 1) * 8)
            moved = {k: dealt.inputs(batch[k][rows], mb) for k in ("patches", "frame_ids")}
            order = dealt.orders[mb]
            np.testing.assert_array_equal(moved["frame_ids"], batch["frame_ids"][rows][order])
            np.testing.assert_array_equal(moved["patches"], batch["patches"][rows][order])
            np.testing.assert_array_equal(row_patches(moved), patches[rows][order])
    assert after < before, (before, after)


def test_entry_point_trains_a_qwen_preset(tmp_path):
    """``llava_train --model qwen2.5-vl-tiny`` runs the Trainer on the synthetic mix; the
    metrics count the real patches and the tower's FLOPs at them."""
    metrics = tmp_path / "m.jsonl"
    argv = ["--model", "qwen2.5-vl-tiny", "--steps", "1", "--global-batch", "8"]
    argv += ["--microbatches", "1", "--seq-len", str(SEQ), "--metrics", str(metrics)]
    argv += ["--layout", "vision:dp=8", "--layout", "llm:dp=4,tp=2"]
    assert llava_train.main(llava_train.parse_args(argv)) == 0
    row = json.loads(metrics.read_text().splitlines()[-1])
    assert 0 < row["patches"] < 8 * 64 and row["patch_fill"] == row["patches"] / (8 * 64)
    assert 0 < row["model_tflops_per_step/vision"] < row["model_tflops_per_step/llm"]
    assert row["patch_imbalance"] > 1 and row["token_imbalance"] >= 1  # 8 ranks, 1 row each
    assert np.isfinite(row["loss"])


def _config(**data) -> hc.TrainConfig:
    return hc.TrainConfig(
        steps=1,
        model=hc.ModelConfig(preset="qwen2.5-vl-tiny", seq_len=SEQ),
        data=hc.DataConfig(global_batch=8, **data),
        parallel=hc.ParallelConfig(microbatches=2),
    )


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"max_patches_per_microbatch": 64},
            r"^max_patches_per_microbatch=64 is 16 patches per row of a 4-row microbatch, "
            r"but synthetic samples have up to 64; use max_patches_per_microbatch=256$",
        ),
        (
            {"max_patches_per_microbatch": 264},
            r"^max_patches_per_microbatch=264 is 66 patches per row, not a multiple of the 4 "
            r"patches the merger joins into one token; use max_patches_per_microbatch=272$",
        ),
        (
            {"max_patches_per_microbatch": 257},
            r"^max_patches_per_microbatch=257 does not split over a microbatch's 4 rows",
        ),
    ],
)
def test_bad_patch_budget_is_one_line(data, message):
    with pytest.raises(ValueError, match=message):
        QwenTask(_config(**data))


def test_patch_budget_from_the_flag():
    task = QwenTask(_config(max_patches_per_microbatch=320))
    assert task.dataset.config.patches_per_row == 80
    assert task.summary()["patches"].endswith("--max-patches-per-microbatch")
    assert task.dataset.batch(0, 8)["patches"].shape[1] == 80


def test_bad_settings_are_one_line():
    with pytest.raises(
        ValueError,
        match=r"^vision: cp=3 must divide a row's 64 patches .*"
        r"use max_patches_per_microbatch=288$",
    ):
        QwenTask(_config()).validate_layouts(
            {"vision": hc_layout("cp=3"), "llm": hc_layout("dp=2")}
        )
    with pytest.raises(ValueError, match=r"^vision: pp=4 must divide the tower's 2 scanned"):
        QwenTask(_config()).validate_layouts({"vision": hc_layout("pp=4")})
    with pytest.raises(ValueError, match=r"^seq_len=16 is too short: synthetic Qwen samples"):
        QwenTask(
            hc.TrainConfig(steps=1, model=hc.ModelConfig(preset="qwen2.5-vl-tiny", seq_len=16))
        )
    with pytest.raises(
        ConfigError, match=r"^--max-patches-per-microbatch 8 is 1 patches per row of a 8-row"
    ):
        llava_train.main(
            llava_train.parse_args(
                ["--model", "qwen2.5-vl-tiny", "--max-patches-per-microbatch", "8"]
            )
        )


def hc_layout(text: str):
    from hetjax import Layout

    return Layout.parse(text)


@pytest.mark.parametrize("frames", [1, 3, 4])
def test_patchify_follows_the_patch_layout(frames):
    """Patch ``i`` of :func:`patchify` holds the pixels at :func:`grids.patch_layout`'s
    position ``i`` (the layout the golden logits checked), each patch ``(C, T, P, P)``
    as the processor flattens it; the last frame repeats to fill a temporal patch."""
    v = get_preset("qwen2.5-vl-tiny").vision
    t, y, x, c = np.meshgrid(
        np.arange(frames), np.arange(56), np.arange(84), np.arange(3), indexing="ij"
    )
    pixels = (c * 1e6 + t * 1e4 + y * 100 + x).astype(np.float32)
    patches, grid = patchify(v, pixels)
    assert grid == (-(-frames // 2), 4, 6) and patches.shape == (np.prod(grid), v.patch_dim)
    lay = grids.patch_layout(v, grid)
    p, tp = v.patch, v.temporal_patch
    filled = np.concatenate([pixels, np.repeat(pixels[-1:], -frames % tp, axis=0)])
    for i in range(len(patches)):
        (row, col), f = lay["positions"][i], lay["frames"][i]
        want = filled[f * tp : (f + 1) * tp, row * p : (row + 1) * p, col * p : (col + 1) * p]
        np.testing.assert_array_equal(patches[i].reshape(3, tp, p, p), want.transpose(3, 0, 1, 2))


def test_tower_flops_are_the_compiled_count(qwen_reference):
    """The tower's and merger's executed FLOPs (:mod:`models.qwen.flops`) are what XLA
    compiles on the plain path (CPU, float32), 3x for forward and two gradients: every
    weight matmul per patch of the budget, each row's whole square per layer; the real
    count is below it (padding and pairs across windows / frames are not needed)."""
    import jax
    import jax.numpy as jnp

    from hetjax.inspect.hlo import matmul_flops
    from models.qwen import flops as qwen_flops

    model, params = qwen_reference.model, qwen_reference.params
    batch = {k: v[:2] for k, v in qwen_reference.batches[0].items()}
    ids = {k: batch[k] for k in ("vision_positions", "frame_ids", "window_ids")}

    def loss(p, patches):
        return jnp.sum(model.encode(p, {**ids, "patches": patches})["image"] ** 2)

    tower = {k: params[k] for k in ("vision", "projector")}
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    text = grad.lower(tower, batch["patches"]).compile().as_text()
    counts = qwen_flops.vision_counts(batch)
    sizes = (model.config, counts, 2, SEQ, 0)
    executed = qwen_flops.forward_flops(*sizes, executed=True)
    assert matmul_flops(text) == 3 * (executed["vision"] + executed["projector"])
    real = qwen_flops.forward_flops(*sizes)
    assert 0 < real["vision"] < executed["vision"] and counts.patches < counts.budget
