"""Feeding a step: microbatch slices of the global batch, and token routes.

The executor gets ONE global batch per step (host numpy arrays, the same on every
process). :class:`Feed` cuts microbatch ``m`` for a stage, stores sequence inputs of a
``cp > 1`` module in the zigzag layout (:func:`hetjax.meshes.zigzag_permutation`), and
puts them on the stage's mesh with the batch rule (:func:`hetjax.meshes.batch_sharding`);
only this process's shards are built. :func:`local_rows` says, from the same shardings,
which global rows those shards cover, so a data loader can read only those. For links
into a ``cp > 1`` module that merges tokens into placeholders it computes, once per
step, which tokens each cp rank receives (:mod:`hetjax.ops.token_routing`).
:func:`absent_modules` says which encoders a batch gives nothing to do (no image), so the
step leaves them out (:func:`hetjax.schedules.without_modules`). A rebalanced encoder's
inputs and block inputs (on every stage) are laid out in its step's balanced slot order,
dealt by the module's own cost (:mod:`hetjax.runtime.rebalance`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from hetjax.meshes import batch_sharding, zigzag_permutation
from hetjax.ops.token_routing import exchange_routes, token_routes
from hetjax.runtime.graph import Link, ModuleSpec, TrainGraph
from hetjax.runtime.placement import put_global
from hetjax.runtime.programs import StageProgram
from hetjax.runtime.rebalance import Rebalance, batch_ranks
from hetjax.runtime.transfer import LinkTransfer, Route


class Feed:
    """One step's inputs: ``batch`` split into ``microbatches`` for every stage.

    Args:
        batch: the global batch (host arrays with a leading batch axis).
        microbatches: microbatches per step.
        routed: link ``(src, dst)`` -> ``(batch key of the placeholders, placeholder id)``.
        links: the link transfers, for where a route's arrays live.
        cp: module -> its context-parallel degree.
        rebalance: the modules whose slots are balanced over their batch ranks.
    """

    def __init__(
        self,
        batch: Mapping[str, np.ndarray],
        microbatches: int,
        *,
        routed: Mapping[tuple[str, str], tuple[str, int]],
        links: Mapping[tuple[str, str], LinkTransfer],
        cp: Mapping[str, int],
        rebalance: Sequence[ModuleSpec] = (),
    ):
        self.batch = batch
        self.microbatches = microbatches
        self.size = next(iter(batch.values())).shape[0] // microbatches
        self._routed, self._links, self._cp = routed, links, cp
        self._routes: dict[tuple[str, str], list[Route]] = {}
        if rebalance and jax.process_count() > 1:
            raise ValueError(
                "rebalance runs in one process only (a process reads only its own rows); "
                "drop parallel.rebalance"
            )
        self._rebalance = {spec.name: spec for spec in rebalance}
        self._balanced: dict[str, Rebalance | None] = {}

    def inputs(self, prog: StageProgram, m: int) -> dict[str, jax.Array]:
        """Microbatch ``m`` of the batch keys stage ``prog`` reads, on its mesh."""
        out = {}
        balanced = self.balanced(prog.spec.name, prog.mesh)
        moved = (*prog.spec.inputs, *prog.spec.block_inputs)  # every stage: block inputs
        for k in prog.batch_keys:
            value = self.batch[k][m * self.size : (m + 1) * self.size]
            if balanced is not None and k in moved:
                value = balanced.inputs(value, m)
            if k in prog.spec.seq_inputs and prog.spec.layout.cp > 1:  # stored load-balanced
                value = value[:, zigzag_permutation(value.shape[1], prog.spec.layout.cp)]
            out[k] = put_global(value, input_sharding(prog, k, value.ndim))
        return out

    def balanced(self, module: str, mesh: Mesh | None = None) -> Rebalance | None:
        """The step's balanced slot order of ``module`` (made on the first call, with its
        ``mesh``), or ``None`` where it is not rebalanced or has one batch rank."""
        if module not in self._balanced and mesh is not None:
            spec, ranks = self._rebalance.get(module), batch_ranks(mesh)
            if spec is not None and ranks > 1:
                self._balanced[module] = Rebalance(spec, self.batch, self.microbatches, ranks)
        return self._balanced.get(module)

    @property
    def metrics(self) -> dict[str, float]:
        """Every rebalanced module's ``imbalance/``, ``imbalance_without/`` and
        ``rebalance_bytes/`` metrics (:meth:`Rebalance.metrics`; a module the step left
        out, or with one batch rank, has nothing to balance)."""
        out = {}
        for name in self._rebalance:
            b = self._balanced.get(name)
            out.update(b.metrics(name) if b else Rebalance.idle_metrics(name))
        return out

    def route(self, link: tuple[str, str], m: int, num_tokens: int) -> Route | None:
        """Microbatch ``m``'s token routing on ``link`` (``num_tokens`` per sample).

        Built on the first call of the step from the whole batch, so every microbatch of
        the step uses one slot count (one compiled shape)."""
        if link not in self._routed:
            return None
        if link not in self._routes:
            self._routes[link] = self._build_routes(link, num_tokens)
        return self._routes[link][m]

    def existing_route(self, link: tuple[str, str], m: int) -> Route | None:
        """The route the forward of microbatch ``m`` used on ``link`` (for its backward)."""
        return self._routes[link][m] if link in self._routes else None

    def _build_routes(self, link: tuple[str, str], n: int) -> list[Route]:
        key, placeholder = self._routed[link]
        transfer = self._links[link]
        cp = self._cp[link[1]]
        idx = token_routes(np.asarray(self.batch[key]) == placeholder, n, cp)
        size = len(idx) // self.microbatches
        routes = []
        for i in range(self.microbatches):
            part = idx[i * size : (i + 1) * size]
            if transfer.exchange and n % cp == 0:  # across islands: exchange at dst
                send, recv = exchange_routes(part, n)
                sharding = transfer.split_sharding
                routes.append(
                    Route(n, send=put_global(send, sharding), recv=put_global(recv, sharding))
                )
            else:
                routes.append(Route(n, index=put_global(part, transfer.index_sharding)))
        return routes


def input_sharding(prog: StageProgram, key: str, ndim: int) -> NamedSharding:
    """How batch key ``key`` (``ndim`` dimensions) of a microbatch lies on ``prog``'s mesh."""
    return batch_sharding(prog.mesh, ndim, sequence=key in prog.spec.seq_inputs)


def rows_held(
    sharding: NamedSharding, shape: Sequence[int], devices: Iterable[jax.Device] | None = None
) -> np.ndarray:
    """The rows (indices along dim 0) of a ``shape`` array under ``sharding`` that the
    shards of ``devices`` cover, sorted (default: this process's devices). E.g. 8 rows
    split over a ``dp=4`` mesh: its first two devices cover rows 0-3.
    """
    shape = tuple(shape)
    if devices is None:
        index = sharding.addressable_devices_indices_map(shape)
    else:
        wanted = set(devices)
        index = {d: i for d, i in sharding.devices_indices_map(shape).items() if d in wanted}
    rows: set[int] = set()
    for idx in index.values():
        rows.update(range(*idx[0].indices(shape[0])))
    return np.asarray(sorted(rows), np.int64)


def local_rows(
    programs: Iterable[StageProgram],
    microbatches: int,
    shapes: Mapping[str, Sequence[int]],
    devices: Iterable[jax.Device] | None = None,
) -> dict[str, np.ndarray]:
    """For each batch key of ``shapes`` (its GLOBAL batch shape), the global rows that the
    stages' inputs place on ``devices`` (default: this process's devices), sorted: the
    only rows :meth:`Feed.inputs` reads of it. A key no stage reads there gets none.

    Args:
        programs: the executor's stage programs (``Executor.programs.values()``).
        microbatches: microbatches per step.
        shapes: batch key -> shape of the global batch array.
        devices: whose shards count; ``None``: this process's (``jax.local_devices()``).
    """
    devices = None if devices is None else tuple(devices)
    rows: dict[str, set[int]] = {k: set() for k in shapes}
    for prog in programs:
        for k in prog.batch_keys:
            if k not in shapes:
                continue
            shape = tuple(shapes[k])
            size = shape[0] // microbatches
            micro = (size, *shape[1:])
            held = rows_held(input_sharding(prog, k, len(micro)), micro, devices)
            for m in range(microbatches):
                rows[k].update((m * size + held).tolist())
    return {k: np.asarray(sorted(v), np.int64) for k, v in rows.items()}


def _slot(graph: TrainGraph, link: Link) -> tuple[str, int] | None:
    """(batch key, placeholder id) whose positions ``link``'s tokens replace, if any."""
    slots = graph.module(link.dst).token_slots
    return next(((key, pid) for name, key, pid in slots if name == link.name), None)


def skippable_modules(graph: TrainGraph) -> tuple[str, ...]:
    """The modules a step can leave out when its batch has none of their placeholders:
    sources (nothing feeds them), not the sink, whose every output replaces placeholder
    tokens of its consumer (``ModuleSpec.token_slots``), and with no auxiliary loss (an
    MoE encoder's balancing loss would still give it a gradient on padding images, which
    the single-device reference computes)."""

    def moe(part) -> bool:
        paths = jax.tree.leaves_with_path(part.abstract_params())
        return any("router" in jax.tree_util.keystr(k) for k, _ in paths)

    return tuple(
        spec.name
        for spec in graph.modules
        if spec.name != graph.sink
        and not graph.links_into(spec.name)
        and graph.links_from(spec.name)
        and all(_slot(graph, l) for l in graph.links_from(spec.name))
        and not any(moe(part) for part in spec.parts)
    )


def absent_modules(
    batch: Mapping[str, np.ndarray], graph: TrainGraph, candidates: Collection[str]
) -> frozenset[str]:
    """Those of ``candidates`` (:func:`skippable_modules`) that ``batch`` gives nothing to
    do: no placeholder of any of their links occurs in it (a batch with no image leaves
    the vision encoder out). Nothing reads their output, so its gradient is exactly zero
    and leaving them out changes no value."""

    def unused(link: Link) -> bool:
        key, pid = _slot(graph, link)
        return not np.any(np.asarray(batch[key]) == pid)

    return frozenset(n for n in candidates if all(unused(l) for l in graph.links_from(n)))
