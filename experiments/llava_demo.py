"""Train the tiny model on a LLaVA-format set made on the spot; report held-out accuracy.

    python -m experiments.llava_demo [--steps 300] [--json out.json]

The set (:mod:`models.llava.demo`): Pillow-drawn shapes whose colour and kind are the
answers, one-image questions, two-turn dialogues, two-image comparisons and text-only
arithmetic; a BPE tokenizer trained on it. Training: the ``tiny`` preset with two image
slots per row, ``vicuna_v1`` template, the single-device reference trainer (what every
layout matches). Held-out accuracy: :func:`models.llava.evaluate.answer_accuracy` over
records never trained on, per record kind.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="llava_demo", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--records", type=int, default=1024)
    p.add_argument("--json")
    args = p.parse_args(argv)
    import jax
    import numpy as np

    import hetjax
    from models.config import get_preset
    from models.llava import HFTokenizer, ImageProcessor, LlavaData, Loader, LoaderConfig, demo
    from models.llava.evaluate import answer_accuracy
    from models.mllm import MLLM

    with tempfile.TemporaryDirectory() as out:
        paths = demo.make(out, train=args.records, heldout=128)
        tok = HFTokenizer(paths["tokenizer"])
        cfg = dataclasses.replace(get_preset("tiny"), image_token_id=tok.image_id)
        rows = LoaderConfig(
            seq_len=96,
            global_batch=32,
            image_tokens=16,
            placeholder=tok.image_id,
            images_per_row=2,
        )

        def data(split: str, **kw) -> LlavaData:
            return LlavaData(
                [(paths[split], 1.0)],
                tok,
                ImageProcessor.for_encoder("vit", 16),
                dataclasses.replace(rows, **kw),
                image_folder=paths["images"],
            )

        model = MLLM(cfg, images_per_row=2)
        opt = hetjax.AdamWConfig(lr=3e-3, total_steps=args.steps, warmup_steps=10)
        trainer = hetjax.ReferenceTrainer(
            model.loss_sum,
            model.init(jax.random.key(0)),
            hetjax.make_optimizer(opt),
            devices=jax.devices()[:1],
        )
        loader = Loader(data("train"))
        losses = [float(trainer.step(loader.next().arrays)["loss"]) for _ in range(args.steps)]
        loader.close()
        records = json.load(open(paths["heldout"]))
        held = Loader(data("heldout", shuffle=False))
        right = np.concatenate(
            [answer_accuracy(model, trainer.params, held.next().arrays) for _ in range(4)]
        )
        assert held.state["counts"] == [len(records)] and not held.state["bad"], held.state
        held.close()
    kinds = [
        "text-only"
        if "image" not in r
        else (
            "two images"
            if isinstance(r["image"], list)
            else ("two turns" if len(r["conversations"]) > 2 else "one image")
        )
        for r in records
    ]
    per_kind = {
        k: float(np.nanmean([a for a, kk in zip(right, kinds, strict=True) if kk == k]))
        for k in sorted(set(kinds))
    }
    result = {
        "steps": args.steps,
        "loss_first": losses[0],
        "loss_last_10": float(np.mean(losses[-10:])),
        "heldout_accuracy": float(np.nanmean(right)),
        "heldout_accuracy_by_kind": per_kind,
        "heldout_records": len(records),
    }
    print(json.dumps(result, indent=1))
    from experiments.cli import write_json

    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
