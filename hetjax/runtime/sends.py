"""The step's sends: activations and cotangents moved between stages.

A ``SEND_F`` op moves a stage's output to the next stage, a ``SEND_B`` op an input
cotangent back to the stage it came from. Inside a module, consecutive pipeline stages
share their layout, so a send is a direct device-to-device copy
(:class:`~hetjax.runtime.transfer.StageTransfer`); between modules a boundary
communicator (:class:`~hetjax.runtime.transfer.LinkTransfer`) moves the activation from
the source's layout to the destination's and routes the gradient back. Into a
``cp > 1`` module that merges the tokens into placeholders, each cp rank receives only
the tokens of the positions it stores (the route comes from the step's
:class:`~hetjax.runtime.feed.Feed`). A rebalanced encoder's output returns to the
consumer's sample order before its boundary, its cotangent after
(:mod:`hetjax.runtime.rebalance`).

Kept apart from the executor's walk over the ops: a send only needs the meshes, the
stages' device sets, the in-flight guard it waits on and the observers it tells.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hetjax.meshes import ModuleMesh
from hetjax.runtime.feed import Feed
from hetjax.runtime.graph import TrainGraph
from hetjax.runtime.inflight import InFlight
from hetjax.runtime.lowering import Op, StageKey
from hetjax.runtime.observers import Observers, Transfer
from hetjax.runtime.transfer import LinkTransfer, StageTransfer


class Sends:
    """The transfers between the stages of ``graph`` and how a step's sends use them.

    Args:
        graph: the modules and links.
        meshes: each module's mesh.
        devices: each stage's device set.
        routed: the links whose tokens are routed to their cp ranks
            (:attr:`~hetjax.runtime.plan.RunPlan.routed`).
        inflight: the executor's in-flight guard (sends wait on it).
        observers: told of every transfer.
        multiprocess: several processes (transfers are collectives on union meshes).
    """

    def __init__(
        self,
        graph: TrainGraph,
        meshes: Mapping[str, ModuleMesh],
        devices: Mapping[StageKey, frozenset],
        *,
        routed: Any,
        inflight: InFlight,
        observers: Observers,
        multiprocess: bool,
    ):
        self.graph, self.devices = graph, devices
        self._inflight, self._observers = inflight, observers
        self.links = {
            (l.src, l.dst): LinkTransfer(
                meshes[l.src],
                meshes[l.dst],
                src_stage=graph.module(l.src).layout.pp - 1,
                dst_stage=0,
                multiprocess=multiprocess,
                routed=(l.src, l.dst) in routed,
            )
            for l in graph.links
        }
        self.stage_links = {
            (spec.name, s): StageTransfer(meshes[spec.name], s, multiprocess=multiprocess)
            for spec in graph.modules
            for s in range(spec.layout.pp - 1)
        }

    def link_name(self, src: str, dst: str) -> str:
        """The name of the link from module ``src`` into module ``dst``."""
        return next(l.name for l in self.graph.links_into(dst) if l.src == src)

    def forward(self, op: Op, feed: Feed, y: Any) -> Any:
        """``SEND_F``: stage ``op.stage``'s output ``y`` on the peer stage."""
        key, dst = op.stage, op.peer
        devices = self.devices[key] | self.devices[dst]
        if dst[0] == key[0]:  # a device-to-device copy: never a collective in one process
            transfer = self.stage_links[key]
            self._observe(op, key, dst, y, lambda: transfer.moved_bytes(y, "forward"))
            self._inflight.wait(devices, transfer.boundary is not None)
            return transfer.forward(y)
        pair = (key[0], dst[0])
        y = self._rebalanced(feed, key, y, op.microbatch, "forward")
        route = feed.route(pair, op.microbatch, y.shape[1])
        link = self.links[pair]
        self._observe(op, key, dst, y, lambda: link.moved_bytes(y, route, "forward"))
        self._inflight.wait(devices, link.collective(y, route, "forward"))
        return link.forward(y, route)

    def backward(self, op: Op, feed: Feed, gx: Any) -> tuple[Any, bool]:
        """``SEND_B``: the cotangent ``gx`` moved to the peer stage, and whether moving it
        ran a collective."""
        key, src = op.stage, op.peer
        devices = self.devices[key] | self.devices[src]
        if src[0] == key[0]:
            transfer = self.stage_links[src]
            self._observe(op, key, src, gx, lambda: transfer.moved_bytes(gx, "backward"))
            collective = transfer.boundary is not None
            self._inflight.wait(devices, collective)
            return transfer.backward(gx), collective
        pair = (src[0], key[0])
        ct = gx[self.link_name(*pair)]
        route = feed.existing_route(pair, op.microbatch)
        link = self.links[pair]
        self._observe(op, key, src, ct, lambda: link.moved_bytes(ct, route, "backward"))
        collective = link.collective(ct, route, "backward")
        self._inflight.wait(devices, collective)
        back = self._rebalanced(feed, src, link.backward(ct, route), op.microbatch, "backward")
        return back, collective or feed.balanced(src[0]) is not None

    def _rebalanced(self, feed: Feed, key: StageKey, x: Any, m: int, direction: str) -> Any:
        """``x`` (stage ``key``'s output, or its cotangent) moved between the consumer's
        order and a rebalanced encoder's (:mod:`hetjax.runtime.rebalance`): an all-to-all
        among the stage's devices, ordered by the in-flight guard."""
        balanced = feed.balanced(key[0])
        if balanced is None:
            return x
        self._inflight.wait(self.devices[key])
        x = getattr(balanced, direction)(x, m)
        self._inflight.hold(self.devices[key], x)
        return x

    def _observe(self, op: Op, src: StageKey, dst: StageKey, value, nbytes) -> None:
        if self._observers.transfer:
            event = Transfer(op, src, dst, src[0] != dst[0], value, int(nbytes()))
            self._observers.on_transfer(event)
