"""Multi-process transport: plan copies as one collective permute on the union mesh.

With several JAX processes each process sees only its own devices, and ``jax.device_put``
between device sets on different processes is unsupported (CPU) or limited to equal
shard shapes (GPU). Instead, every copy of a plan becomes a pair of a ``ppermute`` inside
ONE jitted ``shard_map`` over the union mesh of the source and destination devices
(axis ``"u"``, devices sorted by id so every process builds the same mesh). Each process
that owns a device of either side issues that program; a process owning none skips it.
Every process must therefore run the same transfers in the same order, or the permute
deadlocks (the executor walks one global schedule, so it does).

A permute moves one equally-shaped buffer per device, so the copies are packed into
rounds: within a round all pieces have one shape and each device sends at most once and
receives at most once. Only the plan's bytes move: devices not in a round's
permutation send nothing (their input is a cached zero buffer that stays local).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .local import (
    FIRST_CALLS,
    assemble,
    shard_block,
    spread,
    to_sharding,
    traced_reshard,
    zeros_on,
)
from .plan import Copy, Region, TransferPlan
from .transport import check_eager, copies_by_destination


@dataclasses.dataclass(frozen=True)
class _Round:
    shape: tuple[int, ...]  # shape of every piece in this round
    copies: tuple[Copy, ...]  # at most one per sender and one per receiver


@dataclasses.dataclass(frozen=True)
class _Program:
    mesh: Mesh  # union mesh, axis "u"
    rounds: tuple[_Round, ...]
    fn: Callable  # jitted shard_map: one (U * shape[0], *shape[1:]) input/output per round


def _pack_rounds(copies: tuple[Copy, ...]) -> tuple[_Round, ...]:
    rounds: list[tuple[tuple[int, ...], list[Copy], set[int], set[int]]] = []
    for copy in copies:
        if copy.src == copy.dst:
            continue
        shape = tuple(hi - lo for lo, hi in copy.region)
        for r_shape, members, senders, receivers in rounds:
            if r_shape == shape and copy.src not in senders and copy.dst not in receivers:
                members.append(copy)
                senders.add(copy.src)
                receivers.add(copy.dst)
                break
        else:
            rounds.append((shape, [copy], {copy.src}, {copy.dst}))
    return tuple(_Round(shape, tuple(members)) for shape, members, _, _ in rounds)


@functools.lru_cache(maxsize=256)
def _program(plan: TransferPlan) -> _Program:
    devices = plan.edge.src.sharding.device_set | plan.edge.dst.sharding.device_set
    ordered = sorted(devices, key=lambda d: d.id)
    array = np.empty(len(ordered), dtype=object)
    array[:] = ordered
    mesh = Mesh(array, ("u",))
    position = {d.id: i for i, d in enumerate(ordered)}
    rounds = _pack_rounds(plan.copies)
    perms = [[(position[c.src], position[c.dst]) for c in r.copies] for r in rounds]

    def body(*buffers):
        return tuple(jax.lax.ppermute(b, "u", perm) for b, perm in zip(buffers, perms, strict=True))

    specs = tuple(PartitionSpec("u") for _ in rounds)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs))
    return _Program(mesh=mesh, rounds=rounds, fn=fn)


class MultiProcessTransport:
    """Transport for runs where each process sees only its own devices.

    Also correct in a single process (then it is one permute program instead of many
    small copies), which is how it is unit-tested without spawning processes.
    """

    def transfer(self, plan: TransferPlan, x: jax.Array) -> jax.Array:
        """Moves ``x`` along ``plan``; see `Transport.transfer`.

        On a process that owns no destination device the result has no addressable
        shards; on one that owns no source device ``x`` may have none either.
        """
        if plan.mode == "traced":
            return traced_reshard(plan, x)
        check_eager(plan, x)
        me = jax.process_index()
        if any(d.process_index == me for d in plan.edge.src.sharding.device_set):
            x = to_sharding(x, plan.edge.src.sharding, f"edge {plan.edge.name()}")
        shards = {s.device.id: s for s in x.addressable_shards}
        received = self._permute(plan, shards)
        local_dst = {d.id for d in plan.edge.dst.sharding.device_set if d.process_index == me}
        incoming = copies_by_destination(plan)
        chunks = {}
        for lane in plan.lanes:
            if lane.leader not in local_dst:
                continue
            pieces: list[tuple[Region, jax.Array]] = []
            for copy in incoming[lane.leader]:
                if copy.src == copy.dst:
                    piece = shard_block(shards[copy.src], plan.shape, copy.region)
                else:
                    piece = received[lane.leader][copy]
                pieces.append((copy.region, piece))
            chunks[lane.leader] = assemble(lane, pieces)
        return spread(plan, chunks)

    def _permute(
        self, plan: TransferPlan, shards: dict[int, jax.Shard]
    ) -> dict[int, dict[Copy, jax.Array]]:
        program = _program(plan)
        me = jax.process_index()
        local = [d for d in program.mesh.devices.flat if d.process_index == me]
        if not program.rounds or not local:
            return {}
        sharding = NamedSharding(program.mesh, PartitionSpec("u"))
        size = program.mesh.devices.size
        inputs = []
        for r in program.rounds:
            # Dim 0 holds one piece per union device, so each device's block is its piece.
            sends = {c.src: c for c in r.copies}
            buffers = [
                shard_block(shards[d.id], plan.shape, sends[d.id].region)
                if d.id in sends
                else zeros_on(d, r.shape, plan.dtype)
                for d in local
            ]
            shape = (size * r.shape[0], *r.shape[1:])
            inputs.append(jax.make_array_from_single_device_arrays(shape, sharding, buffers))
        FIRST_CALLS.ready(f"permute edge {plan.edge.name()}", program.fn, *inputs, key=plan)
        outputs = program.fn(*inputs)
        received: dict[int, dict[Copy, jax.Array]] = {}
        for r, out in zip(program.rounds, outputs, strict=True):
            gets = {c.dst: c for c in r.copies}
            for shard in out.addressable_shards:
                copy = gets.get(shard.device.id)
                if copy is not None:
                    received.setdefault(copy.dst, {})[copy] = shard.data
        return received

    def __repr__(self) -> str:
        return "MultiProcessTransport()"
