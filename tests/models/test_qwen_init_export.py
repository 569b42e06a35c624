"""Qwen2.5-VL from a Hugging Face directory into training and back out.

A random ``Qwen2_5_VLForConditionalGeneration`` directory (``hf.save``) with the golden
fixture's depths, so the golden's key names, and vision token ids of its own (not the
preset's: they must come from its ``config.json``) starts ``llava_train --init-from`` in a
parallel layout (the weights read lazily, slice by slice). Its first step's loss is
``QwenVL.loss_sum`` of ``hf.load``'s weights on the same batch; its checkpoint exports
(``experiments.export``) to a directory with the golden's key names that ``hf.load``
reads back bit for bit. Then the inputs that stop in one line.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

import hetjax.config as hc
from experiments import llava_train
from hetjax.checkpoint import Checkpointer
from models import hf
from models.config import get_preset
from models.hf.qwen_config import qwen_config_of
from models.qwen import demo
from models.qwen.model import QwenVL
from models.qwen.task import QwenTask, is_qwen
from tests.launch import check_ok, rows, run_main

GOLDEN = pathlib.Path(__file__).parent / "golden" / "qwen2_5_vl"
SEQ, BATCH = 48, 8
ARGS = ["--steps", "1", "--global-batch", str(BATCH), "--microbatches", "1"]
ARGS += ["--seq-len", str(SEQ), "--layout", "vision:dp=8", "--layout", "llm:dp=4,tp=2"]


def _config():
    """The golden's depths (6 tower layers, full attention at 2 and 5; 2 LLM layers) with
    the tiny preset's patch and window sizes, and ids above the byte tokenizer's."""
    golden = qwen_config_of(GOLDEN)
    tiny = get_preset("qwen2.5-vl-tiny").vision
    vision = dataclasses.replace(
        golden.vision,
        patch=tiny.patch,
        window=tiny.window,
        video_token_id=331,
        vision_start_token_id=332,
        vision_end_token_id=333,
    )
    llm = dataclasses.replace(golden.llm, vocab=384)
    return dataclasses.replace(golden, vision=vision, llm=llm, image_token_id=330, seq_len=SEQ)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwen_init")
    model = QwenVL(_config())
    src = hf.save(model, model.init(jax.random.key(5)), tmp / "hf")
    metrics, ckpt = tmp / "m.jsonl", tmp / "ckpt"
    argv = ["--init-from", str(src), *ARGS, "--metrics", str(metrics)]
    argv += ["--checkpoint-dir", str(ckpt), "--save-every", "1"]
    out = run_main(llava_train.__name__, *argv)
    check_ok(out)
    return src, out, rows(metrics), ckpt, tmp


def test_first_step_loss_is_the_hf_weights_loss(run):
    src, out, metrics, _, _ = run
    assert f"init: vision, projector, llm from {src}" in out.stdout
    model, params = hf.load(src)
    config = hc.TrainConfig(
        steps=1,
        model=hc.ModelConfig(init_from=str(src), seq_len=SEQ),
        data=hc.DataConfig(global_batch=BATCH),
    )
    assert is_qwen(config)
    task = QwenTask(config)
    # The placeholders and vision ids are the directory's: the batch carries them.
    assert task.config.image_token_id == 330 and task.config.vision.vision_start_token_id == 332
    batch = task.dataset.batch(0, BATCH)
    assert (batch["tokens"] == 330).any() and (batch["tokens"] == 332).any()
    task_model = QwenVL(model.config, loss_tokens_per_row=task.mllm.loss_tokens_per_row)
    loss = task_model.loss_sum(params, batch) / batch["loss_mask"].sum()
    np.testing.assert_allclose(metrics[0]["loss"], float(loss), rtol=1e-5)


def test_export_has_the_golden_keys_and_reloads_bit_exactly(run):
    src, _, _, ckpt, tmp = run
    out = run_main("experiments.export", "--checkpoint", str(ckpt), "--out", str(tmp / "out"))
    check_ok(out)
    assert "exported step 1" in out.stdout
    written = load_file(tmp / "out" / "model.safetensors")
    assert sorted(written) == sorted(load_file(GOLDEN / "model.safetensors"))
    model, reloaded = hf.load(tmp / "out")
    assert model.config.vision == _config().vision and model.config.llm == _config().llm
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), reloaded)
    saved = Checkpointer(ckpt)
    trained = jax.device_get(saved.restore_params(like))
    saved.close()
    start = jax.tree.leaves(hf.load(src)[1])
    for a, b, s in zip(jax.tree.leaves(trained), jax.tree.leaves(reloaded), start, strict=True):
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, s)  # the export is the trained step, not the start


def _set_config(src: pathlib.Path, dst: pathlib.Path, **changes) -> pathlib.Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_bad_inputs_are_one_line(run, tmp_path):
    src = run[0]

    def error(path, *extra):
        out = run_main(llava_train.__name__, "--init-from", str(path), *ARGS, *extra)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        return out.stderr.strip()

    other = _set_config(src, tmp_path / "qwen2", model_type="qwen2_vl")
    assert "is a 'qwen2_vl' checkpoint; Qwen2.5-VL training takes a Qwen2_5_VL" in error(other)
    # the golden's ids (120..123) are bytes of the synthetic text, its vocabulary 128
    assert "synthetic data needs the vision token ids between the byte tokenizer's 259" in (
        error(GOLDEN)
    )
    made = demo.make(str(tmp_path / "records"), train=4)  # a tokenizer of other vision ids
    records = ["--data", made["train"], "--image-folder", made["media"], "--template"]
    records += ["qwen2_vl", "--tokenizer", made["tokenizer"]]
    assert "gives image_token_id=5 but --init-from" in error(src, *records)
    assert "config.json; drop --model qwen2.5-vl-tiny" in error(src, "--model", "qwen2.5-vl-tiny")
    with pytest.raises(ValueError, match=r"^model.init is not wired to Qwen2.5-VL training"):
        QwenTask(
            hc.TrainConfig(model=hc.ModelConfig(preset="qwen2.5-vl-tiny", init={"llm": str(src)}))
        )
