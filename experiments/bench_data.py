"""What the LLaVA data pipeline costs and what packing and balancing buy.

    python -m experiments.bench_data --json out.json [--quick]

A length-skewed LLaVA-format set is made on the spot (:mod:`models.llava.demo` with long
captions: Pillow images, a trained BPE tokenizer, text-only / one- / two-image /
multi-turn records). Four rows, ``pack`` x ``balance``, for the ``small`` preset's
encoder (``--quick``: ``tiny``): rows of 512 tokens, global batch 32 in 4 microbatches,
bins of a vision ``dp=8`` and an LLM ``dp=2`` (the default colocated layout on 8
devices); image slots per row are the trainer's default: unpacked, the most a record has
(2); packed, derived from the data (:func:`models.llava.run.packed_slots`). Keys:

- ``images_per_row``: the loader rows' image slots.
- ``samples_per_s``: records the loader alone turns into batches per second (reading,
  tokenizing, decoding and resizing images in its worker threads; ``--steps`` batches).
- ``data_wait_fraction``: the share of step time ``experiments.llava_train`` (reference
  trainer, the preset's model and ``--seq-len``, global batch 32) waits in the loader
  for the next batch, prefetch on (steps after the first, which compiles); packed rows
  train packed (``--pack``, image slots derived for the preset's sequence length).
- ``padding_fraction``: padded share of the rows' input tokens.
- ``image_imbalance``, ``token_imbalance``: max / mean over (microbatch, dp rank) cells of
  real images (encoder ranks) and real tokens (LLM ranks). With vision ``dp=8`` a
  microbatch of 8 rows gives each encoder rank one row, so balancing cannot move images.
- ``tokens_per_step``: real input tokens per step.

Goals (exit 1 otherwise): ``data_wait_fraction < 0.05``; packing at least halves
``padding_fraction``; balancing brings ``token_imbalance`` under 1.1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

GLOBAL_BATCH = 32
MICROBATCHES = 4
BINS = (MICROBATCHES, 8, 2)  # vision dp=8, llm dp=2 (the default colocated layout)
ROW_TOKENS = 512  # the loader rows' --seq-len: several samples fit a row when packed


def _data_config(paths, pack: bool, balance: bool):
    import hetjax.config as hc

    return hc.DataConfig(
        global_batch=GLOBAL_BATCH,
        sources={paths["train"]: 1.0},
        image_folder=paths["images"],
        tokenizer=paths["tokenizer"],
        pack=pack,
        balance=balance,
        workers=4,
        prefetch=2,
    )


def loader_row(paths, pack: bool, balance: bool, preset: str, steps: int) -> dict:
    """The loader alone: throughput and the rows' padding and balance."""
    from models.config import get_preset
    from models.llava import run as llava_run

    cfg = get_preset(preset)
    d = _data_config(paths, pack, balance)
    data, _ = llava_run.build(d, cfg, seq_len=ROW_TOKENS, seed=0, microbatches=MICROBATCHES)
    stream = llava_run.DataStream(data, BINS)
    start = time.perf_counter()
    metrics = []
    for step in range(steps):
        stream.batch(step)
        metrics.append(stream.step_metrics(step))
    elapsed = time.perf_counter() - start
    samples = sum(stream.loader.state["counts"])
    stream.close()

    def mean(key):
        return statistics.fmean(m[key] for m in metrics)

    keys = ("padding_fraction", "image_imbalance", "token_imbalance", "tokens_per_step")
    slots = data.config.images_per_row
    row = {"pack": pack, "balance": balance, "images_per_row": slots}
    return row | {"samples_per_s": samples / elapsed} | {k: mean(k) for k in keys}


def wait_fraction(paths, pack: bool, balance: bool, preset: str, steps: int, out: str) -> float:
    """``experiments.llava_train`` in a subprocess; the loader's wait over step time."""
    import subprocess

    metrics = os.path.join(out, f"train_{int(pack)}{int(balance)}.jsonl")
    packing = ["--pack"] if pack else []
    cmd = [
        *(sys.executable, "-m", "experiments.llava_train", "--model", preset),
        *("--data", paths["train"], "--image-folder", paths["images"]),
        *("--tokenizer", paths["tokenizer"], "--steps", str(steps), "--reference"),
        *("--global-batch", str(GLOBAL_BATCH), "--microbatches", str(MICROBATCHES)),
        *("--metrics", metrics, *(["--balance"] if balance else []), *packing),
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in open(metrics)][1:]  # step 0 compiles
    return sum(r["data_wait_s"] for r in rows) / sum(r["step_time_s"] for r in rows)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="bench_data", description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the rows as a JSON list")
    p.add_argument("--quick", action="store_true", help="the tiny preset, fewer records")
    p.add_argument("--steps", type=int, default=None, help="batches per loader row")
    p.add_argument("--train-steps", type=int, default=None, help="steps of each training run")
    args = p.parse_args(argv)
    preset = "tiny" if args.quick else "small"
    steps = args.steps or (4 if args.quick else 16)
    train_steps = args.train_steps or (3 if args.quick else 6)
    from models.llava import demo

    with tempfile.TemporaryDirectory() as out:
        paths = demo.make(out, train=128 if args.quick else 512, heldout=0, long_captions=True)
        rows = [
            loader_row(paths, pack, balance, preset, steps)
            for pack in (False, True)
            for balance in (False, True)
        ]
        for row in rows:
            row["data_wait_fraction"] = wait_fraction(
                paths, row["pack"], row["balance"], preset, train_steps, out
            )
            print(json.dumps(row), flush=True)
    from experiments.cli import write_json

    write_json(args.json, rows)
    by = {(r["pack"], r["balance"]): r for r in rows}
    failed = [
        f"data_wait_fraction {r['data_wait_fraction']:.3f} >= 0.05 (pack={r['pack']}, "
        f"balance={r['balance']})"
        for r in rows
        if r["data_wait_fraction"] >= 0.05
    ]
    if by[True, False]["padding_fraction"] > by[False, False]["padding_fraction"] / 2:
        failed.append("packing does not halve padding_fraction")
    if by[False, True]["token_imbalance"] >= 1.1:
        failed.append(f"balanced token_imbalance {by[False, True]['token_imbalance']:.3f} >= 1.1")
    for line in failed:
        print(f"bench_data: goal missed: {line}", file=sys.stderr)
    if failed:
        raise SystemExit(1)
    return rows


if __name__ == "__main__":
    main()
