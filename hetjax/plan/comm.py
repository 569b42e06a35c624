"""Collective bytes and times over the right link, with the node topology.

Ranks of a module are numbered as hetjax places them (``hetjax.meshes.placement``): TP on
neighbouring devices, then CP, EP, DP, and PP outermost, each island starting on a node
boundary. A group of ``size`` ranks spaced ``stride`` apart spans ``stride x size``
consecutive devices: inside one NVLink domain when that is at most the node size,
otherwise over InfiniBand (each GPU its own NIC). Times are ring algorithms' (bandwidth
term, per device) plus a fixed latency per call.
"""

from __future__ import annotations

from typing import Literal

from .hardware import HardwareProfile

CollectiveKind = Literal["all-reduce", "all-gather", "reduce-scatter", "all-to-all", "p2p"]


def crosses_nodes(stride: int, size: int, hw: HardwareProfile) -> bool:
    """Whether a group of ``size`` ranks ``stride`` apart leaves one node."""
    return size > 1 and stride * size > hw.gpus_per_node


def wire_bytes(kind: CollectiveKind, nbytes: float, size: int) -> float:
    """Bytes one device sends for a collective over ``size`` ranks on a buffer of
    ``nbytes`` (the full buffer per device, as :mod:`hetjax.inspect.hlo` counts it)."""
    if size <= 1:
        return 0.0
    if kind == "p2p":
        return nbytes
    share = (size - 1) / size
    return (2 * share if kind == "all-reduce" else share) * nbytes


def collective_time(
    kind: CollectiveKind,
    nbytes: float,
    size: int,
    *,
    crosses: bool,
    hw: HardwareProfile,
    calls: float = 1.0,
) -> float:
    """Seconds for ``calls`` collectives of ``kind`` on ``nbytes`` each over ``size`` ranks."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    gbps = hw.link_gbps(crosses)
    return calls * (wire_bytes(kind, nbytes, size) / (gbps * 1e9) + hw.latency_us * 1e-6)
