"""Balancing an encoder's images over its data-parallel ranks, per step (``rebalance``).

The loader orders a step's rows for the LLM's tokens; a sample's images go with its row,
so an encoder rank whose rows carry many images works while the others wait. With
``rebalance=("vision",)`` every microbatch's image slots are dealt to the encoder's
batch ranks by their own cost instead (OrchMLLM's and MegaScale-Omni's balance at the
encoder/LLM boundary), and its outputs return to the consumer's sample order before the
link's boundary:

* In: the encoder's inputs come from the host, which places each slot straight on the
  rank that encodes it (:meth:`Rebalance.inputs`, inside the feed): the "all-to-all
  before the module" costs nothing here, so none runs.
* Out: one ``all_to_all`` over the encoder's batch axes on its last stage's mesh
  (:func:`exchange`) puts every slot's tokens back at its row and slot; only the slots
  that changed rank move, each (sender, receiver) pair in one block padded to ``C``
  slots. The boundary then moves a consumer-ordered array exactly as without
  rebalancing (cp token routing included). The cotangent goes back by the same program
  with the inverse permutation: a permutation's transpose is its inverse, so it is exact.

Why not fold the permutation into the LLM's token routing instead: the routing places a
row's tokens within that row on the LLM's side, and the boundary's plans move slices of
one global array; a permutation across rows is neither, so it runs as its own program.
Values never change, only where each image is encoded: the losses equal the unbalanced
run's up to the order in which the encoder's parameter gradients are summed.

A unit is one input slot (``ModuleSpec.input_slots`` per row; the output's dim 1 is that
many equal blocks in slot order); its inputs and its block inputs (``ModuleSpec.inputs``,
``block_inputs``: per-patch positions, window ids) move with it. Its cost is the
module's own (``ModuleSpec.unit_cost``: the Qwen tower's patches per row), by default 1
when its input is nonzero (probed: :func:`unit_costs`): the loaders leave unused slots
zero (:mod:`models.llava.rows`). Correctness never depends on the cost (every slot
moves, padding included), only the balance does.
Single-process only: a process reads only its own rows of the batch.

Shape key: B rows of a microbatch, K slots per row, U = B*K units, R batch ranks,
u = U/R units per rank, C units per (sender, receiver) block, N tokens per slot.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetjax.meshes import LayoutError
from hetjax.meshes.rules import LOGICAL_AXIS_RULES
from hetjax.runtime.graph import ModuleSpec
from hetjax.runtime.placement import put_global


def check_rebalance(names: Sequence[str], modules: Sequence[str], allowed: Sequence[str]) -> None:
    """``names`` are encoders that can be rebalanced (``allowed``, of the graph's
    ``modules``): one line naming the fix otherwise."""
    for n in names:
        if n not in modules:
            raise LayoutError(
                f"rebalance names {n!r}, which is no module of the graph; use one of "
                f"{', '.join(allowed) or 'none (no encoder fills placeholders)'}"
            )
        if n not in allowed:
            raise LayoutError(
                f"rebalance={n!r}: {n!r} is no encoder whose outputs fill placeholder tokens "
                f"(with no auxiliary loss), the only kind rebalanced; use one of "
                f"{', '.join(allowed) or 'none'}"
            )
    if len(set(names)) != len(names):
        raise LayoutError(f"rebalance names a module twice: {list(names)}; name each once")


def unit_costs(inputs: Sequence[np.ndarray], slots: int, *, probes: int = 1024) -> np.ndarray:
    """``[B * K]``: 1 for a slot whose input (any of ``inputs``, ``[B, K, ...]`` or
    ``[B, ...]`` when ``K == 1``) is nonzero at one of ``probes`` evenly spaced values,
    else 0. Probing, not scanning: a step's images are hundreds of MB on the host, and a
    real image that is zero at every probe only costs balance, never a value."""
    used = None
    for x in inputs:
        flat = np.asarray(x).reshape(x.shape[0] * slots, -1)
        at = np.unique(np.linspace(0, flat.shape[1] - 1, probes).astype(np.int64))
        nonzero = np.any(flat[:, at] != 0, axis=1)
        used = nonzero if used is None else used | nonzero
    return used.astype(np.int64)


def balanced_order(costs_U: np.ndarray, ranks: int) -> np.ndarray:
    """``order[U]``: the unit that encoder position ``p`` holds (rank ``p // u``).

    Unit costs (an image each): every rank gets ``floor`` or ``ceil`` of the real units'
    share (the ranks that hold the most already get the ``ceil`` s), keeping as many
    units where they are as that allows, so the all-to-all moves few. Other costs
    (patches): :func:`weighted_order`."""
    if np.any(costs_U > 1):
        return weighted_order(costs_U, ranks)
    u = len(costs_U) // ranks
    rank_of = np.arange(len(costs_U)) // u
    real = costs_U > 0
    have = np.bincount(rank_of[real], minlength=ranks)
    base, extra = divmod(int(real.sum()), ranks)
    target = np.full(ranks, base)
    target[np.argsort(-have, kind="stable")[:extra]] += 1
    kept: list[list[int]] = [[] for _ in range(ranks)]
    spare_real: list[int] = []
    spare_pad: list[int] = []
    for r in range(ranks):
        mine = np.arange(r * u, (r + 1) * u)
        mine_real, mine_pad = mine[real[mine]], mine[~real[mine]]
        keep = min(len(mine_real), target[r])
        kept[r] = mine_real[:keep].tolist()
        spare_real += mine_real[keep:].tolist()
        # Padding stays where the rank's real units leave room for it.
        room = u - target[r]
        kept[r] += mine_pad[:room].tolist()
        spare_pad += mine_pad[room:].tolist()
    for r in range(ranks):
        need = target[r] - sum(real[i] for i in kept[r])
        kept[r] += spare_real[:need]
        spare_real = spare_real[need:]
    for r in range(ranks):
        need = u - len(kept[r])
        kept[r] += spare_pad[:need]
        spare_pad = spare_pad[need:]
    return np.concatenate([np.sort(k) for k in kept]).astype(np.int64)


def weighted_order(costs_U: np.ndarray, ranks: int) -> np.ndarray:
    """:func:`balanced_order` of units with unequal costs, ``u`` units per rank.

    Largest cost first, each real unit goes to the least loaded rank with room (its own
    on a tie): within 4/3 of the best busiest rank (Graham's LPT bound). The bins are
    then given to the ranks that already hold most of their units (an assignment
    problem), and padding stays where there is room, so the all-to-all moves few. Where
    the rows' own order is no busier (LPT is not optimal), it stays: nothing moves."""
    # Imported here, not with the module: scipy.optimize is 0.26 s of hetjax.runtime's
    # 1.5 s import, which every process pays; only a rebalance by unequal costs needs it.
    import scipy.optimize  # jax's own dependency

    n = len(costs_U)
    u = n // ranks
    home = np.arange(n) // u
    load, count = np.zeros(ranks), np.zeros(ranks, np.int64)
    bin_of = np.full(n, -1)
    for i in np.argsort(-costs_U, kind="stable"):
        if costs_U[i] <= 0:
            break
        room = np.flatnonzero(count < u)
        best = room[load[room] == load[room].min()]
        b = home[i] if home[i] in best else best[0]
        bin_of[i], load[b], count[b] = b, load[b] + costs_U[i], count[b] + 1
    real = bin_of >= 0
    kept = np.zeros((ranks, ranks), np.int64)
    np.add.at(kept, (bin_of[real], home[real]), 1)
    _, rank_of_bin = scipy.optimize.linear_sum_assignment(kept, maximize=True)
    rank_of = np.full(n, -1)
    rank_of[real] = rank_of_bin[bin_of[real]]
    room = u - np.bincount(rank_of[real], minlength=ranks)
    pads = np.flatnonzero(~real)
    for i in pads:  # padding first at home ...
        if room[home[i]] > 0:
            rank_of[i], room[home[i]] = home[i], room[home[i]] - 1
    for i in pads[rank_of[pads] < 0]:  # ... the rest where room is left
        r = int(np.flatnonzero(room > 0)[0])
        rank_of[i], room[r] = r, room[r] - 1
    order = np.argsort(rank_of, kind="stable")
    as_is = costs_U.reshape(ranks, u).sum(1).max()
    return np.arange(n) if costs_U[order].reshape(ranks, u).sum(1).max() >= as_is else order


def imbalance(
    costs_MxU: np.ndarray, ranks: int, orders: Sequence[np.ndarray] | None = None
) -> float:
    """Sum over microbatches of the busiest rank's cost over the sum of the mean rank's:
    how much longer the encoder's programs take than with perfect balance (1.0: even),
    with its units in ``orders`` (one per microbatch; ``None``: as the rows come)."""
    busiest = mean = 0.0
    for m, costs in enumerate(costs_MxU):
        placed = costs if orders is None else costs[orders[m]]
        per_rank = placed.reshape(ranks, -1).sum(1)
        busiest, mean = busiest + per_rank.max(), mean + per_rank.mean()
    return float(busiest / mean) if mean > 0 else 1.0


def exchange_plan(source_U: np.ndarray, ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """Host plan of :func:`exchange` that makes position ``q`` hold the unit at position
    ``source_U[q]``.

    Returns:
        ``send[R, R, C]``: for sender ``s`` and receiver ``r``, the sender-local units it
        sends (-1: padding); ``take[R, u]``: for receiver ``r``'s local position ``j``, an
        index into its own ``u`` units followed by what it received (``u + s*C + c``).
        ``C`` is rounded up to a multiple of ``ceil(u / 4)`` (few compiled shapes).
    """
    n = len(source_U)
    u = n // ranks
    dst_rank, src_rank = np.arange(n) // u, source_U // u
    moved = dst_rank != src_rank
    pair = src_rank * ranks + dst_rank
    counts = np.bincount(pair[moved], minlength=ranks * ranks)
    quantum = math.ceil(u / 4)
    c = min(u, max(1, math.ceil(int(counts.max(initial=0)) / quantum) * quantum))
    send = np.full((ranks * ranks, c), -1, np.int32)
    take = (source_U % u).astype(np.int32)
    at = np.zeros(ranks * ranks, np.int64)
    for q in np.nonzero(moved)[0]:
        k = pair[q]
        send[k, at[k]] = source_U[q] % u
        take[q] = u + src_rank[q] * c + at[k]
        at[k] += 1
    return send.reshape(ranks, ranks, c), take.reshape(ranks, u)


def _exchange_local(y_bxTx, send_1xRxC, take_1xu, *, slots, axes):
    b, tokens = y_bxTx.shape[:2]
    units = y_bxTx.reshape(b * slots, tokens // slots, *y_bxTx.shape[2:])
    idx = send_1xRxC[0].reshape(-1)
    out = jnp.take(units, jnp.maximum(idx, 0), axis=0)
    mask = (idx >= 0).reshape(-1, *(1,) * (units.ndim - 1))
    out = jnp.where(mask, out, jnp.zeros((), units.dtype))
    ranks = send_1xRxC.shape[1]
    back = jax.lax.all_to_all(out.reshape(ranks, -1, *units.shape[1:]), axes, 0, 0, tiled=True)
    pool = jnp.concatenate([units, back.reshape(-1, *units.shape[1:])])
    return jnp.take(pool, take_1xu[0], axis=0).reshape(y_bxTx.shape)


@functools.lru_cache(maxsize=64)
def _exchange_fn(mesh: Mesh, slots: int):
    batch = LOGICAL_AXIS_RULES["batch"]
    axes = tuple(a for a in ((batch,) if isinstance(batch, str) else batch) if a in mesh.shape)
    spec = PartitionSpec(batch)
    fn = jax.shard_map(
        functools.partial(_exchange_local, slots=slots, axes=axes),
        mesh=mesh,
        in_specs=(spec, spec, spec),
        out_specs=spec,
    )
    return jax.jit(fn, out_shardings=NamedSharding(mesh, spec))


def exchange(y: jax.Array, send: jax.Array, take: jax.Array, *, slots: int) -> jax.Array:
    """``y`` (``[B, K*N, ...]``, batch over the mesh's batch axes) with its units moved by
    the plan of :func:`exchange_plan` (placed with :func:`batch_ranks`' sharding)."""
    return _exchange_fn(send.sharding.mesh, slots)(y, send, take)


def batch_ranks(mesh: Mesh) -> int:
    """Slices the batch is split into on ``mesh``."""
    batch = LOGICAL_AXIS_RULES["batch"]
    return math.prod(mesh.shape[a] for a in ((batch,) if isinstance(batch, str) else batch))


class Rebalance:
    """One step's balanced order of one module's units, per microbatch.

    Args:
        spec: the module (its ``inputs``, ``input_slots`` and ``unit_cost``).
        batch: the step's global batch.
        microbatches: microbatches per step.
        ranks: the module's batch ranks (:func:`batch_ranks`).

    Raises:
        ValueError: the module's ``unit_cost`` gives no ``[B * K]`` costs (one line).
    """

    def __init__(
        self, spec: ModuleSpec, batch: Mapping[str, np.ndarray], microbatches: int, ranks: int
    ):
        self.name, self.slots, self.ranks = spec.name, spec.input_slots, ranks
        units = next(iter(batch.values())).shape[0] * self.slots
        if spec.unit_cost is None:
            costs = unit_costs([batch[k] for k in spec.inputs], self.slots)
        else:
            costs = np.asarray(spec.unit_cost(batch))
            if costs.shape != (units,) or np.any(costs < 0):
                raise ValueError(
                    f"{spec.name}: unit_cost gave costs of shape {costs.shape}; it must give "
                    f"one cost >= 0 per input slot of the batch, shape ({units},)"
                )
        self.costs_MxU = costs.reshape(microbatches, -1)  # rows split over ranks: plan_run
        self.orders = [balanced_order(c, ranks) for c in self.costs_MxU]
        self._plans: dict[tuple[int, str], tuple[jax.Array, jax.Array]] = {}
        self.moved_bytes = 0

    def inputs(self, value: np.ndarray, m: int) -> np.ndarray:
        """Microbatch ``m``'s rows of an input or block input (``[b, K, ...]``, or
        ``[b, ...]`` when ``K == 1``), its slots in the balanced order.

        Raises:
            ValueError: a block input with no dim 1 of ``K`` slots (one line).
        """
        if self.slots > 1 and (value.ndim < 2 or value.shape[1] != self.slots):
            raise ValueError(
                f"{self.name}: an input of shape {value.shape} cannot move with its "
                f"{self.slots} slots per row; give it dim 1 of {self.slots} (one per slot)"
            )
        units = value.reshape(value.shape[0] * self.slots, *value.shape[1 + (self.slots > 1) :])
        return units[self.orders[m]].reshape(value.shape)

    def forward(self, y: jax.Array, m: int) -> jax.Array:
        """The encoder's output of microbatch ``m`` back in the consumer's order."""
        return self._move(y, m, "forward")

    def backward(self, ct: jax.Array, m: int) -> jax.Array:
        """The consumer-ordered cotangent of microbatch ``m`` in the encoder's order."""
        return self._move(ct, m, "backward")

    def _move(self, x: jax.Array, m: int, direction: str) -> jax.Array:
        key = (m, direction)
        if key not in self._plans:
            order = self.orders[m]
            source = np.argsort(order) if direction == "forward" else order
            send, take = exchange_plan(source, self.ranks)
            # Nothing changed rank (already balanced): no program, nothing moves.
            moves = bool((send >= 0).any())
            sharding = NamedSharding(x.sharding.mesh, PartitionSpec(LOGICAL_AXIS_RULES["batch"]))
            placed = (put_global(send, sharding), put_global(take, sharding)) if moves else None
            self._plans[key] = (placed, send.shape[2])
        placed, c = self._plans[key]
        if placed is None:
            return x
        unit = x.size // (x.shape[0] * self.slots) * x.dtype.itemsize
        self.moved_bytes += self.ranks * (self.ranks - 1) * c * unit
        return exchange(x, *placed, slots=self.slots)

    @staticmethod
    def idle_metrics(name: str) -> dict[str, float]:
        """:meth:`metrics` of a module with nothing to balance (left out of the step, or
        one batch rank)."""
        keys = ("imbalance", "imbalance_without", "rebalance_bytes")
        return {f"{k}/{name}": float(k != "rebalance_bytes") for k in keys}

    def metrics(self, name: str) -> dict[str, float]:
        """``imbalance/<name>`` (as encoded), ``imbalance_without/<name>`` (in the rows'
        order) and ``rebalance_bytes/<name>`` (moved by the all-to-alls so far)."""
        return {
            f"imbalance/{name}": imbalance(self.costs_MxU, self.ranks, self.orders),
            f"imbalance_without/{name}": imbalance(self.costs_MxU, self.ranks),
            f"rebalance_bytes/{name}": float(self.moved_bytes),
        }
