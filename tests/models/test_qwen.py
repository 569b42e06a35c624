"""Qwen2.5-VL's modules: stage slices compose, host-side layout, the loss, bad input.

Exactness against transformers is ``test_qwen_hf.py``'s; here the ``qwen2.5-vl-tiny``
preset (14 px patches, windows of 2x2 merged units, full attention every 2nd layer).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import config_from_dict, config_to_dict, get_preset
from models.qwen import QwenVL, hf_batch
from models.qwen.grids import pack_row, patch_layout

CFG = get_preset("qwen2.5-vl-tiny")
V = CFG.vision
IMAGE, VIDEO, START, END = CFG.image_token_id, V.video_token_id, V.vision_start_token_id, 263


def run(kind: int, grid) -> list[int]:
    t, h, w = grid
    return [START] + [kind] * (t * h * w // V.merge_unit) + [END]


@pytest.fixture(scope="module")
def setup():
    """Two rows: an image (three windows wide) and a video; a small image, padded."""
    rng = np.random.default_rng(0)
    images, videos = [(1, 4, 12), (1, 2, 2)], [(2, 4, 4)]
    rows = [
        [5] + run(IMAGE, images[0]) + [6, 7] + run(VIDEO, videos[0]) + [8],
        run(IMAGE, images[1]) + [9] * 6,
    ]
    length = max(map(len, rows))
    ids = np.zeros((2, length), np.int64)
    mask = np.zeros((2, length), np.int64)
    for b, row in enumerate(rows):
        ids[b, : len(row)], mask[b, : len(row)] = row, 1
    pixels = lambda grids: rng.normal(size=(sum(np.prod(g) for g in grids), V.patch_dim))  # noqa: E731
    batch = hf_batch(
        CFG,
        ids,
        pixels(images),
        image_grid_thw=images,
        attention_mask=mask,
        pixel_values_videos=pixels(videos),
        video_grid_thw=videos,
        second_per_grid_ts=[1.0],
    )
    model = QwenVL(CFG)
    params = model.init(jax.random.key(0))
    return model, params, jax.tree.map(jnp.asarray, batch), mask


def test_layout_windows_frames_and_positions():
    lay = patch_layout(V, (2, 4, 12))  # per frame 2 x 6 merged units, windows 2 x 2 units
    # 2x2 merge units in raster order, each unit's patches in raster order
    assert lay["positions"][:6].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3]]
    assert np.bincount(lay["frames"]).tolist() == [48, 48]
    assert np.bincount(lay["windows"]).tolist() == [16] * 6  # 3 windows per frame, 2 frames
    row = pack_row(
        V, [(np.zeros((96, V.patch_dim)), (2, 4, 12)), (np.zeros((4, V.patch_dim)), (1, 2, 2))], 104
    )
    assert row["frame_ids"].tolist() == [0] * 48 + [1] * 48 + [2] * 4 + [-1] * 4
    assert row["window_ids"][96:].tolist() == [6] * 4 + [-1] * 4


def test_stage_slices_compose_to_the_whole_model(setup):
    """pre -> blocks [0, 1) -> blocks [1, 2) -> post equals the whole model, per module."""
    model, params, batch, mask = setup
    vision, llm = model.modules["vision"], model.modules["llm"]
    whole = jax.jit(model.logits)(params, batch)

    @jax.jit
    def staged(params, batch):
        vis = model.vision_inputs(batch)
        h = vision.apply_pre(params["vision"]["pre"], batch["patches"])
        for start, stop in ((0, 1), (1, 2)):  # a stage gets only its layers
            layers = jax.tree.map(lambda a, i=start, j=stop: a[i:j], params["vision"]["blocks"])
            h = vision.apply_blocks(layers, h, start=start, stop=stop, **vis)
        tokens = model.modules["projector"](params["projector"], h)
        x = llm.apply_pre(params["llm"]["pre"], batch["tokens"], image=tokens)
        for start, stop in ((0, 3), (3, 4)):
            x = llm.apply_blocks(params["llm"]["blocks"], x, start=start, stop=stop,
                                 **model.block_inputs(batch))  # fmt: skip
        return llm.bind("post", params["llm"]["post"]).logits(x)

    np.testing.assert_array_equal(staged(params, batch), whole)
    assert np.all(np.isfinite(np.asarray(whole)))
    # The vision tower's stacked leaves are periods of layers: 2 periods of 2 here.
    assert params["vision"]["blocks"]["layer1"]["qkv"]["kernel"].shape == (2, 32, 3, 4, 8)


def test_loss_sum_is_the_masked_cross_entropy(setup):
    model, params, batch, mask = setup
    targets = jnp.roll(batch["tokens"], -1, axis=1)
    train = {**batch, "targets": targets, "loss_mask": jnp.asarray(mask)}
    loss = jax.jit(model.loss_sum)(params, train)
    logp = jax.nn.log_softmax(jax.jit(model.logits)(params, batch), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(loss, jnp.sum(nll * mask), rtol=1e-6)
    grads = jax.jit(jax.grad(model.loss_sum))(params, train)
    assert float(jnp.abs(grads["vision"]["pre"]["proj"]["kernel"]).max()) > 0


def test_padding_patches_change_nothing(setup):
    """A longer patch budget (more padding in segment -1) gives the same logits."""
    model, params, batch, mask = setup
    wider = {
        k: jnp.pad(
            v, [(0, 0), (0, 8)] + [(0, 0)] * (v.ndim - 2), constant_values=-1 if "ids" in k else 0
        )
        if k in ("patches", "vision_positions", "frame_ids", "window_ids")
        else v
        for k, v in batch.items()
    }
    np.testing.assert_allclose(
        jax.jit(model.logits)(params, wider), model.logits(params, batch), rtol=1e-6, atol=1e-6
    )


def test_bad_inputs_are_one_line():
    ids = np.array([[START] + [IMAGE] * 3 + [END]])
    grid = [(1, 4, 4)]  # 16 patches -> 4 tokens, the text has 3
    pixels = np.zeros((16, V.patch_dim))
    with pytest.raises(ValueError, match="a run of 3 image tokens at 1 but its grid"):
        hf_batch(CFG, ids, pixels, image_grid_thw=grid)
    with pytest.raises(ValueError, match="grid_thw gives 16 patches"):
        hf_batch(CFG, ids, pixels[:8], image_grid_thw=grid)
    with pytest.raises(ValueError, match="more image runs than the image grids"):
        hf_batch(CFG, np.array([[IMAGE] * 4]), None)
    ok = np.array([[IMAGE] * 4])
    with pytest.raises(ValueError, match="raise the patch budget"):
        hf_batch(CFG, ok, pixels, image_grid_thw=grid, patches_per_row=8)
    with pytest.raises(ValueError, match="no Qwen2.5-VL vision tower"):
        QwenVL(get_preset("llava-1.5-tiny"))


@pytest.mark.parametrize(
    "preset, total",
    [
        ("qwen2.5-vl-7b", 8_292_166_656),  # Qwen2.5-VL-7B-Instruct's parameter count
        ("qwen2.5-vl-3b", 3_754_622_976 + 151936 * 2048),  # 3B's, its tied head untied
    ],
)
def test_presets_have_the_released_parameter_counts(preset, total):
    cfg = get_preset(preset)
    counts = QwenVL(cfg).num_params()  # abstract shapes only
    assert sum(counts.values()) == total
    assert counts["vision"] == cfg.vision.num_params()
    assert counts["projector"] == cfg.vision.merger_params()
    assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg  # metadata
