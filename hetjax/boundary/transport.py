"""Transports execute transfer plans; `InProcessTransport` is the single-controller one.

A transport takes a `TransferPlan` and the activation in the plan's source sharding and
returns it in the destination sharding. Plans decide what moves; transports only decide
how. Two implementations share this `Transport` protocol:

* `InProcessTransport` (here): one controller sees every device. Each copy is a slice on
  the source device followed by ``jax.device_put`` of that single-device array onto the
  destination device (a device-to-device copy, no host round trip); lane leaders
  assemble their pieces and `local.spread` broadcasts inside the destination island.
* `MultiProcessTransport` (``multiprocess.py``): each process sees only its own devices;
  the copies become one jitted ``shard_map`` collective permute on the union mesh.

Colocated plans on one device set (mode ``"traced"``) are a single XLA reshard in both.
"""

from __future__ import annotations

import functools
from typing import Protocol, runtime_checkable

import jax

from .edge import BoundaryError
from .local import assemble, is_traced, shard_block, spread, to_sharding, traced_reshard
from .plan import Copy, Lane, TransferPlan


@runtime_checkable
class Transport(Protocol):
    """Moves an activation along a transfer plan."""

    def transfer(self, plan: TransferPlan, x: jax.Array) -> jax.Array:
        """Returns ``x`` (in ``plan.edge.src.sharding``) in ``plan.edge.dst.sharding``."""
        ...


def check_eager(plan: TransferPlan, x: jax.Array) -> None:
    """Copy plans run between jitted programs; inside a trace they cannot run.

    Raises:
        BoundaryError: ``x`` is a tracer and the plan moves data between device sets.
    """
    if is_traced(x):
        raise BoundaryError(
            f"edge {plan.edge.name()}: a {plan.placement} boundary between different device"
            " sets cannot run inside jit (one jit uses one device set); call it between the"
            " jitted stage programs"
        )


def copies_by_destination(plan: TransferPlan) -> dict[int, list[Copy]]:
    """Destination device id -> the plan's copies landing there, in plan order."""
    out: dict[int, list[Copy]] = {}
    for copy in plan.copies:
        out.setdefault(copy.dst, []).append(copy)
    return out


@functools.lru_cache(maxsize=256)
def _routes(plan: TransferPlan) -> tuple[tuple[Lane, tuple[tuple[Copy, jax.Device], ...]], ...]:
    # Per lane: its copies with the destination Device object, computed once per plan.
    devices = {d.id: d for d in plan.edge.dst.sharding.device_set}
    incoming = copies_by_destination(plan)
    return tuple(
        (lane, tuple((c, devices[c.dst]) for c in incoming[lane.leader])) for lane in plan.lanes
    )


class InProcessTransport:
    """Single-controller transport: device-to-device copies, then a local broadcast."""

    def transfer(self, plan: TransferPlan, x: jax.Array) -> jax.Array:
        """Moves ``x`` along ``plan``; see `Transport.transfer`."""
        if plan.mode == "traced":
            return traced_reshard(plan, x)
        check_eager(plan, x)
        x = to_sharding(x, plan.edge.src.sharding, f"edge {plan.edge.name()}")
        shards = {s.device.id: s for s in x.addressable_shards}
        routes = _routes(plan)
        pieces = [
            [shard_block(shards[copy.src], plan.shape, copy.region) for copy, _ in copies]
            for _, copies in routes
        ]
        # Every cross-device copy of the plan in one batched device_put (one host call,
        # not one per copy).
        moving = [
            (i, j, device)
            for i, (_, copies) in enumerate(routes)
            for j, (copy, device) in enumerate(copies)
            if copy.src != copy.dst
        ]
        if moving:
            moved = jax.device_put([pieces[i][j] for i, j, _ in moving], [d for *_, d in moving])
            for (i, j, _), piece in zip(moving, moved, strict=True):
                pieces[i][j] = piece
        chunks = {
            lane.leader: assemble(
                lane, [(c.region, p) for (c, _), p in zip(copies, got, strict=True)]
            )
            for (lane, copies), got in zip(routes, pieces, strict=True)
        }
        return spread(plan, chunks)

    def __repr__(self) -> str:
        return "InProcessTransport()"
