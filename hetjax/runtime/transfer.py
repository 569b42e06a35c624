"""Activation transfers used by the executor.

- :func:`stage_transfer`: between consecutive pipeline stages of ONE module. Both stages
  have the same layout, so each device's shard goes to exactly one device of the next
  stage - a direct device-to-device copy, no host bounce.
- :class:`LinkTransfer`: between modules, a :class:`hetjax.boundary.Boundary` from the
  source's last stage to the destination's first stage (forward: activation; backward:
  its cotangent, routed back to exactly the source's sharding).

With several processes (each sees only its own devices) ``jax.device_put`` cannot cross
process boundaries, so both kinds of transfer go through the boundary's
:class:`~hetjax.boundary.MultiProcessTransport`: a collective permute on the union mesh,
issued by every process in the same order (processes owning none of its devices skip it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from hetjax.boundary import (
    Boundary,
    EdgeSpec,
    Endpoint,
    MultiProcessTransport,
    naive_device_put_bytes,
)
from hetjax.distributed.rendezvous import FirstCalls, signature
from hetjax.meshes import BATCH_AXES, ModuleMesh, batch_sharding, sequence_axes
from hetjax.ops.token_routing import Routed, exchange_routed, gather_routes, scatter_routes
from hetjax.runtime.placement import owns_any, stand_in

Direction = Literal["forward", "backward"]


class StageTransfer:
    """Consecutive pipeline stages ``stage -> stage + 1`` of one module (same layout)."""

    def __init__(self, module: ModuleMesh, stage: int, *, multiprocess: bool):
        self.src_mesh = module.stage_mesh(stage)
        self.dst_mesh = module.stage_mesh(stage + 1)
        self.boundary = None
        # Activations between stages are [B, L, D]: batch over dp, sequence over cp.
        seq = sequence_axes(self.src_mesh)
        spec = P(BATCH_AXES, seq) if seq else P(BATCH_AXES)
        if multiprocess:
            self.boundary = Boundary(
                EdgeSpec(
                    Endpoint.of(module, spec, stage=stage),
                    Endpoint.of(module, spec, stage=stage + 1),
                ),
                transport=MultiProcessTransport(),
            )

    def forward(self, x: jax.Array) -> jax.Array:
        if self.boundary is not None:
            return self.boundary.forward(x)
        return jax.device_put(x, batch_sharding(self.dst_mesh, x.ndim, sequence=True))

    def backward(self, ct: jax.Array) -> jax.Array:
        if self.boundary is not None:
            return self.boundary.backward(ct)
        return jax.device_put(ct, batch_sharding(self.src_mesh, ct.ndim, sequence=True))

    def moved_bytes(self, x: jax.Array, direction: Direction) -> int:
        """Bytes the copy of ``x`` moves between devices (all devices together)."""
        mesh = self.dst_mesh if direction == "forward" else self.src_mesh
        dst = batch_sharding(mesh, x.ndim, sequence=True)
        return naive_device_put_bytes(x.sharding, dst, x.shape, x.dtype)


@dataclasses.dataclass(frozen=True)
class Route:
    """One microbatch's token routing for a link into a ``cp > 1`` module: either
    ``index`` (gather at the source) or ``send``/``recv`` (exchange at the destination;
    see :class:`LinkTransfer`)."""

    num_tokens: int  # N: tokens per sample the source produces
    index: jax.Array | None = None  # [B, cp, K] on the source stage; -1 = padding
    send: jax.Array | None = None  # [B, cp, cp, K2] on the destination stage
    recv: jax.Array | None = None  # [B, cp, K] on the destination stage


def _directed(boundary: Boundary, shape: tuple[int, ...], dtype, direction: Direction):
    """The plan ``boundary`` moves an array of ``shape`` by: its forward plan, or the
    reverse for a cotangent."""
    plan = boundary.plan(shape, dtype)
    return plan if direction == "forward" else plan.reverse()


class LinkTransfer:
    """The boundary communicator of one module link (``src`` last stage -> ``dst`` stage 0).

    ``routed``: the destination has ``cp > 1`` and merges the tokens into placeholder
    positions, so each cp rank receives only the tokens of the positions it stores
    (:mod:`hetjax.ops.token_routing`), marked :class:`Routed`. Two ways, by placement:

    - colocated (:meth:`Route` with ``index``): the source packs each rank's slots (a
      local gather) and the boundary delivers dim 1 split over cp - every device gets
      ``K`` slots per sample instead of all ``N`` tokens;
    - across islands (``send``/``recv``): the tokens cross split EVENLY over the cp ranks
      (each token crosses islands once, ``N`` per sample - no broadcast inside the
      destination), then one all-to-all over cp moves each to the rank that owns its
      position. Gathering at the source first would send the padded ``cp * K`` slots
      across islands instead.

    The backward runs the transposes (each token went to exactly one rank, so each
    gradient comes back from exactly one place). Without a route the tokens arrive
    replicated over cp.
    """

    def __init__(
        self,
        src: ModuleMesh,
        dst: ModuleMesh,
        *,
        src_stage: int,
        dst_stage: int,
        multiprocess: bool = False,
        routed: bool = False,
    ):
        source = Endpoint.source(src, stage=src_stage)
        destination = Endpoint.destination(dst, stage=dst_stage)
        # The homogeneous baseline puts the encoder on the LLM's first stage with the same
        # layout: the activation is already where it must be, nothing to move.
        self.identity = source.sharding == destination.sharding
        self.name = f"route {source.where()} -> {destination.where()}"
        self._first_calls = FirstCalls()  # the routing programs' (multi-process)
        self._abstract: dict = {}  # (kind, signature) -> a remote routing step's outputs
        self.transport = MultiProcessTransport() if multiprocess else None
        self.boundary = None if self.identity else self._boundary(source, destination)
        self.routed_boundary = None
        self.exchange = False
        if routed:
            by_position = Endpoint.destination(dst, stage=dst_stage, shard_tokens=True)
            self.routed_boundary = self._boundary(source, by_position)
            self.exchange = self.routed_boundary.edge.placement == "non-colocated"
            self.index_sharding = source.sharding  # gather: the index lives with the source
            self.split_sharding = by_position.sharding  # exchange: with the destination
            self._gather = jax.jit(gather_routes, out_shardings=source.sharding)
            self._scatter = jax.jit(
                scatter_routes, static_argnums=(2,), out_shardings=source.sharding
            )
            exchange = functools.partial(
                exchange_routed, mesh=by_position.sharding.mesh, batch_axes=BATCH_AXES
            )

            def exchange_transpose(ct, send, recv, num_tokens):
                zeros = jnp.zeros((ct.shape[0], num_tokens, *ct.shape[2:]), ct.dtype)
                return jax.vjp(lambda x: exchange(x, send, recv), zeros)[1](ct)[0]

            self._exchange = jax.jit(exchange, out_shardings=by_position.sharding)
            self._exchange_t = jax.jit(
                exchange_transpose, static_argnums=(3,), out_shardings=by_position.sharding
            )

    def _owned(self, kind: str, fn: Any, x: jax.Array, *args: Any) -> jax.Array:
        """``fn(x, *args)`` (a jitted routing step with pinned output sharding, on the
        devices of ``x``), or where this process owns none of those devices, a stand-in
        of its output: nothing compiles or runs for another process's stage. A first
        call that spans processes meets them first (:class:`FirstCalls`)."""
        if owns_any(x.sharding.device_set):
            self._first_calls.ready(f"{self.name} {kind}", fn, x, *args)
            return fn(x, *args)
        # Traced once per signature, as Program.eval_shape; the jitted function's own
        # eval_shape, so its static arguments stay static.
        key = (kind, signature((x, *args)))
        out = self._abstract.get(key)
        if out is None:
            out = self._abstract[key] = fn.eval_shape(x, *args)
        return stand_in(out, out.sharding)

    def _boundary(self, source: Endpoint, destination: Endpoint) -> Boundary:
        edge = EdgeSpec(source, destination)
        return Boundary(edge, self.transport) if self.transport else Boundary(edge)

    def forward(self, x: jax.Array, route: Route | None = None) -> jax.Array | Routed:
        if route is None:
            return x if self.boundary is None else self.boundary.forward(x)
        if route.send is not None:
            split = self.routed_boundary.forward(x)
            return Routed(self._owned("exchange", self._exchange, split, route.send, route.recv))
        return Routed(
            self.routed_boundary.forward(self._owned("gather", self._gather, x, route.index))
        )

    def backward(self, ct: jax.Array | Routed, route: Route | None = None) -> jax.Array:
        if not isinstance(ct, Routed):
            return ct if self.boundary is None else self.boundary.backward(ct)
        if route.send is not None:
            args = (ct.tokens, route.send, route.recv, route.num_tokens)
            t = self._owned("exchange_t", self._exchange_t, *args)
            return self.routed_boundary.backward(t)
        ct = self.routed_boundary.backward(ct.tokens)
        return self._owned("scatter", self._scatter, ct, route.index, route.num_tokens)

    def collective(self, x: jax.Array | Routed, route: Route | None, direction: Direction) -> bool:
        """Whether moving ``x`` runs a collective program: token routing, a reshard among
        shared devices, a broadcast inside the destination, or a multi-process permute
        (what the executor's CPU in-flight guard must order)."""
        if route is not None or isinstance(x, Routed) or self.transport is not None:
            return True
        if self.boundary is None:
            return False
        plan = _directed(self.boundary, x.shape, x.dtype, direction)
        src = plan.edge.src.sharding
        return (
            plan.mode == "traced"
            or plan.local.kind == "broadcast"
            or not x.sharding.is_equivalent_to(src, x.ndim)  # to_sharding reshards first
        )

    def moved_bytes(self, x: jax.Array | Routed, route: Route | None, direction: Direction) -> int:
        """Bytes the transfer of ``x`` moves between devices (all devices together).

        Routed tokens take the by-position boundary: packed per rank at the source, or
        split evenly and then exchanged (the all-to-all moves every (holder, owner) block
        but a rank's own)."""
        a = x.tokens if isinstance(x, Routed) else x
        boundary, shape, exchanged = self.boundary, a.shape, 0
        if route is not None:
            boundary = self.routed_boundary
            if route.send is not None:
                b, cp, _, k2 = route.send.shape
                shape = (b, route.num_tokens, *a.shape[2:])
                exchanged = b * cp * (cp - 1) * k2 * math.prod(a.shape[2:]) * a.dtype.itemsize
            elif not isinstance(x, Routed):
                _, cp, k = route.index.shape
                shape = (a.shape[0], cp * k, *a.shape[2:])
        if boundary is None:
            return exchanged
        plan = _directed(boundary, shape, a.dtype, direction)
        return exchanged + plan.cross_island_bytes + plan.local_collective_bytes
