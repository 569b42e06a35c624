"""Reading a LLaVA checkpoint, or separate CLIP/SigLIP and Llama ones, into hetjax params.

Reading uses ``safetensors`` and is lazy: with ``lazy=True`` the leaves are
:class:`~models.hf.lazy.LazyTensor` views that read only the slices asked for. Only
CLIP's and SigLIP's fused q/k/v kernels and patch kernels, small next to the LLM, are read
whole per layer. Tensors LLaVA never uses (the last CLIP layer, ``post_layernorm``,
SigLIP's pooling head) are not loaded; :class:`LoadReport` names them.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.mllm import MLLM

from .configs import llava_config_of
from .errors import HFError
from .files import Files, Tensors, component, read_config
from .lazy import LazyTensor
from .rules import hf_shapes, read_leaf, rules_for


def _load_module(model: MLLM, module: str, tensors: Tensors, *, lazy: bool) -> dict:
    """One module's parameter tree read from ``tensors`` (a dict of parts)."""
    abstract = model.modules[module].abstract_params()
    channels = model.config.vision.channels if model.config.vision else 3
    files = tensors.files
    out: dict[str, Any] = {}
    for path, rule in rules_for(model, module).items():
        part, *keys = path.split(".")
        node = abstract[part]
        for k in keys:
            node = node[k]
        stacked = part == "blocks"
        shape = tuple(node.shape[1:] if stacked else node.shape)
        layers = range(node.shape[0]) if stacked else [None]
        per_layer = []
        for i in layers:
            names = [tensors.get(n.format(i=i)) for n in rule.names]
            _check_shapes(rule, names, shape, files, channels, module, path)
            per_layer.append(
                read_leaf(
                    dataclasses.replace(rule, names=tuple(names)), files.read, shape, channels
                )
            )
        if stacked:
            full = (len(per_layer), *shape)
            leaf = LazyTensor(
                full,
                lambda idx, per_layer=per_layer: np.stack(
                    [per_layer[i](idx[1:]) for i in range(idx[0].start, idx[0].stop)]
                ).reshape(idx[0].stop - idx[0].start, *[s.stop - s.start for s in idx[1:]]),
            )
        else:
            leaf = LazyTensor(shape, per_layer[0])
        target = out.setdefault(part, {})
        for k in keys[:-1]:
            target = target.setdefault(k, {})
        target[keys[-1]] = leaf if lazy else np.asarray(leaf)
    return out


def _check_shapes(rule, names, shape, files: Files, channels, module, path) -> None:
    if rule.kind == "patch":
        p = int(round((shape[0] / channels) ** 0.5))
        expected = [(shape[1], channels, p, p)]
    else:
        expected = hf_shapes(rule, shape)
    for name, want in zip(names, expected, strict=True):
        got = files.shape(name)
        if tuple(got) != tuple(want):
            raise HFError(
                f"{files.path}: tensor {name!r} has shape {tuple(got)}, the config needs "
                f"{tuple(want)} (for {module}.{path})"
            )


def _used(model: MLLM, module: str, tensors: Tensors) -> set[str]:
    abstract = model.modules[module].abstract_params()
    depth = jax.tree.leaves(abstract.get("blocks", {"": np.zeros((0,))}))[0].shape[0]
    used = set()
    for path, rule in rules_for(model, module).items():
        layers = range(depth) if path.startswith("blocks.") else [0]
        used |= {tensors.names.get(n.format(i=i)) for n in rule.names for i in layers}
    return used


@dataclasses.dataclass
class LoadReport:
    """What a load read: each module's source, and the stored tensors it did not use."""

    sources: dict[str, str] = dataclasses.field(default_factory=dict)
    unused: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # per directory

    def lines(self) -> list[str]:
        by_source: dict[str, list[str]] = {}
        for module, src in self.sources.items():
            by_source.setdefault(src, []).append(module)
        out = []
        for src, modules in by_source.items():
            skipped = self.unused.get(src, [])
            note = f"; {len(skipped)} tensors unused (e.g. {skipped[0]})" if skipped else ""
            out.append(f"init: {', '.join(modules)} from {src}{note}")
        return out


def load(
    path: str | os.PathLike, *, lazy: bool = False, dtype: Any = jnp.float32
) -> tuple[MLLM, dict[str, Any]]:
    """A LLaVA (or Qwen2.5-VL: a :class:`models.qwen.QwenVL`) checkpoint directory ->
    ``(model, params)``; the model config comes from its ``config.json``. ``lazy=True``:
    :class:`LazyTensor` leaves (read on placement)."""
    if read_config(pathlib.Path(path)).get("model_type") == "qwen2_5_vl":
        from .qwen import load_qwen

        return load_qwen(pathlib.Path(path), lazy=lazy, dtype=dtype)
    model = MLLM(llava_config_of(path), dtype=dtype)
    params, _ = read_llava(model, path, lazy=lazy)
    return model, params


def read_llava(
    model: MLLM, path: str | os.PathLike, *, lazy: bool = False
) -> tuple[dict[str, Any], LoadReport]:
    """``model``'s parameters from a LLaVA checkpoint directory, and what was read."""
    path = pathlib.Path(path)
    files = Files(path)
    report, params = LoadReport(), {}
    used: set[str] = set()
    for module in ("vision", "projector", "llm"):
        tensors = component(files, module, inside_llava=True)
        params[module] = _load_module(model, module, tensors, lazy=lazy)
        used |= _used(model, module, tensors)
        report.sources[module] = str(path)
    report.unused[str(path)] = sorted(set(files.where) - used)
    return params, report


def read_parts(
    model: MLLM,
    dirs: Mapping[str, str | os.PathLike],
    *,
    key: jax.Array,
    lazy: bool = False,
) -> tuple[dict[str, Any], LoadReport]:
    """``model``'s parameters: the modules in ``dirs`` from their checkpoints, the others
    (e.g. the projector) freshly initialised from ``key`` as :meth:`MLLM.init` does."""
    fresh = model.init(key)
    params = {k: v for k, v in fresh.items() if k not in dirs}
    report = LoadReport()
    for module, d in dirs.items():
        files = Files(pathlib.Path(d))
        tensors = component(files, module, inside_llava=False)
        params[module] = _load_module(model, module, tensors, lazy=lazy)
        report.sources[module] = str(d)
        report.unused[str(d)] = sorted(set(files.where) - _used(model, module, tensors))
    for module in fresh:
        report.sources.setdefault(module, "a fresh initialisation")
    return params, report
