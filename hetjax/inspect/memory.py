"""Device memory: live arrays now, and a compiled program's footprint.

Two views that answer different questions: :func:`live_bytes_per_device` samples what is
allocated at this moment (every ``jax.Array`` still alive in the process, by device), and
:func:`peak_bytes` reads XLA's static ``memory_analysis()`` of one compiled program (what
it needs per device while it runs). Neither asks the allocator: on CPU there is no
``device.memory_stats()``, and both work there.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import jax


def live_arrays() -> list[jax.Array]:
    """Every ``jax.Array`` alive in this process whose buffers are not deleted."""
    return [a for a in jax.live_arrays() if not a.is_deleted()]


def array_bytes_per_device(array: jax.Array) -> dict[Any, int]:
    """Bytes ``array`` holds on each device it lives on (a replica counts on each)."""
    shard = math.prod(array.sharding.shard_shape(array.shape)) * array.dtype.itemsize
    return {d: shard for d in array.sharding.device_set}


def shard_bytes_per_device(arrays: Iterable[jax.Array]) -> dict[Any, int]:
    """Bytes of ``arrays``' addressable shards per device: what the devices really hold,
    read from the buffers rather than derived from the shardings (as
    :func:`live_bytes_per_device` does)."""
    out: dict[Any, int] = defaultdict(int)
    for a in arrays:
        for shard in a.addressable_shards:
            out[shard.device] += shard.data.nbytes
    return dict(out)


def live_bytes_per_device(arrays: Iterable[jax.Array] | None = None) -> dict[Any, int]:
    """Bytes of live arrays per device.

    Args:
        arrays: the arrays to count; ``None``: :func:`live_arrays`.

    Returns:
        Device -> bytes (devices holding nothing are absent).
    """
    out: dict[Any, int] = defaultdict(int)
    for a in live_arrays() if arrays is None else arrays:
        for device, nbytes in array_bytes_per_device(a).items():
            out[device] += nbytes
    return dict(out)


def peak_bytes(compiled: Any) -> int:
    """Footprint of one compiled program per device: arguments + outputs - aliased +
    temporaries, from ``compiled.memory_analysis()`` (``jit(f).lower(...).compile()``)."""
    m = compiled.memory_analysis()
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )
