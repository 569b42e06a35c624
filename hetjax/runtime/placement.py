"""Where a stage's arrays live: global arrays from host values, the ZeRO-1 sharding rule,
and stand-ins for the arrays of stages on other processes' devices.

Placement is kept apart from the stage programs (:mod:`hetjax.runtime.programs`): the
feed, the transfers, the step's finish and the checkpoint restore place arrays the same
way, without a program.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hetjax.meshes import BATCH_AXES, FSDP_AXIS


def put_global(value: Any, sharding: NamedSharding) -> jax.Array:
    """A global array from a host value that every process holds; only local shards are
    built, so this works when ``sharding`` spans several processes.

    ``value`` may be a lazy array-like (``shape``, ``dtype`` and slicing that reads, e.g.
    :class:`models.hf.LazyTensor` or a numpy memmap): then only the slices of this
    process's shards are read."""
    if isinstance(value, jax.Array) or not hasattr(value, "__getitem__"):
        value = np.asarray(value)
    return jax.make_array_from_callback(
        value.shape, sharding, lambda idx: np.asarray(value[idx]), dtype=value.dtype
    )


def zero1_sharding(
    sharding: NamedSharding, shape: tuple[int, ...], axes: tuple[str, ...] = BATCH_AXES
) -> NamedSharding:
    """``sharding`` with its first unsharded, evenly divisible dimension split over the
    data-parallel ``axes`` (ZeRO-1; a stage run per cp rank adds cp, as Megatron's
    distributed optimizer shards over dp x cp). Leaves that cannot be split stay as
    they are."""
    mesh = sharding.mesh
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    used = {a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)}
    axes = tuple(a for a in axes if a not in used and mesh.shape[a] > 1)
    size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    if size == 1:
        return sharding
    for i, (entry, n) in enumerate(zip(spec, shape, strict=True)):
        # The model width names fsdp even where fsdp = 1 (it splits nothing there): such a
        # dim is as free as an unnamed one, so ZeRO-1 splits the same dims with or without
        # the fsdp rule.
        unsplit = entry is None or (entry == FSDP_AXIS and mesh.shape[FSDP_AXIS] == 1)
        if unsplit and n % size == 0:
            spec[i] = axes if entry is None else (entry, *axes)
            return NamedSharding(mesh, P(*spec))
    return sharding


def owns_any(devices: Any) -> bool:
    """Whether this process owns one of ``devices`` (always, in a single process)."""
    me = jax.process_index()
    return any(d.process_index == me for d in devices)


def stand_in(abstract: Any, sharding: NamedSharding) -> Any:
    """Arrays with no local shards in place of ``abstract`` (``ShapeDtypeStruct`` s, e.g.
    from ``jax.eval_shape``), for a process that owns none of their devices: each leaf
    takes its own sharding, or ``sharding`` where it has none (an output left to XLA).
    Nothing compiles or runs; a transfer issued with them moves only shape and dtype."""

    def leaf(a: jax.ShapeDtypeStruct) -> jax.Array:
        where = a.sharding if a.sharding is not None else sharding
        if owns_any(where.device_set):
            raise ValueError(f"a stand-in on devices this process owns ({where}): run the program")
        return jax.make_array_from_single_device_arrays(a.shape, where, [], dtype=a.dtype)

    return jax.tree.map(leaf, abstract)
