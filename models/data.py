"""A deterministic synthetic LLaVA-style instruction dataset.

Each sample is an image (a coloured square in one quadrant of a noisy dark canvas),
optionally an audio clip (a tone of one of four pitches), a prompt with ``<image>``
(and ``<audio>``) placeholders and a question, and an answer that is a function of the
media content: the square's colour and/or position (and the tone's pitch). A model that
ignores its encoder can only learn the answer *format*; one that uses it can drive the
answer loss towards zero.

Like LLaVA instruction tuning, only answer tokens (and the closing EOS) are supervised.
Samples are generated from ``numpy.random.default_rng([seed, index])``, so sample
``index`` is the same whatever the batch size, step or process that asks for it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from models import tokenizer
from models.config import TOKENIZER_VOCAB, MLLMConfig

COLORS = {
    "red": (1.0, 0.1, 0.1),
    "green": (0.1, 1.0, 0.1),
    "blue": (0.1, 0.1, 1.0),
    "yellow": (1.0, 1.0, 0.1),
}
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
PITCHES = ("low", "mid", "high", "shrill")

# The longest answer content of each kind (what bounds a sample's length).
LONGEST = {
    "color": max(COLORS, key=len),
    "position": max(POSITIONS, key=len),
    "pitch": max(PITCHES, key=len),
}

# (question, answer template); answers use {color}, {position}, {pitch}.
IMAGE_TASKS = (
    ("What color?", "{color}"),
    ("Where is it?", "{position}"),
    ("Describe.", "{color}, {position}"),
)
AUDIO_TASKS = (
    ("What pitch?", "{pitch}"),
    ("Describe all.", "{color}, {position}, {pitch}"),
)


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
    """What the synthetic data must look like to fit a model."""

    seq_len: int  # model input length L (the stored sequence has L + 1 tokens)
    image_size: int = 16  # square image side
    channels: int = 3
    image_tokens: int = 0  # placeholder positions per image (0: no image modality)
    audio_frames: int = 32
    audio_frame_dim: int = 16
    audio_tokens: int = 0  # placeholder positions per clip (0: no audio modality)
    seed: int = 0
    image_token_id: int = tokenizer.IMAGE  # the model's image placeholder id
    max_images: int = 1  # image slots per sample; above 1 a sample has 0 to max_images
    # images (uniform; images [B, K, H, W, C], unused slots zero), as multi-image data

    @classmethod
    def for_model(
        cls, cfg: MLLMConfig, *, seq_len: int, seed: int, max_images: int = 1
    ) -> SyntheticConfig:
        if cfg.llm.vocab < TOKENIZER_VOCAB:
            raise ValueError(
                f"the synthetic data's byte tokenizer needs a vocabulary of {TOKENIZER_VOCAB} "
                f"ids, the model has {cfg.llm.vocab}; train a model with a larger vocabulary"
            )
        v, a = cfg.vision, cfg.audio
        return cls(
            seq_len=seq_len,
            image_size=v.image_size if v else 16,
            channels=v.channels if v else 3,
            image_tokens=v.num_tokens if v else 0,
            audio_frames=a.frames if a else 32,
            audio_frame_dim=a.frame_dim if a else 16,
            audio_tokens=a.num_tokens if a else 0,
            seed=seed,
            image_token_id=tokenizer.IMAGE if cfg.image_token_id is None else cfg.image_token_id,
            max_images=max_images,
        )

    @property
    def tasks(self) -> tuple[tuple[str, str], ...]:
        return IMAGE_TASKS + (AUDIO_TASKS if self.audio_tokens else ())

    def prompt(self, question: str, images: int = 1) -> str:
        tags = ("<image>" * images if self.image_tokens else "") + (
            "<audio>" if self.audio_tokens else ""
        )
        return f"{tags}\n{question}\n"

    def _tokens_per_tag(self) -> dict[str, int]:
        return {"image": self.image_tokens, "audio": self.audio_tokens}

    def max_sample_tokens(self) -> int:
        """Longest BOS + prompt + answer + EOS over all tasks and contents."""
        return max(
            2
            + len(
                tokenizer.encode(
                    self.prompt(q, self.max_images), tokens_per_tag=self._tokens_per_tag()
                )
            )
            + len(tokenizer.encode(a.format(**LONGEST)))
            for q, a in self.tasks
        )

    def max_supervised_tokens(self) -> int:
        """The most loss-mask positions a sample has: its longest answer and the EOS (an
        exact bound: the loss head's default per-row budget on synthetic data)."""
        return max(len(tokenizer.encode(a.format(**LONGEST))) for _, a in self.tasks) + 1

    def validate(self) -> None:
        if self.max_images < 1:
            raise ValueError(f"max_images={self.max_images} must be at least 1")
        if self.seed < 0:  # numpy.random.default_rng([seed, index]) rejects it mid-run
            raise ValueError(
                f"seed={self.seed}: the data seed must be a non-negative integer; "
                f"use e.g. seed={-self.seed}"
            )
        need = self.max_sample_tokens()
        if self.seq_len + 1 < need:
            raise ValueError(
                f"seq_len={self.seq_len} is too short: samples need up to {need} tokens "
                f"({self.image_tokens} image + {self.audio_tokens} audio placeholder tokens, "
                f"prompt, answer, BOS and EOS), which is {need - 1} inputs once the targets "
                f"are shifted by one; use seq_len={need - 1} or more"
            )


class SyntheticLlava:
    """Deterministic batches: ``dataset.batch(step, global_batch)`` -> dict of numpy arrays.

    Keys: ``tokens``/``targets``/``loss_mask`` ``[B, L]`` (int32, int32, float32);
    ``images`` ``[B, H, W, C]`` and/or ``audio`` ``[B, T, F]`` (float32).
    """

    def __init__(self, config: SyntheticConfig):
        config.validate()
        self.config = config

    def sample(self, index: int) -> dict[str, np.ndarray]:
        c = self.config
        rng = np.random.default_rng([c.seed, index])
        color = list(COLORS)[rng.integers(len(COLORS))]
        quadrant = int(rng.integers(4))
        pitch = int(rng.integers(len(PITCHES)))
        task = int(rng.integers(len(c.tasks)))
        out: dict[str, np.ndarray] = {}
        if c.image_tokens:
            out["images"] = self._image(rng, color, quadrant)
        if c.audio_tokens:
            out["audio"] = self._audio(rng, pitch)
        question, answer = c.tasks[task]
        images = 1
        if c.image_tokens and c.max_images > 1:  # 0 to max_images images, slots zero-padded
            images = int(rng.integers(c.max_images + 1))
            slots = np.zeros((c.max_images, *out["images"].shape), np.float32)
            for k in range(images):
                slots[k] = out["images"] if k == 0 else self._image(rng, color, quadrant)
            out["images"] = slots
        prompt = c.prompt(question, images)
        prompt_ids = tokenizer.encode(prompt, tokens_per_tag=c._tokens_per_tag())
        answer_ids = tokenizer.encode(
            answer.format(color=color, position=POSITIONS[quadrant], pitch=PITCHES[pitch])
        )
        seq = [tokenizer.BOS, *prompt_ids, *answer_ids, tokenizer.EOS]
        supervised = np.zeros(c.seq_len + 1, np.float32)
        supervised[1 + len(prompt_ids) : len(seq)] = 1.0  # answer bytes + EOS
        seq += [tokenizer.PAD] * (c.seq_len + 1 - len(seq))
        ids = np.asarray(seq, np.int32)
        ids[ids == tokenizer.IMAGE] = c.image_token_id
        out.update(tokens=ids[:-1], targets=ids[1:], loss_mask=supervised[1:])
        return out

    def _image(self, rng: np.random.Generator, color: str, quadrant: int) -> np.ndarray:
        c = self.config
        s = c.image_size
        img = rng.normal(0.0, 0.1, (s, s, c.channels)).astype(np.float32)
        half, margin = s // 2, max(1, s // 8)
        top, left = (quadrant // 2) * half + margin, (quadrant % 2) * half + margin
        rgb = np.resize(np.asarray(COLORS[color], np.float32), c.channels)
        img[top : top + half - 2 * margin, left : left + half - 2 * margin] += rgb
        return img

    def _audio(self, rng: np.random.Generator, pitch: int) -> np.ndarray:
        c = self.config
        t = np.arange(c.audio_frames, dtype=np.float32)[:, None]
        bins = np.arange(c.audio_frame_dim, dtype=np.float32)[None, :]
        centre = (pitch + 0.5) * c.audio_frame_dim / len(PITCHES)
        envelope = 0.5 + 0.5 * np.sin(t * (pitch + 1) * 0.4)
        clip = envelope * np.exp(-0.5 * np.square(bins - centre))
        return (clip + rng.normal(0.0, 0.1, clip.shape)).astype(np.float32)

    def batch(self, step: int, global_batch: int) -> dict[str, np.ndarray]:
        """The global batch of ``step``: samples ``[step * B, (step + 1) * B)``."""
        samples = [self.sample(step * global_batch + i) for i in range(global_batch)]
        return {k: np.stack([s[k] for s in samples]) for k in samples[0]}
