"""Arrays that only some processes hold, written by their owners with tensorstore.

Orbax's array handler saves global arrays of which every process holds a part: it
refuses an array held entirely by one process of a multi-process run ("host local"),
and a process holding no shard of an array cannot take part. A pipeline stage whose
devices all belong to one process (islands, or pp stages on separate hosts) holds just
such arrays. This orbax item writes them itself, in the same logical format:

- each leaf is one zarr array of its full (logical) shape, chunked by the saving
  layout's shards, so every chunk has exactly one writer: the process holding that
  shard's replica 0. Nothing is gathered, and no process waits for another;
- process 0 (orbax's primary host) writes every leaf's zarr metadata: every process
  knows every global array's shape, dtype and sharding, held or not;
- the item lies in the step's temporary directory and orbax renames it with the rest of
  the step once every process has finished writing: the step is complete or absent.

Restoring reads each target shard's slice from the chunks it overlaps (any layout, any
process count): a process reads only the slices its own devices hold. A missing or
truncated chunk is an error, never zeros.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from orbax.checkpoint import future


def _spec(directory: Path, name: str, shape, dtype, chunks=None) -> dict:
    spec = {
        "driver": "zarr",
        "kvstore": {"driver": "file", "path": str(Path(directory) / name)},
        "dtype": np.dtype(dtype).name,
        # A chunk that is not there is damage, not zeros.
        "fill_missing_data_reads": False,
    }
    meta = {"shape": [int(n) for n in shape]}
    if chunks is not None:
        meta |= {"chunks": [max(int(n), 1) for n in chunks], "compressor": None}
    return spec | {"metadata": meta}


def _key(index: tuple, shape: tuple) -> tuple:
    return tuple(s.indices(n) for s, n in zip(index, shape, strict=True))


def host_copies(arrays: dict[str, jax.Array]) -> list[tuple]:
    """``(name, shape, dtype, chunk shape, [(index, host copy), ...])`` per leaf: the
    shards this process writes (replica 0 of each), copied to host memory now, so the
    caller may donate the device buffers as soon as this returns."""
    out = []
    for name, a in arrays.items():
        mine = [(s.index, np.array(s.data)) for s in a.addressable_shards if s.replica_id == 0]
        out.append((name, a.shape, a.dtype, a.sharding.shard_shape(a.shape), mine))
    return out


async def _write(directory: Path, copies: list[tuple]) -> None:
    primary = jax.process_index() == 0
    wanted = [c for c in copies if primary or c[4]]
    stores = await asyncio.gather(
        *(
            ts.open(
                _spec(directory, name, shape, dtype, chunks),
                **({"create": True} if primary else {"open": True, "assume_metadata": True}),
            )
            for name, shape, dtype, chunks, _ in wanted
        )
    )
    pairs = zip(stores, wanted, strict=True)
    await asyncio.gather(*(store[i].write(data) for store, c in pairs for i, data in c[4]))


def read(directory: Path, targets: dict[str, Any]) -> dict[str, Any]:
    """``targets``: name -> ``jax.ShapeDtypeStruct`` with a sharding (read into it, only
    this process's slices) or a numpy array (read whole, to host memory)."""
    stores = {
        name: ts.open(_spec(directory, name, t.shape, t.dtype), open=True, read=True)
        for name, t in targets.items()
    }
    reads = {}
    for name, t in targets.items():
        store = stores[name].result()
        if tuple(store.shape) != tuple(t.shape):
            raise ValueError(f"{name} has shape {tuple(store.shape)}, not {tuple(t.shape)}")
        if isinstance(t, np.ndarray):
            reads[name] = {(): store.read()}
            continue
        indices = t.sharding.addressable_devices_indices_map(t.shape).values()
        reads[name] = {_key(i, t.shape): store[i].read() for i in indices}
    out = {}
    for name, t in targets.items():
        got = {k: np.asarray(f.result()) for k, f in reads[name].items()}
        if isinstance(t, np.ndarray):
            out[name] = got[()]
        else:
            # jax asks a process holding none of a replicated array for a value anyway
            # (and drops it): it gets a dummy, not a read.
            dummy = np.zeros((), t.dtype)
            out[name] = jax.make_array_from_callback(
                t.shape,
                t.sharding,
                lambda i, got=got, t=t, dummy=dummy: got.get(_key(i, t.shape), dummy),
                dtype=t.dtype,
            )
    return out


class OwnedHandler(ocp.AsyncCheckpointHandler):
    """The orbax item of :mod:`hetjax.checkpoint.owned` (args: :class:`OwnedSave`,
    :class:`OwnedRestore`)."""

    async def async_save(self, directory, args: OwnedSave) -> list[future.Future]:
        copies = host_copies(args.arrays)  # before returning: the loop may donate next
        # Awaits orbax's (possibly asynchronous) creation of the item directory first.
        return [future.CommitFutureAwaitingContractedSignals(_write(Path(directory), copies))]

    def save(self, directory, args: OwnedSave) -> None:
        for f in asyncio.run(self.async_save(directory, args)):
            f.result()

    def restore(self, directory, args: OwnedRestore) -> dict[str, Any]:
        return read(Path(directory), args.targets)

    def metadata(self, directory) -> None:
        return None

    def finalize(self, directory) -> None:
        pass

    def close(self) -> None:
        pass


@ocp.args.register_with_handler(OwnedHandler, for_save=True)
@dataclasses.dataclass
class OwnedSave(ocp.args.CheckpointArgs):
    """Leaf name -> global array held by only some processes."""

    arrays: dict[str, jax.Array]


@ocp.args.register_with_handler(OwnedHandler, for_restore=True)
@dataclasses.dataclass
class OwnedRestore(ocp.args.CheckpointArgs):
    """Leaf name -> target (see :func:`read`)."""

    targets: dict[str, Any]
