"""Section ``qwen_step`` (issue 32): full executor steps of Qwen2.5-VL-7B's shapes on
dynamic-resolution data, at ``sizes.dtype`` with the fused attention paths a GPU takes
(cuDNN's causal kernel in the LLM, the segment-masked one in the tower's window and frame
layers).

The model is ``sizes.qwen`` (the ``qwen2.5-vl-7b`` preset: its LLM widths, heads and
vocabulary, the whole 32-layer tower and the merger) with the LLM cut to
``sizes.qwen_layers`` layers, as ``llava_step`` cuts LLaVA's: the full 8.3B parameters
with AdamW's moments and the float32 gradient accumulators (about 16 bytes each) do not
fit one H100's 78 GiB. The tower is frozen, as Qwen2.5-VL's own fine-tuning recipe
(``tune_mm_vision`` off) and LLaVA's second stage have it; the merger and the LLM train.

The data go through the library's own record path (:mod:`models.qwen.loader`), not the
synthetic generator, whose images are at most 112 pixels a side: a record file written on
the spot mixes one image, two images, a video (a frames folder) and text only, the
images at ``sizes.qwen_images`` (several aspect ratios, each its own patch grid), the
video ``sizes.qwen_video``; a byte-level BPE tokenizer with Qwen's special tokens is
trained on the records (:func:`models.qwen.demo.train_tokenizer`). The budgets (patches
and supervised tokens per row) are derived from the records as a user's run derives them.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from experiments.gpu_check.common import Run, peak_bytes
from experiments.gpu_check.stages import step_row

# The records cycle through these kinds; the answer is what the loss is taken on.
KINDS = ("image", "two images", "video", "text")


def write_records(folder: str, images: tuple, video: tuple, count: int = 16) -> dict[str, str]:
    """``count`` LLaVA-format records (each kind of :data:`KINDS` in turn) under ``folder``:
    noise images of the ``images`` sizes ``(height, width)`` in turn (two images: two
    sizes in a row), a ``video`` ``(frames, height, width)`` as a frames folder, and a
    tokenizer trained on their text. Returns the paths (``train``, ``media``,
    ``tokenizer``)."""
    from PIL import Image

    from models.qwen.demo import train_tokenizer
    from models.qwen.template import DEFAULT_SYSTEM

    rng = np.random.default_rng(0)
    media = os.path.join(folder, "media")
    os.makedirs(media, exist_ok=True)

    def picture(path: str, size: tuple[int, int]) -> None:
        h, w = size
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        pixels[h // 4 : h // 2, w // 4 : w // 2] = (255, 0, 0)
        Image.fromarray(pixels).save(path)

    turn = lambda who, value: {"from": who, "value": value}  # noqa: E731
    records = []
    for i in range(count):
        kind, rid, size = KINDS[i % len(KINDS)], f"r{i}", images[(i // len(KINDS)) % len(images)]
        record: dict[str, Any] = {"id": rid}
        if kind == "image":
            picture(os.path.join(media, f"{rid}.png"), size)
            record["image"], prompt = f"{rid}.png", "<image>\nWhat is in the red box?"
        elif kind == "two images":
            other = images[(i // len(KINDS) + 1) % len(images)]
            for tag, s in (("a", size), ("b", other)):
                picture(os.path.join(media, f"{rid}{tag}.png"), s)
            record["image"], prompt = [f"{rid}a.png", f"{rid}b.png"], "<image><image>Same box?"
        elif kind == "video":
            frames, h, w = video
            os.makedirs(os.path.join(media, rid))
            for f in range(frames):
                picture(os.path.join(media, rid, f"{f:04d}.png"), (h, w))
            record["video"], prompt = rid, "<video>\nDoes the box move?"
        else:
            prompt = "Say something about boxes."
        answer = f"A red box, record {i}, drawn on noise."
        record["conversations"] = [turn("human", prompt), turn("gpt", answer)]
        records.append(record)
    train = os.path.join(folder, "train.json")
    with open(train, "w") as f:
        json.dump(records, f)
    texts = [t["value"] for r in records for t in r["conversations"]]
    texts += [DEFAULT_SYSTEM, "system\nuser\nassistant\n"] * 20
    tokenizer = train_tokenizer(texts, os.path.join(folder, "tokenizer"))
    return {"train": train, "media": media, "tokenizer": tokenizer}


def qwen_config(run: Run) -> Any:
    """``sizes.qwen`` with the LLM cut to ``qwen_layers`` layers."""
    import dataclasses

    s = run.sizes
    llm = dataclasses.replace(s.qwen.llm, depth=s.qwen_layers)
    return dataclasses.replace(s.qwen, name="gpu-check-qwen", llm=llm, seq_len=s.qwen_seq)


def state_gib(cfg: Any) -> float:
    """The training state of ``cfg`` as this section trains it, in GiB: 16 bytes a trained
    parameter (float32 value and gradient accumulator, AdamW's two moments), 2 a frozen
    tower's (kept in bf16)."""
    v = cfg.vision
    return (16 * (cfg.llm.num_params() + v.merger_params()) + 2 * v.num_params()) / 2**30


def reduced(run: Run) -> str | None:
    """What was cut from ``sizes.qwen`` and why (None: nothing)."""
    full, cut = run.sizes.qwen, qwen_config(run)
    if cut.llm.depth == full.llm.depth:
        return None
    return (
        f"LLM cut to {cut.llm.depth} of {full.llm.depth} layers: training state "
        f"{state_gib(full):.0f} GiB in full, {state_gib(cut):.0f} GiB cut, next to one "
        "H100's 78 GiB (activations besides)"
    )


def qwen_trainer(run: Run, paths: dict[str, str], observers: list) -> Any:
    """The one-device trainer: tower frozen, AdamW, one microbatch of ``qwen_batch`` rows,
    no recompute (as ``llava_step``), over the records at ``paths``."""
    import optax

    from experiments import runner
    from hetjax.train import Trainer
    from models.qwen.task import QwenBatches, QwenTask

    s = run.sizes
    row = runner.bench_config(
        model={"dtype": s.dtype, "freeze": "vision", "seq_len": s.qwen_seq},
        data={
            "global_batch": s.qwen_batch,
            "sources": {paths["train"]: 1.0},
            "image_folder": paths["media"],
            "tokenizer": paths["tokenizer"],
            "template": "qwen2_vl",
        },
        parallel={
            "layouts": {"llm": "dp=1"},
            "microbatches": 1,
            "recompute": {"*": "none"},
            "peak_tflops": run.peak,
        },
    )
    task = QwenTask(row, preset=qwen_config(run))
    return Trainer(
        row,
        task,
        QwenBatches(task),
        devices=run.devices[:1],
        observers=observers,
        optimizer=optax.adamw(1e-5),
    )


def mean_metrics(tr: Any, batches: list, first_s: float, times: list[float]) -> dict:
    """The task's FLOP metrics (:meth:`models.llava.task.LlavaTask.flop_metrics`) of each
    timed step at its own time, averaged: model FLOPs differ per step with its patches."""
    metrics = tr.model.flop_metrics(tr)  # pops each batch's vision counts in step order
    supervised = [float(b["loss_mask"].sum()) for b in batches]
    metrics(supervised[0], first_s)  # the compiling step's counts: not reported
    steps = [metrics(n, t) for n, t in zip(supervised[1:], times, strict=True)]
    return {k: statistics.fmean(m[k] for m in steps) for k in steps[0]}


def qwen_step_section(run: Run) -> dict:
    """``1 + step_reps`` executor steps (the first compiles): MFU and HFU by the task's
    own count (:meth:`models.qwen.task.QwenTask.step_flops`: the tower per real patch and
    attended pair), averaged over the timed steps (each step's patches differ), LLM
    positions, real tokens and patches per second, the programs compiled and the fused
    attention calls in them, and device memory."""
    from experiments import runner
    from hetjax.inspect import Recorder

    gc.collect()  # earlier sections' executors, before 7B-wide parameters are made
    s, rec = run.sizes, Recorder()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        paths = write_records(tmp, s.qwen_images, s.qwen_video)
        tr = qwen_trainer(run, paths, [rec])
        setup_s = time.perf_counter() - t0
        try:
            batches = runner.batches(tr, 1 + s.step_reps)
            data = [tr.data.step_metrics(i) for i in range(len(batches))]
            t0 = time.perf_counter()
            _, times = runner.timed_steps(tr.engine, batches, rec)
            first_s = time.perf_counter() - t0 - sum(times)
        finally:
            tr.data.close()
    mean = mean_metrics(tr, batches, first_s, times)
    t = statistics.fmean(times)
    cfg, task = qwen_config(run), tr.model
    rows, length = batches[0]["tokens"].shape
    tokens = statistics.fmean(d["tokens_per_step"] for d in data[1:])
    patches = statistics.fmean(d["patches"] for d in data[1:])
    fused = {
        f"{k[0][0]}/{k[1]}": c.as_text().count("__cudnn$fmha") for k, c in rec.compiled.items()
    }
    device = run.devices[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    return {
        "shape": {
            "llm_layers": cfg.llm.depth,
            "reduced": reduced(run),
            "llm_width": cfg.llm.width,
            "vocab": cfg.llm.vocab,
            "vision_layers": cfg.vision.depth,
            "vision_frozen": "vision" in tr.config.model.frozen,
            "seq": length,
            "batch": rows,
            "patches_per_row": task.patches_per_row,
            "loss_tokens_per_row": task.mllm.loss_tokens_per_row,
            "images": [list(x) for x in s.qwen_images],
            "video": list(s.qwen_video),
        },
        **step_row(run, mean, t),
        "step_s_median": statistics.median(times),
        "positions_per_s": rows * length / t,
        "tokens_per_s": tokens / t,  # real (non-padding) LLM input tokens
        "patches_per_s": patches / t,  # real patches through the tower
        "patch_fill": statistics.fmean(d["patch_fill"] for d in data[1:]),
        "setup_s": setup_s,
        "compile_and_first_step_s": first_s,
        "programs": len(rec.compiled),
        "fused_attention_calls": fused,
        "largest_program_bytes": max(peak_bytes(c) or 0 for c in rec.compiled.values()),
        "device_bytes_in_use": stats and stats.get("bytes_in_use"),
        # the process's peak so far: this section's own unless an earlier one went higher
        "device_peak_bytes": stats and stats.get("peak_bytes_in_use"),
    }
