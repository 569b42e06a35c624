"""Hugging Face tokenizers and LLaVA's chat templates: conversation -> ids + loss mask.

:class:`HFTokenizer` loads any ``tokenizer.json`` (Llama, Vicuna, Mistral, Qwen, ...)
through the ``tokenizers`` library, with the special tokens of ``tokenizer_config.json``
beside it. :func:`render` writes a conversation as ONE string in the template's format
and tokenizes the text between ``<image>`` tags whole (LLaVA's ``tokenizer_image_token``
splits there too; a turn is never tokenized apart from its neighbours, so ids are what
the tokenizer gives for the running text), then marks a token supervised when its
character span overlaps an assistant reply or the end-of-turn marker after it; every
other token (system prompt, user turns, role headers, image placeholders, BOS) is not.

Templates (as in LLaVA's ``conversation.py``):

* ``plain`` (pretraining): ``<image>...`` then the caption and ``\\n``; user text other
  than its ``<image>`` tags is dropped, the caption and ``\\n`` are supervised.
* ``vicuna_v1`` (LLaVA-1.5 instruction tuning): ``SYSTEM USER: q ASSISTANT: a</s>USER:``
  ...; ``a</s>`` supervised.
* ``llama3``: ``<|start_header_id|>role<|end_header_id|>\\n\\n text<|eot_id|>`` per turn;
  the reply and its ``<|eot_id|>`` supervised.
"""

from __future__ import annotations

import json
import os
from typing import Literal

import numpy as np

from models.llava.records import IMAGE_TAG, ROLES

Template = Literal["plain", "vicuna_v1", "llama3"]
TEMPLATES = ("plain", "vicuna_v1", "llama3")

VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. The assistant "
    "gives helpful, detailed, and polite answers to the user's questions."
)
LLAMA3_SYSTEM = (
    "You are a helpful language and vision assistant. You are able to understand the visual "
    "content that the user provides, and assist the user with a variety of tasks using "
    "natural language."
)


class HFTokenizer:
    """A ``tokenizer.json`` (or a directory holding one) via the ``tokenizers`` library.

    Raises:
        ValueError: one line naming the path when it does not load.
    """

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        try:
            self.tok = Tokenizer.from_file(file)
        except Exception as e:  # the Rust error text is long; keep its first line
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"tokenizer {file} does not load: {first}") from None
        cfg = _read_config(os.path.join(os.path.dirname(file), "tokenizer_config.json"))
        self.path = file
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._special(cfg.get("bos_token"), ("<s>", "<|begin_of_text|>", "<bos>"))
        if cfg.get("add_bos_token") is False:
            self.bos_id = None
        eos_names = ("</s>", "<|eot_id|>", "<|im_end|>", "<|endoftext|>", "<eos>")
        self.eos_token = _content(cfg.get("eos_token")) or next(
            (t for t in eos_names if self._id(t) is not None), None
        )
        pad = self._special(cfg.get("pad_token"), ("<pad>", "<unk>"))
        self.pad_id = pad if pad is not None else (self._id(self.eos_token) or 0)
        self.image_id = self._id(IMAGE_TAG)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.tok.token_to_id(token)

    def _special(self, given, fallbacks: tuple[str, ...]) -> int | None:
        if _content(given) is not None:
            return self._id(_content(given))
        return next((self._id(t) for t in fallbacks if self._id(t) is not None), None)

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and character offsets of ``text`` (no special tokens added)."""
        enc = self.tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets


def _read_config(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _content(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _turns(conversations: list[dict]) -> list[tuple[str, str]]:
    return [(ROLES[t["from"]], t["value"]) for t in conversations]


def format_conversation(
    conversations: list[dict], template: Template, eos: str
) -> tuple[str, list[tuple[int, int]]]:
    """The template's text and its supervised character ranges ``[start, end)``."""
    parts: list[tuple[str, bool]] = []
    turns = _turns(conversations)
    if template == "plain":
        for role, value in turns:
            if role == "assistant":
                parts.append((value + "\n", True))
            elif role == "user":
                parts.append((IMAGE_TAG * value.count(IMAGE_TAG), False))
    elif template == "vicuna_v1":
        system = next((v for r, v in turns if r == "system"), VICUNA_SYSTEM)
        parts.append((system + " ", False))
        for role, value in turns:
            if role == "user":
                parts.append((f"USER: {value} ASSISTANT:", False))
            elif role == "assistant":
                parts.append((f" {value}{eos}", True))
    elif template == "llama3":
        system = next((v for r, v in turns if r == "system"), LLAMA3_SYSTEM)
        head = "<|start_header_id|>{}<|end_header_id|>\n\n"
        parts.append((head.format("system") + system + "<|eot_id|>", False))
        for role, value in turns:
            if role == "user":
                parts.append((head.format("user") + value + "<|eot_id|>", False))
                parts.append((head.format("assistant"), False))
            elif role == "assistant":
                parts.append((value + "<|eot_id|>", True))
    else:
        raise ValueError(f"unknown template {template!r}; known: {', '.join(TEMPLATES)}")
    text, spans = "", []
    for piece, supervised in parts:
        if supervised:
            spans.append((len(text), len(text) + len(piece)))
        text += piece
    return text, spans


def render(
    conversations: list[dict],
    tokenizer: HFTokenizer,
    template: Template,
    *,
    image_tokens: int,
    placeholder: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids ``[n]`` (int32) and their supervision ``[n]`` (float32, 1 = in the loss).

    Each ``<image>`` becomes ``image_tokens`` copies of ``placeholder`` (the model's image
    placeholder id); BOS (when the tokenizer has one) comes first, unsupervised.
    """
    text, spans = format_conversation(conversations, template, tokenizer.eos_token or "")
    ids: list[int] = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    sup: list[float] = [0.0] * len(ids)
    pieces = text.split(IMAGE_TAG)
    offset = 0
    for k, piece in enumerate(pieces):
        if k:
            ids += [placeholder] * image_tokens
            sup += [0.0] * image_tokens
            offset += len(IMAGE_TAG)
        offset = encode_piece(tokenizer, piece, offset, spans, ids, sup)
    return np.asarray(ids, np.int32), np.asarray(sup, np.float32)


def encode_piece(
    tokenizer: HFTokenizer,
    piece: str,
    offset: int,
    spans: list[tuple[int, int]],
    ids: list[int],
    sup: list[float],
) -> int:
    """Appends ``piece``'s token ids to ``ids`` and their supervision to ``sup``: a token
    is supervised when its characters (``piece`` starts at ``offset`` of the formatted
    conversation) overlap a supervised span. Returns the offset after ``piece``."""
    piece_ids, offsets = tokenizer.encode(piece) if piece else ([], [])
    for tid, (a, b) in zip(piece_ids, offsets, strict=True):
        a, b = a + offset, max(b, a + 1) + offset
        ids.append(tid)
        sup.append(float(any(a < e and s < b for s, e in spans)))
    return offset + len(piece)
