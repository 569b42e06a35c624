"""``--init-from`` and ``--init`` end to end: Hugging Face weights into a parallel layout.

A random ``llava-1.5-tiny`` is written as a Hugging Face LLaVA directory, and split into a
``CLIPVisionModel`` and a ``LlamaForCausalLM`` directory the way those checkpoints are
published. The parallel run from the LLaVA directory must give the reference trainer's
losses; the run from the two parts must start from their weights (frozen, so their
norms never move) with a fresh projector.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from models import hf
from models.config import get_preset
from models.mllm import MLLM
from tests.launch import TRAIN, check_ok, rows, run_main

STEPS = ["--steps", "3", "--global-batch", "16", "--seq-len", "64"]
PARALLEL = [
    *("--devices", "8", "--microbatches", "2"),
    *("--layout", "vision:dp=8", "--layout", "llm:dp=2,tp=2,pp=2"),
]


def _split(llava, out):
    """The LLaVA directory's vision tower and LLM as standalone checkpoints."""
    config = json.loads((llava / "config.json").read_text())
    tensors = load_file(str(llava / "model.safetensors"))
    parts = {
        "vision": ({"vision_tower.": ""}, {**config["vision_config"]}),
        "llm": ({"language_model.": ""}, {**config["text_config"]}),
    }
    parts["vision"][1]["architectures"] = ["CLIPVisionModel"]
    parts["llm"][1]["architectures"] = ["LlamaForCausalLM"]
    dirs = {}
    for part, (prefixes, part_config) in parts.items():
        d = out / part
        d.mkdir()
        mine = {
            name[len(old) :]: t
            for name, t in tensors.items()
            for old in prefixes
            if name.startswith(old)
        }
        save_file(mine, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(part_config))
        dirs[part] = d
    return dirs


def _norm(tree):
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(x))) for x in jax.tree.leaves(tree))))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("init")
    model = MLLM(get_preset("llava-1.5-tiny"))
    params = model.init(jax.random.key(7))
    llava = hf.save(model, params, tmp / "llava")
    parts = _split(llava, tmp)
    args = {
        "reference": ["--init-from", str(llava), "--reference", "--devices", "1"],
        "parallel": ["--init-from", str(llava), *PARALLEL],
        "parts": [
            *("--model", "llava-1.5-tiny", "--devices", "2", "--freeze", "vision,llm"),
            *("--init", f"vision={parts['vision']}", "--init", f"llm={parts['llm']}"),
        ],
    }
    out = {}
    for name, a in args.items():  # in the test process, one after the other
        path = tmp / f"{name}.jsonl"
        out[name] = (run_main(TRAIN, *a, *STEPS, "--metrics", str(path)), rows(path))
    return out, params


def test_init_from_in_a_parallel_layout_gives_the_reference_losses(runs):
    out, _ = runs
    for name in ("reference", "parallel"):
        check_ok(out[name][0])
        assert [r["step"] for r in out[name][1]] == [0, 1, 2], name
    assert "init: vision, projector, llm from" in out["parallel"][0].stdout
    assert "16 samples x 64 tokens, " in out["parallel"][0].stdout  # --seq-len given
    ref = [r["loss"] for r in out["reference"][1]]
    np.testing.assert_allclose([r["loss"] for r in out["parallel"][1]], ref, rtol=1e-5)
    assert len(set(ref)) == 3  # it trains


def test_init_parts_loads_vision_and_llm_and_a_fresh_projector(runs):
    out, params = runs
    result, metrics = out["parts"]
    check_ok(result)
    assert "init: projector from a fresh initialisation" in result.stdout
    assert [r["step"] for r in metrics] == [0, 1, 2]
    # LLaVA takes a CLIP tower's features from its last layer but one
    # (vision_feature_layer=-2): the run's tower is the published one less its last block.
    used = {
        "vision": {
            **params["vision"],
            "blocks": jax.tree.map(lambda x: x[:-1], params["vision"]["blocks"]),
        },
        "llm": params["llm"],
    }
    for part in ("vision", "llm"):  # the published weights, untouched by training
        norms = {r[f"param_norm/{part}"] for r in metrics}
        assert len(norms) == 1
        np.testing.assert_allclose(norms.pop(), _norm(used[part]), rtol=1e-5)
    assert len({r["param_norm/projector"] for r in metrics}) == 3
