"""The ``qwen2_vl`` chat template: a conversation -> token ids and its loss mask.

ChatML as Qwen2-VL's and Qwen2.5-VL's chat template writes it::

    <|im_start|>system
    You are a helpful assistant.<|im_end|>
    <|im_start|>user
    <|vision_start|><|image_pad|>...<|vision_end|>What is it?<|im_end|>
    <|im_start|>assistant
    A cat.<|im_end|>

Each ``<image>`` (``<video>``) marker of a turn becomes ``<|vision_start|>``, one
``<|image_pad|>`` (``<|video_pad|>``) per merged token of that image (video), and
``<|vision_end|>``, in place (a LLaVA record's ``"<image>\\nWhat is it?"`` keeps its
newline, as Qwen's own fine-tuning code replaces the marker). The system turn is the
record's, or Qwen's default. Supervised: each assistant reply with its ``<|im_end|>`` and
the newline after it, as in Qwen2.5-VL's fine-tuning code (``qwen-vl-finetune``, which
masks only the ``<|im_start|>assistant\\n`` header of an assistant turn); nothing else.

Text between markers is tokenized whole (special tokens such as ``<|im_start|>`` by the
tokenizer's added tokens); the pads are inserted as ids, never tokenized.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import numpy as np

from models.llava.records import IMAGE_TAG, ROLES
from models.llava.text import HFTokenizer, encode_piece

VIDEO_TAG = "<video>"
DEFAULT_SYSTEM = "You are a helpful assistant."
SPECIAL = {
    "im_start": "<|im_start|>",
    "im_end": "<|im_end|>",
    "vision_start": "<|vision_start|>",
    "vision_end": "<|vision_end|>",
    "image_pad": "<|image_pad|>",
    "video_pad": "<|video_pad|>",
}
_MARKERS = re.compile(f"({re.escape(IMAGE_TAG)}|{re.escape(VIDEO_TAG)})")


@dataclasses.dataclass(frozen=True)
class QwenTokens:
    """The ids of the template's special tokens in one tokenizer."""

    im_start: int
    im_end: int
    vision_start: int
    vision_end: int
    image_pad: int
    video_pad: int

    @classmethod
    def of(cls, tokenizer: HFTokenizer) -> QwenTokens:
        """Looks them up.

        Raises:
            ValueError: one line naming the tokens the tokenizer lacks.
        """
        ids = {k: tokenizer.tok.token_to_id(t) for k, t in SPECIAL.items()}
        missing = [SPECIAL[k] for k, i in ids.items() if i is None]
        if missing:
            raise ValueError(
                f"tokenizer {tokenizer.path} lacks {', '.join(missing)}: the qwen2_vl template "
                "needs a Qwen2-VL tokenizer (its tokenizer.json has them as added tokens)"
            )
        return cls(**ids)


def format_conversation(conversations: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The ChatML text (markers kept) and its supervised character ranges."""
    turns = [(ROLES[t["from"]], t["value"]) for t in conversations]
    system = next((v for r, v in turns if r == "system"), DEFAULT_SYSTEM)
    start, end = SPECIAL["im_start"], SPECIAL["im_end"]
    vision = SPECIAL["vision_start"] + r"\1" + SPECIAL["vision_end"]
    text, spans = f"{start}system\n{system}{end}\n", []
    for role, value in turns:
        if role == "user":
            text += f"{start}user\n{_MARKERS.sub(vision, value)}{end}\n"
        elif role == "assistant":
            text += f"{start}assistant\n"
            spans.append((len(text), len(text) + len(value) + len(end) + 1))
            text += f"{value}{end}\n"
    return text, spans


def markers(conversations: list[dict]) -> list[str]:
    """``"image"`` / ``"video"`` per marker of the user turns, in order."""
    return [
        "image" if m == IMAGE_TAG else "video"
        for t in conversations
        if ROLES.get(t.get("from")) == "user"
        for m in _MARKERS.findall(t["value"])
    ]


def render(
    conversations: list[dict],
    tokenizer: HFTokenizer,
    tokens: QwenTokens,
    media_tokens: Sequence[int],
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids ``[n]`` (int32) and their supervision ``[n]`` (float32, 1 = in the loss).

    ``media_tokens``: the merged tokens of each marker's image or video, in
    :func:`markers` order (``t*h*w / merge**2``).

    Raises:
        ValueError: the markers and ``media_tokens`` differ in number.
    """
    text, spans = format_conversation(conversations)
    pieces = _MARKERS.split(text)  # text, marker, text, ...
    if len(pieces) // 2 != len(media_tokens):
        raise ValueError(f"{len(pieces) // 2} markers but {len(media_tokens)} token counts")
    ids: list[int] = []
    sup: list[float] = []
    offset = 0
    for k, piece in enumerate(pieces):
        if k % 2:
            pad = tokens.image_pad if piece == IMAGE_TAG else tokens.video_pad
            ids += [pad] * media_tokens[k // 2]
            sup += [0.0] * media_tokens[k // 2]
            offset += len(piece)
        else:
            offset = encode_piece(tokenizer, piece, offset, spans, ids, sup)
    return np.asarray(ids, np.int32), np.asarray(sup, np.float32)
