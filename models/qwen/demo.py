"""A small Qwen2.5-VL data set made on the spot: images of odd sizes, videos as frame
folders, LLaVA-format records, and a byte-level BPE tokenizer with Qwen's special tokens.

Images are :func:`models.llava.demo.draw`'s shapes at sizes from 30 to 90 pixels a side
(so :func:`models.qwen.processor.smart_resize` rounds and scales them differently); a
video is 4 to 8 frames of a shape moving left or right. Records mix one image, two
images, a video with a question about the motion, and text only.

``python -m models.qwen.demo OUT_DIR`` writes ``OUT_DIR/train.json``, ``OUT_DIR/media/``
and ``OUT_DIR/tokenizer/``; with ``--video-files`` the videos are MPEG-4 files at 2 fps
(PyAV, ``pip install 'hetjax[video]'``) instead of frame folders, the same frames.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from models.llava.demo import COLORS, NUMBERS, SHAPES, draw

from .template import DEFAULT_SYSTEM, SPECIAL

SPECIALS = ["<|endoftext|>", *SPECIAL.values()]


def video(path: str, color: str, rng: np.random.Generator, *, file: bool = False) -> str:
    """A square of ``color`` moving left or right, as a frames folder ``path`` or (``file``)
    an MPEG-4 file ``path`` at 2 fps (its width rounded up to even, as the codec needs);
    returns the way."""
    from PIL import Image, ImageDraw

    frames, way = int(rng.integers(4, 9)), ("left", "right")[rng.integers(2)]
    w, h = 40 + int(rng.integers(0, 30)), 36
    images = []
    for f in range(frames):
        im = Image.new("RGB", (w + w % 2 if file else w, h), (128, 128, 128))
        x = 4 + f * (w - 16) // frames
        x = x if way == "right" else w - 12 - x
        ImageDraw.Draw(im).rectangle((x, 12, x + 8, 20), fill=COLORS[color])
        images.append(im)
    if file:
        import av

        with av.open(path, "w") as container:
            stream = container.add_stream("mpeg4", rate=2)
            stream.width, stream.height, stream.pix_fmt = images[0].size + ("yuv420p",)
            for im in images:
                container.mux(stream.encode(av.VideoFrame.from_image(im)))
            container.mux(stream.encode())
        return way
    os.makedirs(path, exist_ok=True)
    for f, im in enumerate(images):
        im.save(os.path.join(path, f"{f:04d}.png"))
    return way


def records(out: str, n: int, seed: int, *, video_files: bool = False) -> list[dict]:
    """``n`` records whose media are written under ``out/media`` (videos as files with
    ``video_files``)."""
    rng = np.random.default_rng(seed)
    media = os.path.join(out, "media")
    os.makedirs(media, exist_ok=True)
    recs = []
    for i in range(n):
        kind, rid = int(rng.integers(4)), f"r{i}"

        def image(tag: str, rid: str = rid) -> tuple[str, str]:
            color, shape = list(COLORS)[rng.integers(4)], SHAPES[rng.integers(3)]
            draw(
                os.path.join(media, f"{rid}{tag}.png"), color, shape, rng, int(rng.integers(30, 90))
            )
            return f"{rid}{tag}.png", color

        turn = lambda who, value: {"from": who, "value": value}  # noqa: E731
        if kind == 0:
            name, color = image("")
            conv = [turn("human", "<image>\nWhat color is the shape?"), turn("gpt", color)]
            recs.append({"id": rid, "image": name, "conversations": conv})
        elif kind == 1:
            (a, ca), (b, cb) = image("a"), image("b")
            conv = [turn("human", "<image><image>Same color?"), turn("gpt", f"{ca} and {cb}")]
            recs.append({"id": rid, "image": [a, b], "conversations": conv})
        elif kind == 2:
            color = list(COLORS)[rng.integers(4)]
            name = f"{rid}.mp4" if video_files else rid
            way = video(os.path.join(media, name), color, rng, file=video_files)
            conv = [turn("human", "<video>\nWhere does it move?"), turn("gpt", way)]
            recs.append({"id": rid, "video": name, "conversations": conv})
        else:
            a, b = int(rng.integers(5)), int(rng.integers(5))
            conv = [turn("human", f"{NUMBERS[a]} plus {NUMBERS[b]}?"), turn("gpt", NUMBERS[a + b])]
            recs.append({"id": rid, "conversations": conv})
    return recs


def train_tokenizer(texts: list[str], out_dir: str, vocab_size: int = 400) -> str:
    """A byte-level BPE ``tokenizer.json`` (Qwen's kind) with Qwen2-VL's special tokens
    added, and a ``tokenizer_config.json`` like Qwen's (no BOS, ``<|im_end|>`` ends a
    turn, ``<|endoftext|>`` pads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, f)
    return out_dir


def make(out: str, *, train: int = 64, seed: int = 0, video_files: bool = False) -> dict[str, str]:
    """Writes the data set; returns the paths (``train``, ``media``, ``tokenizer``)."""
    os.makedirs(out, exist_ok=True)
    recs = records(out, train, seed, video_files=video_files)
    paths = {"train": os.path.join(out, "train.json"), "media": os.path.join(out, "media")}
    with open(paths["train"], "w") as f:
        json.dump(recs, f, indent=1)
    texts = [t["value"] for r in recs for t in r["conversations"]]
    texts += [DEFAULT_SYSTEM, "system\nuser\nassistant\n"] * 20
    paths["tokenizer"] = train_tokenizer(texts, os.path.join(out, "tokenizer"))
    return paths


if __name__ == "__main__":
    print(json.dumps(make(sys.argv[1], video_files="--video-files" in sys.argv[2:]), indent=1))
