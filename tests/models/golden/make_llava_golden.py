"""Regenerates the Hugging Face golden fixtures of tests/models/test_hf.py.

Needs ``torch`` and ``transformers`` (NOT project dependencies; CI never runs this).
Run once in a scratch environment, from the project root:

    python3 -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers safetensors numpy
    /tmp/hf/bin/python tests/models/golden/make_llava_golden.py

For each vision tower (CLIP, SigLIP) it writes ``tests/models/golden/llava_<tower>/``:
a tiny random-weight ``LlavaForConditionalGeneration`` in HF format (``config.json``,
``model.safetensors``), ``vision/`` and ``llm/`` (for CLIP only: the same weights as a
standalone ``CLIPVisionModel`` and ``LlamaForCausalLM``), and ``golden.npz``
with the inputs and transformers' float32 logits.
"""

from __future__ import annotations

import pathlib

import numpy as np
import torch
import transformers
from transformers import (
    CLIPVisionConfig,
    CLIPVisionModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    SiglipVisionConfig,
)

HERE = pathlib.Path(__file__).parent
IMAGE_TOKEN = 120  # not the byte tokenizer's id: the loader must read it from config.json
SEQ = 40


def text_config() -> LlamaConfig:
    # Non-default eps and theta, GQA: the import must follow config.json.
    return LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=50000.0,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )


def vision_config(tower: str):
    common = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=16,
        patch_size=4,
        num_channels=3,
    )
    if tower == "clip":
        return CLIPVisionConfig(**common, projection_dim=32)
    return SiglipVisionConfig(**common)


def main() -> None:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    for tower in ("clip", "siglip"):
        out = HERE / f"llava_{tower}"
        cfg = LlavaConfig(
            vision_config=vision_config(tower),
            text_config=text_config(),
            image_token_index=IMAGE_TOKEN,
            projector_hidden_act="gelu",
            vision_feature_layer=-2 if tower == "clip" else -1,
            vision_feature_select_strategy="default" if tower == "clip" else "full",
        )
        model = LlavaForConditionalGeneration(cfg).eval()
        with torch.no_grad():  # random, not tiny, weights: every term of the model matters
            for p in model.parameters():
                p.normal_(0.0, 0.2)
                p.copy_(p.half().float())  # stored as float16 (as LLaVA-1.5's), exactly
        model.half().save_pretrained(out, safe_serialization=True)
        model.float()
        n = 16  # image tokens per image (patches; CLIP's class token is dropped)
        ids = rng.integers(0, 100, (2, SEQ))
        ids[0, 3 : 3 + n] = IMAGE_TOKEN
        ids[1, 10 : 10 + n] = IMAGE_TOKEN
        pixels = rng.normal(0.0, 1.0, (2, 3, 16, 16)).astype(np.float32)
        with torch.no_grad():
            logits = model(
                input_ids=torch.tensor(ids), pixel_values=torch.tensor(pixels)
            ).logits.float()
        np.savez(
            out / "golden.npz",
            input_ids=ids.astype(np.int32),
            pixel_values=pixels,
            logits=logits.numpy(),
        )
        if tower != "clip":
            continue
        # The same weights as separate checkpoints (how LLaVA stage 1 starts).
        inner = model.model
        vision = CLIPVisionModel(cfg.vision_config)
        vision.load_state_dict(inner.vision_tower.state_dict())
        vision.half().save_pretrained(out / "vision", safe_serialization=True)
        llm = LlamaForCausalLM(cfg.text_config)
        llm.model.load_state_dict(inner.language_model.state_dict())
        llm.lm_head.load_state_dict(model.lm_head.state_dict())
        llm.half().save_pretrained(out / "llm", safe_serialization=True)
        print(f"{out}: transformers {transformers.__version__}, logits {logits.shape}")


if __name__ == "__main__":
    main()
