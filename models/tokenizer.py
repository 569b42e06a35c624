"""Byte-level tokenizer with a few special tokens; nothing to download.

Ids 0-255 are raw UTF-8 bytes; then PAD, BOS, EOS and one placeholder per modality.
The vocabulary is padded to ``models.config.TOKENIZER_VOCAB`` (a multiple of 64) so a
vocabulary-parallel embedding splits evenly.
"""

from __future__ import annotations

PAD, BOS, EOS, IMAGE, AUDIO = 256, 257, 258, 259, 260
PLACEHOLDERS = {"image": IMAGE, "audio": AUDIO}
_TAGS = {"<image>": IMAGE, "<audio>": AUDIO}


def encode(text: str, *, tokens_per_tag: dict[str, int] | None = None) -> list[int]:
    """UTF-8 bytes; each ``<image>`` / ``<audio>`` tag becomes N placeholder ids.

    Args:
        text: the prompt or answer.
        tokens_per_tag: modality -> number of placeholder positions (``{"image": 16}``).
    """
    tokens_per_tag = tokens_per_tag or {}
    ids: list[int] = []
    rest = text
    while rest:
        tag = next((t for t in _TAGS if rest.startswith(t)), None)
        if tag is None:
            ids.extend(rest[0].encode("utf-8"))
            rest = rest[1:]
            continue
        modality = tag[1:-1]
        if modality not in tokens_per_tag:
            raise ValueError(f"text has {tag} but the model has no {modality} encoder")
        ids.extend([_TAGS[tag]] * tokens_per_tag[modality])
        rest = rest[len(tag) :]
    return ids


def decode(ids: list[int]) -> str:
    """Inverse of :func:`encode` for bytes; placeholders print as tags, PAD/BOS/EOS dropped."""
    out, buf = [], bytearray()
    for i in ids:
        if i < 256:
            buf.append(i)
            continue
        out.append(buf.decode("utf-8", errors="replace"))
        buf = bytearray()
        out.append({IMAGE: "<image>", AUDIO: "<audio>"}.get(i, ""))
    out.append(buf.decode("utf-8", errors="replace"))
    return "".join(out)
