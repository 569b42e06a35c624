"""A checkpoint directory's tensors by name: safetensors files and the key prefixes.

Key names: both the LLaVA-1.5 checkpoints people download (``vision_tower.vision_model.``,
``language_model.model.``, ``language_model.lm_head.``) and what ``transformers`` 5 writes
(``vision_tower.embeddings``, ``model.language_model.``, ``lm_head.``) are read, as the
canonical names of a standalone model (:func:`component`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import numpy as np

from .errors import HFError
from .lazy import Index


class Files:
    """The tensors of one checkpoint directory, by name, opened once with safetensors."""

    def __init__(self, path: pathlib.Path):
        from safetensors import safe_open

        self.path = path
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            if not files:
                raise HFError(f"{path}: no *.safetensors file (and no shard index)")
            weight_map = None
        self._handles: dict[str, Any] = {}
        self.where: dict[str, str] = {}
        for name in files:
            if not (path / name).exists():
                raise HFError(f"{path}: the shard index names {name}, which is missing")
            handle = safe_open(str(path / name), framework="numpy")
            self._handles[name] = handle
            for key in handle.keys():
                self.where[key] = name
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self.where))
            if missing:
                raise HFError(f"{path}: the shard index lists {missing[0]!r}, no shard has it")

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handles[self.where[key]].get_slice(key).get_shape())

    def read(self, key: str, index: Index | None = None) -> np.ndarray:
        file = self.where[key]
        part = self._handles[file].get_slice(key)
        if part.get_dtype() == "BF16":  # numpy has no bfloat16: read through JAX's dtypes
            from safetensors import safe_open

            part = safe_open(str(self.path / file), framework="flax").get_slice(key)
        out = part[index] if index else part[:]
        return np.asarray(out).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Tensors:
    """One component's tensors in a checkpoint: canonical name -> name in the file."""

    files: Files
    names: dict[str, str]  # canonical -> stored
    label: str  # for errors: "vision", "llm", ...

    def get(self, canonical: str) -> str:
        if canonical not in self.names:
            raise HFError(
                f"{self.files.path}: missing tensor {canonical!r} ({self.label}); the "
                "checkpoint does not match its config.json"
            )
        return self.names[canonical]


# Canonical names: a standalone model's keys (CLIPVisionModel / SiglipVisionModel without
# the "vision_model." level, LlamaForCausalLM, the projector without its prefix), from
# (stored prefix, canonical prefix) pairs tried in order.
_LLAVA_PREFIXES = {
    "vision": (("model.vision_tower.vision_model.", ""), ("model.vision_tower.", ""),
               ("vision_tower.vision_model.", ""), ("vision_tower.", "")),
    "projector": (("model.multi_modal_projector.", ""), ("multi_modal_projector.", "")),
    "llm": (("model.language_model.", "model."), ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head.")),
}  # fmt: skip
_PART_PREFIXES = {
    "vision": (("vision_model.", ""), ("", "")),  # CLIPModel's text_model.* stays unused
    "llm": (("model.", "model."), ("lm_head.", "lm_head.")),
}


def component(files: Files, label: str, *, inside_llava: bool) -> Tensors:
    """The tensors of module ``label`` in ``files`` under their canonical names (the
    prefixes of a LLaVA checkpoint if ``inside_llava``, else of a standalone model's)."""
    prefixes = (_LLAVA_PREFIXES if inside_llava else _PART_PREFIXES)[label]
    names: dict[str, str] = {}
    for key in files.where:
        for old, new in prefixes:
            if key.startswith(old):
                names.setdefault(new + key[len(old) :], key)
                break
    return Tensors(files, names, label)


def read_config(path: pathlib.Path) -> dict[str, Any]:
    """The ``config.json`` of checkpoint directory ``path``."""
    file = path / "config.json"
    if not file.exists():
        raise HFError(f"{path}: no config.json (give a Hugging Face checkpoint directory)")
    return json.loads(file.read_text())
