"""A small LLaVA-format data set made on the spot, and a BPE tokenizer trained on it.

Images are Pillow-drawn: a filled shape (square, circle or triangle) of one of four
colours on a grey canvas, so every answer depends on the image. Records mix the kinds of
a real instruction mixture: one image with one question, one image with a two-turn
dialogue, two images ("Are the two shapes the same colour?"), and text-only arithmetic.
``long_captions`` adds a length-skewed tail (a caption repeated up to 8 times), the case
packing is for.

``python -m models.llava.demo OUT_DIR`` writes ``OUT_DIR/{train,heldout}.json``,
``OUT_DIR/images/`` and ``OUT_DIR/tokenizer/`` (``tokenizer.json`` and
``tokenizer_config.json``).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 70, 220),
    "yellow": (230, 210, 40),
}
SHAPES = ("square", "circle", "triangle")
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
SPECIALS = ["<pad>", "<s>", "</s>", "<image>", "<unk>"]


def draw(path: str, color: str, shape: str, rng: np.random.Generator, size: int = 24) -> None:
    """One PNG: ``shape`` in ``color`` at a random place and scale on grey."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (size + int(rng.integers(0, 9)), size), (128, 128, 128))
    d = ImageDraw.Draw(im)
    r = int(rng.integers(size // 4, size // 2 - 1))
    cx, cy = im.size[0] // 2 + int(rng.integers(-2, 3)), size // 2 + int(rng.integers(-2, 3))
    box = (cx - r, cy - r, cx + r, cy + r)
    fill = COLORS[color]
    if shape == "square":
        d.rectangle(box, fill=fill)
    elif shape == "circle":
        d.ellipse(box, fill=fill)
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    im.save(path)


def _turn(who: str, value: str) -> dict[str, str]:
    return {"from": who, "value": value}


def records(out: str, n: int, seed: int, *, prefix: str, long_captions: bool = False) -> list[dict]:
    """``n`` records whose images are written under ``out/images``."""
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    recs = []
    for i in range(n):
        kind = int(rng.integers(4))
        rid = f"{prefix}{i}"

        def image(tag: str, rid: str = rid) -> tuple[str, str, str]:
            color, shape = list(COLORS)[rng.integers(4)], SHAPES[rng.integers(3)]
            name = f"{rid}{tag}.png"
            draw(os.path.join(out, "images", name), color, shape, rng)
            return name, color, shape

        if kind == 0:
            name, color, shape = image("")
            q, a = (
                ("What color is the shape?", color)
                if rng.integers(2)
                else ("Which shape is it?", f"a {shape}")
            )
            if long_captions and rng.random() < 0.3:
                a = " ".join([f"a {color} {shape}"] * int(rng.integers(2, 9)))
            conv = [_turn("human", f"<image>\n{q}"), _turn("gpt", a)]
            recs.append({"id": rid, "image": name, "conversations": conv})
        elif kind == 1:
            name, color, shape = image("")
            conv = [
                _turn("human", "<image>\nWhat color is the shape?"),
                _turn("gpt", color),
                _turn("human", "And which shape is it?"),
                _turn("gpt", f"a {shape}"),
            ]
            recs.append({"id": rid, "image": name, "conversations": conv})
        elif kind == 2:
            (n1, c1, _), (n2, c2, _) = image("a"), image("b")
            same = "yes" if c1 == c2 else "no"
            conv = [
                _turn("human", "<image>\n<image>\nAre the two shapes the same color?"),
                _turn("gpt", f"{same}, {c1} and {c2}"),
            ]
            recs.append({"id": rid, "image": [n1, n2], "conversations": conv})
        else:
            a, b = int(rng.integers(5)), int(rng.integers(5))
            conv = [
                _turn("human", f"What is {NUMBERS[a]} plus {NUMBERS[b]}?"),
                _turn("gpt", NUMBERS[a + b]),
            ]
            recs.append({"id": rid, "conversations": conv})
    return recs


def train_tokenizer(texts: list[str], out_dir: str, vocab_size: int = 320) -> str:
    """A SentencePiece-style BPE ``tokenizer.json`` (+ ``tokenizer_config.json``) in
    ``out_dir``: words split at spaces (``▁`` marks a word start, as Llama's tokenizer
    does), the alphabet the characters of ``texts``, so a small vocabulary holds whole
    words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}, f)
    return out_dir


def make(
    out: str, *, train: int = 256, heldout: int = 64, seed: int = 0, long_captions: bool = False
) -> dict[str, str]:
    """Writes the data set; returns the paths (``train``, ``heldout``, ``images``,
    ``tokenizer``)."""
    os.makedirs(out, exist_ok=True)
    paths = {}
    texts = []
    for split, n, s in (("train", train, seed), ("heldout", heldout, seed + 1)):
        recs = records(out, n, s, prefix=f"{split}-", long_captions=long_captions)
        paths[split] = os.path.join(out, f"{split}.json")
        with open(paths[split], "w") as f:
            json.dump(recs, f, indent=1)
        texts += [t["value"] for r in recs for t in r["conversations"]]
    from models.llava.text import VICUNA_SYSTEM

    texts += [VICUNA_SYSTEM, "USER: ASSISTANT:"] * 20
    paths["images"] = os.path.join(out, "images")
    paths["tokenizer"] = train_tokenizer(texts, os.path.join(out, "tokenizer"))
    return paths


if __name__ == "__main__":
    print(json.dumps(make(sys.argv[1]), indent=1))
