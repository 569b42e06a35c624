"""The logical (layout-free) view of a training state, and back, without copies.

On disk a checkpoint holds every module's parameters over its FULL layer stack and the
optimizer state in the structure ``optimizer.init(full_params)`` gives (what the
single-device reference trainer holds), never per pipeline stage, so any checkpoint
restores into any valid layout of the same model.

Neither direction gathers anything. A module's block stack split over ``pp`` stages is
ONE global array on the module's full mesh (``layers`` over ``pp``, each stage's own
sharding inside), assembled from the stages' device buffers with
``jax.make_array_from_single_device_arrays``; restoring reads each device's slice
straight into that layout (orbax restores to target shardings, each process reading only
what its devices hold) and hands every stage its buffers the same way. Leaves that live
on one stage (``pre``, ``post``, further parts) keep that stage's sharding.

Each leaf is saved in the dtype it is held in: a frozen part's matrices in the compute
dtype (:func:`hetjax.runtime.state.stored_params`), everything else float32. A restore
reads each leaf into the dtype its trainer holds it in (orbax casts), so a checkpoint
with bf16 frozen parts resumes a float32 run (those weights exactly as the bf16 run used
them) and the other way round (the same rounding the compute cast gives). Optimizer
leaves that are not parameter-shaped (step counters, equal on every stage) travel as
host scalars and are placed on every stage.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hetjax.runtime import TrainState, slice_stage
from hetjax.runtime.placement import put_global
from hetjax.runtime.state import merge_stages

StageKey = tuple[str, int]
Logical = dict[str, Any]  # {"params": full tree, "opt_state": full-structure optax state}


# -- one stacked leaf ---------------------------------------------------------------------


def stacked_sharding(stage: NamedSharding, ndim: int, full_mesh: Any) -> NamedSharding:
    """The full-mesh sharding whose per-device shards are ``stage``'s on every stage:
    dim 0 (``layers``) over ``pp`` first, then whatever splits it inside a stage."""
    spec = list(stage.spec) + [None] * (ndim - len(stage.spec))
    inner = () if spec[0] is None else (spec[0],) if isinstance(spec[0], str) else spec[0]
    return NamedSharding(full_mesh, P(("pp", *inner), *spec[1:]))


def _assemble(shape: tuple[int, ...], sharding: NamedSharding, arrays: list) -> jax.Array:
    shards = {s.device: s.data for a in arrays for s in a.addressable_shards}
    devices = sharding.addressable_devices_indices_map(shape)
    data = [shards[d] for d in devices]  # none on a process that holds no part
    return jax.make_array_from_single_device_arrays(shape, sharding, data, dtype=arrays[0].dtype)


def _stack(arrays: list, full_mesh: Any) -> Any:
    if len(arrays) == 1:
        return arrays[0]
    a0 = arrays[0]
    shape = (sum(a.shape[0] for a in arrays), *a0.shape[1:])
    sharding = stacked_sharding(a0.sharding, len(shape), full_mesh)
    if isinstance(a0, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(shape, a0.dtype, sharding=sharding)
    return _assemble(shape, sharding, arrays)


# -- per-stage trees <-> full trees -------------------------------------------------------


def merge(graph: Any, per_stage: Mapping[StageKey, Any], meshes: Mapping[str, Any]) -> dict:
    """Per-stage parameter-shaped trees -> one tree keyed by part, full layer stacks
    (each stacked leaf ONE global array on its module's mesh)."""
    return merge_stages(graph, per_stage, lambda name, xs: _stack(xs, meshes[name].mesh))


def split(spec: Any, stage: int, full: Mapping[str, Any], like: Any) -> Any:
    """Stage ``stage``'s part of a restored full tree, shaped and sharded like ``like``."""

    def take(a, start, stop):
        return a  # stacked leaves are cut below, by their devices

    mine = slice_stage(spec, stage, full, take=take)
    return jax.tree.map(
        lambda a, l: a if a.shape == l.shape else _assemble(l.shape, l.sharding, [a]), mine, like
    )


def _params_like(keys: set) -> Callable[[Any], bool]:
    return lambda x: isinstance(x, dict) and bool(keys) and set(x) == keys


def _flatten(tree: Any, keys: set) -> tuple[list, Any, list[bool]]:
    """Flattens keeping parameter-shaped subtrees (dicts keyed ``keys``) whole."""
    is_params = _params_like(keys)
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_params)
    return leaves, treedef, [is_params(x) for x in leaves]


def merge_opt(graph, params, opt_states, meshes, scalar: Callable) -> Any:
    """Per-stage optimizer states -> the same optimizer's state over the full tree."""
    keys = list(opt_states)
    flat = {k: _flatten(opt_states[k], set(params[k])) for k in keys}
    leaves0, treedef, marks = flat[keys[0]]
    out = [
        merge(graph, {k: flat[k][0][i] for k in keys}, meshes) if m else scalar(leaves0[i])
        for i, m in enumerate(marks)
    ]
    return jax.tree.unflatten(treedef, out)


def split_opt(spec, stage, full_opt, full_keys: set, like_params, like_opt) -> Any:
    """One stage's optimizer state from the full-structure one (``like_*``: its targets)."""
    leaves, _, marks = _flatten(full_opt, full_keys)
    like_leaves, treedef, like_marks = _flatten(like_opt, set(like_params))
    assert marks == like_marks, "optimizer state structures differ"
    out = [
        split(spec, stage, leaf, like) if m else put_global(np.asarray(leaf), like.sharding)
        for leaf, like, m in zip(leaves, like_leaves, marks, strict=True)
    ]
    return jax.tree.unflatten(treedef, out)


# -- whole trainers -----------------------------------------------------------------------


def _host_target(x: Any) -> np.ndarray:
    return np.zeros(x.shape, x.dtype)


def _trained(ex: Any, per_stage: Mapping[StageKey, Any]) -> dict[StageKey, Any]:
    """The trainable parts of the stages that train any (what optimizer state covers:
    frozen parts have none, so the full-tree state is that of the trainable tree)."""
    return {
        k: ex.programs[k].trainable_of(v) for k, v in per_stage.items() if ex.programs[k].trainable
    }


def trained_parts(trainer: Any) -> list[str]:
    """The part names ``trainer`` trains (an executor's or a reference trainer's), sorted:
    what its optimizer state covers."""
    programs = getattr(trainer, "programs", None)
    if programs is None:
        return sorted(trainer.trainable_keys)
    return sorted({n for p in programs.values() for n in p.trainable})


def _merged_opt(ex: Any, params: Mapping[StageKey, Any], opt: Mapping, scalar) -> Any:
    trained = _trained(ex, params)
    return merge_opt(ex.graph, trained, {k: opt[k] for k in trained}, ex.meshes, scalar)


def executor_logical(ex: Any) -> Logical:
    """The executor's state as logical global arrays (views of its buffers)."""
    params = ex.state.params
    return {
        "params": merge(ex.graph, params, ex.meshes),
        "opt_state": _merged_opt(ex, params, ex.state.opt_state, lambda x: x),
    }


def executor_targets(ex: Any) -> Logical:
    """What restoring into ``ex`` reads: shapes and the new layout's shardings."""
    params, opt = ex.abstract_state()
    return {
        "params": merge(ex.graph, params, ex.meshes),
        "opt_state": _merged_opt(ex, params, opt, _host_target),
    }


def executor_state(ex: Any, logical: Logical, step: int) -> TrainState:
    """Restored logical arrays -> the executor's per-stage :class:`TrainState`."""
    like_params, like_opt = ex.abstract_state()
    full_keys = {n for p in ex.programs.values() for n in p.trainable}
    params, opt_state = {}, {}
    for key in like_params:
        spec, prog = ex.graph.module(key[0]), ex.programs[key]
        params[key] = split(spec, key[1], logical["params"], like_params[key])
        opt_state[key] = (
            split_opt(
                spec,
                key[1],
                logical["opt_state"],
                full_keys,
                prog.trainable_of(like_params[key]),
                like_opt[key],
            )
            if prog.trainable
            else ()
        )
    return TrainState(params, opt_state, step)


def reference_logical(trainer: Any) -> Logical:
    return {"params": trainer.params, "opt_state": trainer.opt_state}


def reference_targets(trainer: Any) -> Logical:
    keys = set(trainer.trainable_keys)

    def target(x, params_like):
        if params_like:
            return jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), x
            )
        return _host_target(x)

    leaves, treedef, marks = _flatten(trainer.opt_state, keys)
    opt = jax.tree.unflatten(treedef, [target(x, m) for x, m in zip(leaves, marks, strict=True)])
    return {"params": target(trainer.params, True), "opt_state": opt}


def reference_state(trainer: Any, logical: Logical) -> tuple[Any, Any]:
    keys = set(trainer.trainable_keys)
    replicated = jax.tree.leaves(trainer.params)[0].sharding
    leaves, treedef, marks = _flatten(logical["opt_state"], keys)
    opt = [
        x if m else put_global(np.asarray(x), replicated)
        for x, m in zip(leaves, marks, strict=True)
    ]
    return logical["params"], jax.tree.unflatten(treedef, opt)
