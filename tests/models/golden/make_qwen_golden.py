"""Regenerates the Qwen2.5-VL golden fixture of tests/models/test_qwen_hf.py.

Needs ``torch`` and ``transformers`` (NOT project dependencies; CI never runs this).
Run once in a scratch environment, from the project root:

    python3 -m venv /tmp/hfenv && /tmp/hfenv/bin/pip install torch transformers safetensors numpy
    /tmp/hfenv/bin/python tests/models/golden/make_qwen_golden.py

``--check DIR`` instead loads a directory that ``models.hf.save`` wrote (from the
golden's weights) and checks that transformers finds no missing or unexpected keys and
computes the golden logits.

It writes ``tests/models/golden/qwen2_5_vl/``: a tiny random-weight
``Qwen2_5_VLForConditionalGeneration`` in HF format (``config.json``, bfloat16
``model.safetensors``, as the released checkpoints store them) and ``golden.npz`` with the
processor-style inputs (flattened patches, grids, a video with ``second_per_grid_ts``,
right padding) and transformers' float32 logits.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import torch
import transformers
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

HERE = pathlib.Path(__file__).parent
# Not Qwen's ids: the loader must read them from config.json.
IMAGE, VIDEO, START, END = 120, 121, 122, 123
PATCH, TEMPORAL, MERGE, CHANNELS = 2, 2, 2, 3
SEQ = 48


def config() -> Qwen2_5_VLConfig:
    # Non-default theta and eps, GQA, a full-attention pattern of period 3 (layers 2, 5),
    # windows of 2x2 merged units (window_size 8 / merge 2 / patch 2).
    vision = dict(
        depth=6,
        hidden_size=32,
        intermediate_size=48,
        num_heads=4,
        in_channels=CHANNELS,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=TEMPORAL,
        window_size=8,
        fullatt_block_indexes=[2, 5],
        tokens_per_second=2,
        out_hidden_size=48,
    )
    text = dict(
        vocab_size=128,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0, "mrope_section": [2, 2, 2]},
    )
    return Qwen2_5_VLConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
        tie_word_embeddings=False,
    )


def vision_run(kind: int, grid: tuple[int, int, int]) -> list[int]:
    t, h, w = grid
    return [START] + [kind] * (t * h * w // MERGE**2) + [END]


def inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Three rows: two images of different sizes (several windows, a partial one); a video
    then an image, right-padded; one small image first, right-padded."""
    images = [(1, 8, 6), (1, 4, 8), (1, 4, 4), (1, 2, 2)]
    videos = [(2, 4, 4)]
    text = lambda n: list(rng.integers(0, 100, n))  # noqa: E731
    rows = [
        text(3) + vision_run(IMAGE, images[0]) + text(4) + vision_run(IMAGE, images[1]) + text(3),
        text(2) + vision_run(VIDEO, videos[0]) + text(5) + vision_run(IMAGE, images[2]) + text(4),
        vision_run(IMAGE, images[3]) + text(20),
    ]
    ids = np.zeros((len(rows), SEQ), np.int64)
    mask = np.zeros((len(rows), SEQ), np.int64)
    for b, row in enumerate(rows):
        assert len(row) <= SEQ, len(row)
        ids[b, : len(row)] = row
        mask[b, : len(row)] = 1
    dim = CHANNELS * TEMPORAL * PATCH * PATCH
    n_img = sum(t * h * w for t, h, w in images)
    n_vid = sum(t * h * w for t, h, w in videos)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "pixel_values": rng.normal(0.0, 1.0, (n_img, dim)).astype(np.float32),
        "image_grid_thw": np.array(images, np.int64),
        "pixel_values_videos": rng.normal(0.0, 1.0, (n_vid, dim)).astype(np.float32),
        "video_grid_thw": np.array(videos, np.int64),
        # 0.75 s per temporal patch: temporal positions 0, 1.5 -> 0, 1 (truncated, as HF)
        "second_per_grid_ts": np.array([0.75], np.float32),
    }


def hf_logits(model, x: dict[str, np.ndarray]) -> torch.Tensor:
    ids = torch.tensor(x["input_ids"])
    types = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()  # what the processor returns
    names = ("attention_mask", "pixel_values", "image_grid_thw", "pixel_values_videos",
             "video_grid_thw", "second_per_grid_ts")  # fmt: skip
    with torch.no_grad():
        out = model(
            input_ids=ids, mm_token_type_ids=types, **{k: torch.tensor(x[k]) for k in names}
        )
    return out.logits.float()


def check(path: str) -> None:
    model, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    problems = {k: v for k, v in info.items() if v}
    assert not problems, problems
    g = dict(np.load(HERE / "qwen2_5_vl" / "golden.npz"))
    diff = np.abs(hf_logits(model.eval(), g).numpy() - g["logits"]).max()
    print(f"{path}: no missing or unexpected keys; max |logits - golden| = {diff:.3g}")
    assert diff <= 1e-5


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--check":
        return check(sys.argv[2])
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    out = HERE / "qwen2_5_vl"
    model = Qwen2_5_VLForConditionalGeneration(config()).eval()
    with torch.no_grad():  # random, not tiny, weights: every term of the model matters
        for p in model.parameters():
            p.normal_(0.0, 0.2)
            p.copy_(p.bfloat16().float())  # stored as bfloat16, exactly
    model.bfloat16().save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)  # not read
    # Reloaded in float32 as a user would: .bfloat16() also rounded the rotary buffers.
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    x = inputs(rng)
    logits = hf_logits(model, x)
    ids = torch.tensor(x["input_ids"])
    types = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    with torch.no_grad():
        positions, _ = model.model.get_rope_index(
            ids,
            mm_token_type_ids=types,
            image_grid_thw=torch.tensor(x["image_grid_thw"]),
            video_grid_thw=torch.tensor(x["video_grid_thw"]),
            second_per_grid_ts=torch.tensor(x["second_per_grid_ts"]),
            attention_mask=torch.tensor(x["attention_mask"]),
        )
    np.savez(
        out / "golden.npz",
        **x,
        position_ids=positions.numpy(),  # [3, B, L]
        logits=logits.numpy(),
    )
    print(f"{out}: transformers {transformers.__version__}, logits {tuple(logits.shape)}")


if __name__ == "__main__":
    main()
