"""The training state as one pytree, and the per-stage <-> full parameter views.

:class:`TrainState` is what the executor owns between steps: each pipeline stage's
parameters and optimizer state (keyed ``(module, stage)``) and the step count. It is a
pytree, so ``jax.device_get``, ``jax.tree.map`` and orbax handle it as is; the executor
returns it (:attr:`Executor.state`) and can be given one (``Executor(..., state=...)``).

:func:`slice_stage` cuts a module's full parameter tree into one stage's part;
:func:`full_params` is its inverse, gathering every stage back into the single-device
layout (the form checkpoints and the reference trainer use).

:func:`stored_params` says how a stage holds its parameters: trained parts as float32
masters, frozen parts' matrices in the compute dtype (a frozen part has no gradient and
no optimizer state, so a float32 master would only ever be cast before use).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hetjax.runtime.graph import ModuleSpec, TrainGraph
from hetjax.runtime.optim import decay_mask

StageKey = tuple[str, int]  # (module name, pipeline stage index)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Per-stage parameters and optimizer states, and the number of steps taken."""

    params: dict[StageKey, Any]  # (module, stage) -> that stage's parameter tree
    opt_state: dict[StageKey, Any]  # (module, stage) -> its optax state
    step: int = 0  # optimiser steps applied so far


def _rows(a: Any, start: int, stop: int) -> Any:
    if hasattr(a, "rows"):  # a lazy leaf (models.hf.LazyTensor): cut without reading
        return a.rows(start, stop)
    return a[start:stop] if hasattr(a, "shape") else a


def slice_stage(
    spec: ModuleSpec,
    stage: int,
    full: Mapping[str, Any],
    *,
    take: Callable[[Any, int, int], Any] = _rows,
) -> dict[str, Any]:
    """Stage ``stage``'s part of a full parameter (or logical-axes) tree of ``spec``.

    The first stage holds the main part's ``pre``, every stage its own block range, the
    last stage the main part's ``post`` and all further parts (e.g. the projector).
    ``take(leaf, start, stop)`` cuts a stacked leaf to the stage's layers. Parts that
    ``full`` leaves out (frozen ones, in an optimizer state's view) are left out too.
    """
    main = spec.parts[0]
    first, last = stage == 0, stage == spec.layout.pp - 1
    start, stop = spec.stage_layers(stage)
    sliced: dict[str, Any] = {}
    if main.name in full:
        sliced[main.name] = _slice_main(full[main.name], first, last, start, stop, take)
    if last:
        sliced.update({p.name: full[p.name] for p in spec.parts[1:] if p.name in full})
    return sliced


def _slice_main(main: Mapping[str, Any], first, last, start, stop, take) -> dict[str, Any]:
    own: dict[str, Any] = {}
    for part, tree in main.items():
        if part == "pre" and first or part == "post" and last:
            own[part] = tree
        elif part == "blocks":
            own[part] = jax.tree.map(
                lambda a: take(a, start, stop), tree, is_leaf=lambda x: isinstance(x, tuple)
            )
    return own


def merge_stages(
    graph: TrainGraph,
    per_stage: Mapping[StageKey, Any],
    stack: Callable[[str, list], Any],
) -> dict[str, Any]:
    """Per-stage parameter-shaped trees -> one tree keyed by part name, the inverse of
    :func:`slice_stage` over all stages: ``pre`` from the first stage, ``post`` and further
    parts from the last, and each ``blocks`` leaf joined over the stages in order by
    ``stack(module name, [leaf of stage 0, 1, ...])``. Parts that the trees leave out
    (frozen ones, in an optimizer state's view) are left out of the result too."""
    out: dict[str, Any] = {}
    for spec in graph.modules:
        main = spec.parts[0]
        trees = [per_stage.get((spec.name, s), {}) for s in range(spec.layout.pp)]
        if all(main.name in t for t in trees):
            out[main.name] = _merge_main([t[main.name] for t in trees], spec.name, stack)
        for part in spec.parts[1:]:
            if part.name in trees[-1]:
                out[part.name] = trees[-1][part.name]
    return out


def _merge_main(stages: list[Any], name: str, stack: Callable[[str, list], Any]) -> Any:
    tree = {}
    if "pre" in stages[0]:
        tree["pre"] = stages[0]["pre"]
    if "blocks" in stages[0]:
        tree["blocks"] = jax.tree.map(
            lambda *xs: stack(name, list(xs)), *[s["blocks"] for s in stages]
        )
    if "post" in stages[-1]:
        tree["post"] = stages[-1]["post"]
    return tree


def full_params(graph: TrainGraph, params: Mapping[StageKey, Any]) -> dict[str, Any]:
    """Every stage's parameters gathered into the single-device layout (host numpy)."""
    host = {key: jax.device_get(tree) for key, tree in params.items()}
    return merge_stages(graph, host, lambda _, xs: np.concatenate(xs))


# Matrices that the models read in float32 whatever the compute dtype: an MoE router's
# logits (hetjax.ops.moe routes in float32). They stay float32 when frozen.
FLOAT32_READS = ("router",)


def stored_params(
    abstract: dict[str, Any], axes: dict[str, Any], frozen: Any, dtype: Any | None
) -> dict[str, Any]:
    """A stage's parameters as it holds them: ``abstract`` (``ShapeDtypeStruct`` s of a
    stage-shaped tree) with the matrices of the ``frozen`` parts in ``dtype``.

    A frozen part's matrices (two or more non-``layers`` logical axes, the leaves weight
    decay selects: kernels, embedding tables, position tables) are read only through a
    cast to the compute dtype (``Dense``, the embedding lookup, the encoders' tables), so
    holding that cast instead of a float32 master gives a bit-identical forward and
    backward at half the bytes (bfloat16). Vectors (norm scales, biases) are read in
    float32 by the norms and are a negligible share: they stay float32, as do the
    :data:`FLOAT32_READS` matrices. ``dtype`` None (or float32): nothing changes.
    """
    if dtype is None or jnp.dtype(dtype) == jnp.float32:
        return abstract
    dtype = jnp.dtype(dtype)
    matrices = decay_mask(axes)

    def store(path, a, matrix):
        name = jax.tree_util.keystr(path)
        cast = matrix and a.dtype == jnp.float32 and not any(n in name for n in FLOAT32_READS)
        return jax.ShapeDtypeStruct(a.shape, dtype) if cast else a

    return {
        part: jax.tree.map_with_path(store, tree, matrices[part]) if part in frozen else tree
        for part, tree in abstract.items()
    }


class Cast:
    """A host array-like read in ``dtype``: what :func:`~hetjax.runtime.placement.put_global`
    places for a leaf held in another dtype than its value's. Slices are read and cast
    one shard at a time, so a lazy leaf (``models.hf.LazyTensor``) stays lazy."""

    def __init__(self, value: Any, dtype: Any):
        self.value, self.dtype, self.shape = value, jnp.dtype(dtype), tuple(value.shape)

    def __getitem__(self, idx: Any) -> np.ndarray:
        # numpy's bfloat16 (ml_dtypes) rounds to nearest even, as XLA's convert does.
        return np.asarray(self.value[idx]).astype(self.dtype)


def as_stored(value: Any, like: Any) -> Any:
    """``value`` to place as the leaf ``like`` (its dtype): as it is, or :class:`Cast`."""
    if jnp.dtype(value.dtype) == like.dtype:
        return value
    if isinstance(value, jax.Array):
        value = np.asarray(value)  # one host copy; each shard then casts its slice
    return Cast(value, like.dtype)
