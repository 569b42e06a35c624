"""Hugging Face Qwen2.5-VL weights in and out, against transformers' own logits.

The fixture in ``golden/qwen2_5_vl`` (a tiny random-weight
``Qwen2_5_VLForConditionalGeneration`` in bfloat16, the names transformers 5 saves, and
its float32 logits on images of different sizes, several per sample, a video and right
padding) comes from ``golden/make_qwen_golden.py``; CI needs neither torch nor
transformers. That transformers loads the export with no missing or unexpected keys and
the golden logits is checked in that environment by ``make_qwen_golden.py --check DIR``
on ``hf.save``'s output; here the export's names, shapes and values are the golden
file's.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from models import hf
from models.qwen import hf_batch

GOLDEN = pathlib.Path(__file__).parent / "golden" / "qwen2_5_vl"
TOL = dict(rtol=1e-4, atol=1e-5)
HF_INPUTS = ("image_grid_thw", "attention_mask", "pixel_values_videos", "video_grid_thw",
             "second_per_grid_ts")  # fmt: skip


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(GOLDEN / "golden.npz"))


@pytest.fixture(scope="module")
def loaded():
    return hf.load(GOLDEN)


def logits(model, params, g):
    return hf.logits(
        model, params, g["input_ids"], g["pixel_values"], **{k: g[k] for k in HF_INPUTS}
    )


def test_import_matches_transformers(loaded, golden):
    model, params = loaded
    v, t = model.config.vision, model.config.llm
    # From config.json, not the defaults: token ids, theta, eps, GQA, the attention pattern.
    assert (model.config.image_token_id, v.video_token_id, v.vision_start_token_id) == (
        120,
        121,
        122,
    )
    assert (t.rope_theta, t.norm_eps, t.kv_heads, v.mrope_section) == (50000.0, 1e-5, 2, (2, 2, 2))
    assert (v.period, v.pattern, v.groups, v.window_units) == (3, (False, False, True), 2, 2)
    valid = golden["attention_mask"].astype(bool)
    batch = hf_batch(model.config, golden["input_ids"], golden["pixel_values"],
                     **{k: golden[k] for k in HF_INPUTS})  # fmt: skip
    # get_rope_index's 3D positions (a video's temporal step 2 x 0.75 s, truncated)
    np.testing.assert_array_equal(
        batch["mrope_positions"][valid], golden["position_ids"].transpose(1, 2, 0)[valid]
    )
    out = logits(model, params, golden)
    assert out.shape == golden["logits"].shape and out.dtype == np.float32
    # Padding's logits are unspecified (transformers' own attention kernels differ there).
    np.testing.assert_allclose(out[valid], golden["logits"][valid], **TOL)


def test_export_writes_the_golden_names_and_reloads_exactly(loaded, tmp_path):
    model, params = loaded
    out = hf.save(model, params, tmp_path / "hf")
    written, stored = load_file(out / "model.safetensors"), load_file(GOLDEN / "model.safetensors")
    assert sorted(written) == sorted(stored)
    for k, v in stored.items():
        np.testing.assert_array_equal(written[k], v.astype(np.float32), err_msg=k)
    cfg, ref = (
        json.loads((out / "config.json").read_text()),
        json.loads((GOLDEN / "config.json").read_text()),
    )
    for key in ("model_type", "image_token_id", "video_token_id", "vision_start_token_id"):
        assert cfg[key] == ref[key]
    for part in ("vision_config", "text_config"):
        for key, value in cfg[part].items():
            if key in ref[part] and key != "max_position_embeddings":
                assert value == ref[part][key], (part, key)
    again, reloaded = hf.load(out)
    assert again.config.vision == model.config.vision and again.config.llm == model.config.llm
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reloaded), strict=True):
        np.testing.assert_array_equal(a, b)


def _copy(src: pathlib.Path, dst: pathlib.Path, rename, *, shards: int = 1, config=None):
    """``src``'s tensors under ``rename``d keys in ``shards`` files with an index."""
    tensors = {rename(k): v for k, v in load_file(src / "model.safetensors").items()}
    tensors = {k: v for k, v in tensors.items() if k is not None}
    names = sorted(tensors)
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config(cfg) if config else cfg))
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in names[s::shards]}, dst / file)
        weight_map.update({k: file for k in names[s::shards]})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_transformers5_module_names_over_shards_lazily(loaded, tmp_path):
    """``model.visual.*`` / ``model.language_model.*`` (transformers 5's module names), in
    two shards; lazy leaves read only the slices asked for."""

    def rename(k):
        if k.startswith("visual."):
            return "model." + k
        return "model.language_model." + k[len("model.") :] if k.startswith("model.") else k

    _copy(GOLDEN, tmp_path / "q", rename, shards=2)
    model, params = loaded
    again, lazy = hf.load(tmp_path / "q", lazy=True)
    qkv = lazy["llm"]["blocks"]["qkv"]["kernel"]  # [layers, D, G, R + 2, K]
    np.testing.assert_array_equal(
        qkv[1:2, :, 1:2], np.asarray(params["llm"]["blocks"]["qkv"]["kernel"])[1:2, :, 1:2]
    )
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(lazy), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_tied_head_is_untied_on_import(loaded, tmp_path):
    """Qwen2.5-VL-3B ties its LM head: no ``lm_head.weight``; the head is the table."""

    def tie(cfg):
        return {**cfg, "tie_word_embeddings": True}

    _copy(GOLDEN, tmp_path / "tied", lambda k: None if k == "lm_head.weight" else k, config=tie)
    _, params = hf.load(tmp_path / "tied")
    np.testing.assert_array_equal(
        params["llm"]["post"]["head"]["kernel"], params["llm"]["pre"]["table"].T
    )


def test_mismatched_checkpoint_is_one_line(tmp_path):
    def deeper(cfg):
        return {**cfg, "vision_config": {**cfg["vision_config"], "intermediate_size": 40}}

    _copy(GOLDEN, tmp_path / "bad", lambda k: k, config=deeper)
    with pytest.raises(hf.HFError, match=r"mlp.gate_proj.weight' has shape \(48, 32\)"):
        hf.load(tmp_path / "bad")
    shutil.rmtree(tmp_path / "bad")

    def windowed(cfg):
        return {**cfg, "text_config": {**cfg["text_config"], "use_sliding_window": True}}

    _copy(GOLDEN, tmp_path / "bad", lambda k: k, config=windowed)
    with pytest.raises(hf.HFError, match="use_sliding_window"):
        hf.load(tmp_path / "bad")
