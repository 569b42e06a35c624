"""Device-side pieces shared by the transports: slicing, lane assembly, local broadcast.

After the copies of a plan land, each destination lane leader holds its lane's bytes and
the other devices of the lane (its tp / cp replicas) hold nothing yet. `spread` finishes
the layout with a tree broadcast written as ``ppermute`` rounds in a jitted ``shard_map``
on the destination mesh: round k doubles the devices holding the lane, so every replica
receives the lane exactly once ((R-1) lane copies per lane in ceil(log2 R) rounds). An
``all_gather`` + select would move R(R-1) copies and a ``psum`` of zero-padded buffers
twice the bytes of a broadcast, so neither is used.

Nothing here goes through host memory: slices run on the device holding the shard, and
the non-leader inputs of the broadcast are zero buffers created on their own devices.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetjax.distributed.rendezvous import FirstCalls

from .edge import BoundaryError
from .plan import Lane, Region, TransferPlan, region_of


def is_traced(x: jax.Array) -> bool:
    """True inside ``jit``/``vmap`` tracing, False for concrete arrays."""
    return isinstance(x, jax.core.Tracer)


def slice_block(data: jax.Array, have: Region, block: Region) -> jax.Array:
    """Cuts the global ``block`` out of ``data``, a single-device array holding ``have``."""
    if block == have:
        return data
    return _cut_fn(
        tuple((lo - h0, hi - h0) for (lo, hi), (h0, _) in zip(block, have, strict=True))
    )(data)


# Eager ``x[index]`` and ``jnp.concatenate`` go through jax.numpy's indexing and
# primitive dispatch, about 1 ms a call on the host; a cached jit of the same static cut
# or join takes the C++ fast path (tens of microseconds). Both run on the device holding
# their inputs (a committed single-device array), so nothing moves.
@functools.lru_cache(maxsize=1024)
def _cut_fn(block: Region):
    return jax.jit(lambda a: a[tuple(slice(lo, hi) for lo, hi in block)])


@functools.lru_cache(maxsize=1024)
def _join_fn(region: Region, regions: tuple[Region, ...]):
    varying = [d for d in range(len(region)) if any(r[d] != region[d] for r in regions)]
    if len(varying) == 1:
        axis = varying[0]
        order = sorted(range(len(regions)), key=lambda i: regions[i][axis][0])
        return jax.jit(lambda *p: jnp.concatenate([p[i] for i in order], axis=axis))

    # Pieces cut along several dims (source and destination split different dims).
    def join(*pieces):
        out = jnp.zeros(tuple(hi - lo for lo, hi in region), pieces[0].dtype)
        for r, piece in zip(regions, pieces, strict=True):
            index = tuple(
                slice(lo - l0, hi - l0) for (lo, hi), (l0, _) in zip(r, region, strict=True)
            )
            out = out.at[index].set(piece)
        return out

    return jax.jit(join)


def shard_block(shard: jax.Shard, shape: Sequence[int], block: Region) -> jax.Array:
    """Cuts the global ``block`` out of one addressable shard of an array of ``shape``."""
    return slice_block(shard.data, region_of(shard.index, shape), block)


def assemble(lane: Lane, pieces: Sequence[tuple[Region, jax.Array]]) -> jax.Array:
    """Joins the pieces (all on the lane leader) that tile the lane into one array."""
    if len(pieces) == 1 and pieces[0][0] == lane.region:
        return pieces[0][1]
    return _join_fn(lane.region, tuple(r for r, _ in pieces))(*(p for _, p in pieces))


@functools.lru_cache(maxsize=1024)
def zeros_on(device: jax.Device, shape: tuple[int, ...], dtype: str) -> jax.Array:
    """A cached zero buffer on ``device`` (never donated, so sharing it is safe)."""
    return jnp.zeros(shape, dtype, device=device)


# Multi-process: the first call of a cached transfer program (per cache key and
# signature) compiles it and meets the processes of its devices when its collectives span
# them (hetjax.distributed.rendezvous). Keyed by what the caches are keyed by, so every
# process decides alike even where their caches evict differently.
FIRST_CALLS = FirstCalls()


@functools.lru_cache(maxsize=256)
def _reshard_fn(sharding: NamedSharding):
    return jax.jit(lambda a: a, out_shardings=sharding)


def to_sharding(x: jax.Array, sharding: NamedSharding, what: str) -> jax.Array:
    """Returns ``x`` in ``sharding``, resharding on its own devices if its layout differs.

    Raises:
        BoundaryError: ``x`` is spread over devices other than the sharding's.
    """
    if x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    if len(x.sharding.device_set) > 1 and x.sharding.device_set != sharding.device_set:
        ids = sorted(d.id for d in x.sharding.device_set)
        want = sorted(d.id for d in sharding.device_set)
        raise BoundaryError(
            f"{what}: input lives on devices {ids} but the edge expects devices {want}; produce"
            " it on the endpoint's mesh (e.g. jit(..., out_shardings=endpoint.sharding))"
        )
    fn = _reshard_fn(sharding)
    FIRST_CALLS.ready(f"reshard {what}", fn, x, key=sharding)
    return fn(x)


def traced_reshard(plan: TransferPlan, x: jax.Array) -> jax.Array:
    """Colocated plans: one XLA reshard among the shared devices (jit-traceable).

    Traced, a sharding constraint; eager, ``jax.device_put`` onto the same device set,
    which reshards on device (the host round trip only concerns disjoint device sets).
    An array spanning processes takes the same reshard as a cached jit (what
    ``device_put`` compiles for it inside), so that its first call meets its processes
    (:data:`FIRST_CALLS`).
    """
    if is_traced(x):
        return jax.lax.with_sharding_constraint(x, plan.edge.dst.sharding)
    if not x.is_fully_addressable:
        return to_sharding(x, plan.edge.dst.sharding, f"edge {plan.edge.name()}")
    return jax.device_put(x, plan.edge.dst.sharding)


def spread(plan: TransferPlan, chunks: dict[int, jax.Array]) -> jax.Array:
    """Builds the destination array from lane chunks held by the (local) lane leaders.

    Args:
        plan: a ``"copies"`` plan.
        chunks: lane leader device id -> that lane's block, on the leader, for every
            leader this process owns (every local destination device when the plan has
            no broadcast).

    Returns:
        The activation in the destination sharding. A process that owns no destination
        device gets an array with no addressable shards.
    """
    dst = plan.edge.dst.sharding
    program = _spread_program(plan, jax.process_index())
    if not program.local:
        return jax.make_array_from_single_device_arrays(plan.shape, dst, [], dtype=plan.dtype)
    if program.fn is None:
        blocks = [chunks[d.id] for d in program.local]
        return jax.make_array_from_single_device_arrays(plan.shape, dst, blocks)
    blocks = [chunks[d.id] if d.id in chunks else program.zeros[d.id] for d in program.local]
    staging = jax.make_array_from_single_device_arrays(program.staged_shape, program.staged, blocks)
    FIRST_CALLS.ready(f"broadcast edge {plan.edge.name()}", program.fn, staging, key=plan)
    return program.fn(staging)


@dataclasses.dataclass(frozen=True)
class _SpreadProgram:
    local: tuple[jax.Device, ...]  # destination devices of this process, mesh order
    fn: Callable | None  # the jitted broadcast, None when the plan needs none
    staged: NamedSharding | None  # staging layout: one lane-sized block per device
    staged_shape: tuple[int, ...]  # its global shape
    zeros: dict[int, jax.Array]  # non-leader device id -> zero lane block on it


@functools.lru_cache(maxsize=256)
def _spread_program(plan: TransferPlan, process: int) -> _SpreadProgram:
    dst = plan.edge.dst.sharding
    local = tuple(d for d in dst.mesh.devices.flat if d.process_index == process)
    if plan.local.kind != "broadcast" or not local:
        return _SpreadProgram(local, None, None, (), {})
    axes = plan.local.axes
    replicas = math.prod(dst.mesh.shape[a] for a in axes)
    # Staging folds the replica axes into dim 0, so each device's block is exactly its
    # lane (no reshape on the way in); the staging array's global value is meaningless.
    spec = tuple(dst.spec) + (None,) * (len(plan.shape) - len(dst.spec))
    first = () if spec[0] is None else (spec[0],) if isinstance(spec[0], str) else spec[0]
    staged = NamedSharding(dst.mesh, PartitionSpec(axes + tuple(first), *spec[1:]))
    staged_shape = (replicas * plan.shape[0], *plan.shape[1:])
    leaders = {lane.leader for lane in plan.lanes}
    lane_shape = tuple(hi - lo for lo, hi in plan.lanes[0].region)
    zeros = {d.id: zeros_on(d, lane_shape, plan.dtype) for d in local if d.id not in leaders}
    root = 0 if plan.dst_leader == "first" else replicas - 1
    fn = _broadcast_fn(dst.mesh, staged.spec, dst.spec, axes, root)
    return _SpreadProgram(local, fn, staged, staged_shape, zeros)


@functools.lru_cache(maxsize=256)
def _broadcast_fn(
    mesh: Mesh, in_spec: PartitionSpec, spec: PartitionSpec, axes: tuple[str, ...], root: int
):
    replicas = math.prod(mesh.shape[a] for a in axes)

    def body(lane_block):
        rel = (jax.lax.axis_index(axes) - root) % replicas
        step = 1
        while step < replicas:
            perm = [
                ((root + i) % replicas, (root + i + step) % replicas)
                for i in range(step)
                if i + step < replicas
            ]
            received = jax.lax.ppermute(lane_block, axes, perm)
            lane_block = jnp.where((rel >= step) & (rel < 2 * step), received, lane_block)
            step *= 2
        return lane_block

    # check_vma=False: the output is declared replicated over `axes`, which holds after
    # the last round but is not provable by the varying-manual-axes type system.
    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=spec, check_vma=False),
        # Explicit, so the result carries exactly the destination's sharding object
        # (XLA would otherwise canonicalise away size-1 axes from the spec).
        out_shardings=NamedSharding(mesh, spec),
    )
