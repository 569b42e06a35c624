"""Transfer plans as data: which bytes go from which device to which, and what then runs.

`make_plan` turns an `EdgeSpec` and an activation shape into a `TransferPlan`. The plan is
the single source of truth for byte accounting; transports only execute it. Two modes:

* ``"copies"``, non-colocated: the destination is cut into *lanes*, one per distinct
  shard (a data-parallel slice, or a (dp, cp) slice when tokens are split over cp).
  Each lane's bytes go, exactly once, from deterministic source leaders (by default the
  LAST device holding that source slice, as in Megatron's bridge) to the lane's
  destination leader (its FIRST device); a destination-local tree broadcast over the
  lane's tp/cp replicas then completes the layout. Every activation byte crosses
  between islands once, instead of once per destination replica as with a plain
  ``jax.device_put``.
* ``"copies"``, colocated but with different stage device sets (e.g. an LLM's first
  pipeline stage holds half of the shared devices): one island, so every destination
  device fetches only the blocks it does not already hold; nothing crosses islands.
* ``"traced"``, colocated on one device set: a single XLA reshard among the shared
  devices (nothing, a local slice, an all-gather, or a general reshard when the DP
  degrees do not divide), traceable inside one ``jit``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from jax.sharding import NamedSharding

from .edge import EdgeSpec, PlacementKind, Transform

Region = tuple[tuple[int, int], ...]  # [start, stop) per dimension, global indices
LeaderRule = Literal["first", "last"]
LocalKind = Literal["none", "slice", "all_gather", "reshard", "broadcast"]


@dataclasses.dataclass(frozen=True)
class Copy:
    """One device-to-device copy of a block of the global activation."""

    src: int  # source device id
    dst: int  # destination device id
    region: Region  # global index block copied
    nbytes: int  # bytes moved; 0 when src == dst (a local slice, no transfer)
    cross_island: bool  # True when src and dst belong to different modules' islands


@dataclasses.dataclass(frozen=True)
class Lane:
    """A block of the activation and the destination devices that hold it whole.

    Non-colocated, a lane groups all replicas of one destination shard; colocated, every
    destination device is its own lane (it fetches what it lacks directly).
    """

    region: Region  # global index block of the lane
    devices: tuple[int, ...]  # destination device ids filled, in mesh flat order
    leader: int  # the device receiving the copies (and broadcasting to the others)


@dataclasses.dataclass(frozen=True)
class LocalCollective:
    """The destination-local step that completes the layout."""

    kind: LocalKind  # what runs among the destination devices
    axes: tuple[str, ...]  # destination mesh axes it runs over (broadcast only)
    nbytes: int  # bytes received by destination devices in this step


@dataclasses.dataclass(frozen=True)
class TransferPlan:
    """Everything a transport needs to move one activation across one edge."""

    edge: EdgeSpec  # source and destination endpoints
    shape: tuple[int, ...]  # global activation shape, e.g. (B, N, D)
    dtype: str  # numpy dtype name
    mode: Literal["traced", "copies"]  # one XLA reshard, or explicit copies + broadcast
    copies: tuple[Copy, ...]  # explicit copies (mode "copies" only)
    lanes: tuple[Lane, ...]  # destination lanes (mode "copies" only)
    local: LocalCollective  # destination-local collective
    src_leader: LeaderRule  # which device of a source slice sends it
    dst_leader: LeaderRule  # which device of a destination lane receives it

    @property
    def transform(self) -> Transform:
        """DP-Equal / Fan-In / Fan-Out / non-dividing, from the edge's DP degrees."""
        return self.edge.transform

    @property
    def placement(self) -> PlacementKind:
        """Colocated or non-colocated, from the modules' device sets."""
        return self.edge.placement

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def activation_bytes(self) -> int:
        """Bytes of the global activation."""
        return math.prod(self.shape) * self.itemsize

    @property
    def cross_island_bytes(self) -> int:
        """Bytes copied from one module's island to another's."""
        return sum(c.nbytes for c in self.copies if c.cross_island)

    @property
    def local_collective_bytes(self) -> int:
        """Bytes moved between devices of one island (copies inside it + local collective)."""
        return self.local.nbytes + sum(c.nbytes for c in self.copies if not c.cross_island)

    def reverse(self) -> TransferPlan:
        """The plan for the cotangent: destination -> source along the same leaders."""
        return make_plan(
            self.edge.reversed(),
            self.shape,
            self.dtype,
            src_leader=self.dst_leader,
            dst_leader=self.src_leader,
        )

    def summary(self) -> dict[str, Any]:
        """Plain-data summary for logs and benchmarks."""
        return dict(
            edge=self.edge.name(),
            placement=self.placement,
            transform=self.transform,
            mode=self.mode,
            local=self.local.kind,
            activation_bytes=self.activation_bytes,
            cross_island_bytes=self.cross_island_bytes,
            local_collective_bytes=self.local_collective_bytes,
            copies=len(self.copies),
        )


def region_of(index: Sequence[slice], shape: Sequence[int]) -> Region:
    """Turns a tuple of slices (as in ``devices_indices_map``) into a `Region`."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(tuple(s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


def intersect(a: Region, b: Region) -> Region | None:
    """The common block of two regions, or None if they do not overlap."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def region_size(region: Region | None) -> int:
    """Number of elements in a region (0 for None)."""
    return 0 if region is None else math.prod(hi - lo for lo, hi in region)


def device_regions(sharding: NamedSharding, shape: Sequence[int]) -> dict[int, Region]:
    """Device id -> region it holds, in mesh flat order."""
    indices = sharding.devices_indices_map(tuple(shape))
    return {d.id: region_of(indices[d], shape) for d in sharding.mesh.devices.flat}


def _group(regions: dict[int, Region]) -> dict[Region, tuple[int, ...]]:
    groups: dict[Region, list[int]] = {}
    for device, region in regions.items():
        groups.setdefault(region, []).append(device)
    return {region: tuple(devices) for region, devices in groups.items()}


def _pick(devices: tuple[int, ...], rule: LeaderRule) -> int:
    return devices[0] if rule == "first" else devices[-1]


def replica_axes(sharding: NamedSharding) -> tuple[str, ...]:
    """Mesh axes (size > 1) the sharding does not use: the axes a shard is replicated over."""
    used = set()
    for entry in sharding.spec:
        used.update((entry,) if isinstance(entry, str) else entry or ())
    return tuple(
        a for a in sharding.mesh.axis_names if a not in used and sharding.mesh.shape[a] > 1
    )


def naive_device_put_bytes(
    src: NamedSharding, dst: NamedSharding, shape: Sequence[int], dtype: Any
) -> int:
    """Bytes a plain ``jax.device_put(x, dst)`` moves between devices.

    Every destination shard counts whole, minus the part its own device already holds
    in the source layout.
    """
    itemsize = np.dtype(dtype).itemsize
    src_regions = device_regions(src, shape)
    total = 0
    for device, region in device_regions(dst, shape).items():
        have = src_regions.get(device)
        total += region_size(region) - (0 if have is None else region_size(intersect(region, have)))
    return total * itemsize


def make_plan(
    edge: EdgeSpec,
    shape: Sequence[int],
    dtype: Any,
    *,
    src_leader: LeaderRule = "last",
    dst_leader: LeaderRule = "first",
) -> TransferPlan:
    """Plans moving an activation of ``shape``/``dtype`` across ``edge``.

    Args:
        edge: the source and destination endpoints.
        shape: global activation shape, e.g. ``(B, N, D)``.
        dtype: activation dtype.
        src_leader: which device of a source slice sends it (``"last"``: as Megatron).
        dst_leader: which device of a destination lane receives it (``"first"``).

    Returns:
        The plan (cached: equal arguments return the same object).

    Raises:
        BoundaryError: the shape does not fit one of the two shardings.
    """
    return _make_plan(
        edge, tuple(int(n) for n in shape), np.dtype(dtype).name, src_leader, dst_leader
    )


@functools.lru_cache(maxsize=512)
def _make_plan(
    edge: EdgeSpec,
    shape: tuple[int, ...],
    dtype: str,
    src_leader: LeaderRule,
    dst_leader: LeaderRule,
) -> TransferPlan:
    edge.validate(shape)
    itemsize = np.dtype(dtype).itemsize
    src_regions = device_regions(edge.src.sharding, shape)
    dst_regions = device_regions(edge.dst.sharding, shape)
    common = dict(edge=edge, shape=shape, dtype=dtype, src_leader=src_leader)
    if edge.placement == "colocated" and set(src_regions) == set(dst_regions):
        return TransferPlan(
            **common,
            mode="traced",
            copies=(),
            lanes=(),
            local=_traced_local(src_regions, dst_regions, itemsize),
            dst_leader=dst_leader,
        )

    colocated = edge.placement == "colocated"
    if colocated:
        # One island: every destination device fetches only the blocks it lacks (an
        # all-gather pattern among the shared devices); a leader + broadcast would
        # re-send blocks that replicas already hold.
        lanes = [Lane(region, (d,), d) for d, region in dst_regions.items()]
    else:
        lanes = [
            Lane(region, devices, _pick(devices, dst_leader))
            for region, devices in _group(dst_regions).items()
        ]
    src_lanes = _group(src_regions)
    copies = []
    for lane in lanes:
        for src_region, src_devices in src_lanes.items():
            block = intersect(lane.region, src_region)
            if block is None:
                continue
            # A leader that already holds the block slices it locally (colocated only).
            src = lane.leader if lane.leader in src_devices else _pick(src_devices, src_leader)
            nbytes = 0 if src == lane.leader else region_size(block) * itemsize
            copies.append(Copy(src, lane.leader, block, nbytes, cross_island=not colocated))
    axes = () if colocated else replica_axes(edge.dst.sharding)
    bcast = sum((len(lane.devices) - 1) * region_size(lane.region) for lane in lanes) * itemsize
    local = LocalCollective("broadcast", axes, bcast) if axes else LocalCollective("none", (), 0)
    return TransferPlan(
        **common,
        mode="copies",
        copies=tuple(copies),
        lanes=tuple(lanes),
        local=local,
        dst_leader=dst_leader,
    )


def _traced_local(
    src_regions: dict[int, Region], dst_regions: dict[int, Region], itemsize: int
) -> LocalCollective:
    missing, gather_only, equal = 0, True, True
    for device, region in dst_regions.items():
        have = src_regions[device]
        missing += region_size(region) - region_size(intersect(region, have))
        equal &= region == have
        gather_only &= intersect(region, have) == have
    if equal:
        kind = "none"
    elif missing == 0:
        kind = "slice"
    else:
        kind = "all_gather" if gather_only else "reshard"
    return LocalCollective(kind, (), missing * itemsize)
