"""Hugging Face LLaVA weights in and out, against transformers' own logits.

The fixtures in ``golden/`` (tiny random-weight LLaVA checkpoints with CLIP and SigLIP
towers, float16 weights, and transformers' float32 logits) come from
``golden/make_llava_golden.py``; CI needs neither torch nor transformers.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from models import hf
from models.config import get_preset
from models.hf.files import Files
from models.mllm import MLLM

GOLDEN = pathlib.Path(__file__).parent / "golden"
TOL = dict(rtol=1e-4, atol=1e-5)


def golden(tower: str) -> dict[str, np.ndarray]:
    return dict(np.load(GOLDEN / f"llava_{tower}" / "golden.npz"))


def check_logits(model, params, tower: str) -> None:
    g = golden(tower)
    out = hf.logits(model, params, g["input_ids"], g["pixel_values"])
    np.testing.assert_allclose(out, g["logits"], **TOL)


@pytest.mark.parametrize("tower", ["clip", "siglip"])
def test_import_matches_transformers(tower):
    model, params = hf.load(GOLDEN / f"llava_{tower}")
    assert model.config.vision.kind == tower
    assert model.placeholder("image") == 120  # from config.json, not the byte tokenizer
    assert model.config.llm.norm_eps == 1e-6 and model.config.llm.rope_theta == 50000.0
    assert model.config.vision.depth == (2 if tower == "clip" else 3)  # feature layer -2/-1
    check_logits(model, params, tower)


@pytest.mark.parametrize("tower", ["clip", "siglip"])
def test_export_then_import_matches_transformers(tower, tmp_path):
    model, params = hf.load(GOLDEN / f"llava_{tower}")
    hf.save(model, params, tmp_path / "out")
    again, reloaded = hf.load(tmp_path / "out")
    assert again.config.vision == model.config.vision and again.config.llm == model.config.llm
    check_logits(again, reloaded, tower)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reloaded), strict=True):
        np.testing.assert_array_equal(a, b)


def test_llava_15_key_names_and_shard_index(tmp_path):
    """The names of the LLaVA-1.5 checkpoints people download, split over two shards."""
    src = GOLDEN / "llava_clip"
    tensors = load_file(src / "model.safetensors")
    renamed = {}
    for k, v in tensors.items():
        k = k.replace("vision_tower.", "vision_tower.vision_model.", 1)
        renamed[k] = v
    names = sorted(renamed)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    out = tmp_path / "llava-1.5"
    out.mkdir()
    shutil.copy(src / "config.json", out)
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: renamed[k] for k in keys}, out / file)
        weight_map.update({k: file for k in keys})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model, params = hf.load(out)
    check_logits(model, params, "clip")


def test_transformers_5_key_names(tmp_path):
    """What current transformers writes: model.language_model., model.vision_tower.,
    model.multi_modal_projector., lm_head."""
    src = GOLDEN / "llava_clip"
    renamed = {}
    for k, v in load_file(src / "model.safetensors").items():
        k = k.replace("language_model.model.", "model.language_model.")
        k = k.replace("language_model.lm_head.", "lm_head.")
        k = k.replace("vision_tower.", "model.vision_tower.", 1)
        k = k.replace("multi_modal_projector.", "model.multi_modal_projector.", 1)
        renamed[k] = v
    (tmp_path / "m").mkdir()
    shutil.copy(src / "config.json", tmp_path / "m")
    save_file(renamed, tmp_path / "m" / "model.safetensors")
    model, params = hf.load(tmp_path / "m")
    check_logits(model, params, "clip")


def test_separate_vision_and_llm_checkpoints():
    """CLIPVisionModel + LlamaForCausalLM directories; the projector from the LLaVA one
    makes the whole model, which must then give the LLaVA logits."""
    src = GOLDEN / "llava_clip"
    dirs = {"vision": src / "vision", "llm": src / "llm"}
    base = dataclasses.replace(get_preset("llava-1.5-tiny"), image_token_id=120)
    model = MLLM(hf.parts_config(dirs, base))
    params, report = hf.read_parts(model, dirs, key=jax.random.key(0), lazy=True)
    assert "fresh" in report.sources["projector"] and report.sources["llm"] == str(src / "llm")
    _, whole = hf.load(src)
    params["projector"] = whole["projector"]
    check_logits(model, params, "clip")


def test_lazy_reads_only_the_slices_asked_for():
    model, params = hf.load(GOLDEN / "llava_clip", lazy=True)
    o = params["llm"]["blocks"]["o"]["kernel"]
    assert isinstance(o, hf.LazyTensor) and o.shape == (2, 32, 32)
    full = np.asarray(o)
    np.testing.assert_array_equal(o[1:2, 8:16, :4], full[1:2, 8:16, :4])
    np.testing.assert_array_equal(o.rows(1, 2)[:, :, 4:8], full[1:2, :, 4:8])
    # the executor's placement reads through make_array_from_callback
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, "tp"))
    from hetjax.runtime.programs import put_global

    placed = put_global(o, sharding)
    np.testing.assert_array_equal(np.asarray(placed), full)


def test_lazy_fused_leaves_read_only_a_tp_ranks_rows(monkeypatch):
    """The LLM's fused q/k/v ``[layers, D, G, R + 2, K]`` and gate/up ``[layers, D, 2, F]``:
    the slice a tp rank holds (its kv groups, its MLP columns) reads only the HF rows
    that make it (q_proj rows of its groups' query heads, k/v rows of its kv heads)."""
    asked = []
    read = Files.read
    monkeypatch.setattr(
        Files,
        "read",
        lambda self, key, index=None: (
            asked.append((key.rsplit(".", 2)[-2], index)) or read(self, key, index)
        ),
    )
    _, params = hf.load(GOLDEN / "llava_clip", lazy=True)
    qkv = params["llm"]["blocks"]["qkv"]["kernel"]
    gate_up = params["llm"]["blocks"]["gate_up"]["kernel"]
    assert (qkv.shape, gate_up.shape) == ((2, 32, 2, 4, 8), (2, 32, 2, 64))
    full_qkv, full_gate_up = np.asarray(qkv), np.asarray(gate_up)
    asked.clear()
    np.testing.assert_array_equal(qkv[:, 4:8, 1:2], full_qkv[:, 4:8, 1:2])
    assert asked[:3] == [  # layer 0 (4 heads of 8 dims, 2 kv heads: 2 query heads each)
        ("q_proj", (slice(16, 32), slice(4, 8))),
        ("k_proj", (slice(8, 16), slice(4, 8))),
        ("v_proj", (slice(8, 16), slice(4, 8))),
    ]
    asked.clear()
    np.testing.assert_array_equal(gate_up[:1, :, :, 32:], full_gate_up[:1, :, :, 32:])
    assert asked == [(p, (slice(32, 64), slice(0, 32))) for p in ("gate_proj", "up_proj")]


def _edit_config(tmp_path, edit, tower="clip"):
    src = GOLDEN / f"llava_{tower}"
    out = tmp_path / "edited"
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("vision", "llm"))
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(model_type="qwen2_vl"), "unknown architecture"),
        (lambda c: c["vision_config"].update(model_type="dinov2"), "unknown vision architecture"),
        (lambda c: c["text_config"].update(model_type="gpt2"), "unknown LLM architecture"),
        (lambda c: c["text_config"].update(num_hidden_layers=3), "missing tensor"),
        (
            lambda c: c["text_config"].update(intermediate_size=48),
            "has shape (64, 32), the config needs (48, 32)",
        ),
        (lambda c: c["text_config"].update(tie_word_embeddings=True), "tie_word_embeddings"),
        (lambda c: c.update(vision_feature_layer=[-2, -1]), "only one layer"),
    ],
)
def test_bad_checkpoints_get_one_line(tmp_path, edit, message):
    with pytest.raises(hf.HFError, match=None) as err:
        hf.load(_edit_config(tmp_path, edit))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_missing_files_get_one_line(tmp_path):
    with pytest.raises(hf.HFError, match="no config.json"):
        hf.load(tmp_path)
    (tmp_path / "config.json").write_text((GOLDEN / "llava_clip" / "config.json").read_text())
    with pytest.raises(hf.HFError, match="no \\*.safetensors"):
        hf.load(tmp_path)
