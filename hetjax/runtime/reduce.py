"""The end of a step: one reduction and update per stage, and the step's metrics.

Every stage sums its per-replica gradients once (the one DP reduction) and reports its
squared gradient norms; the global norm over ALL stages clips every stage's update
(:func:`hetjax.clip_by_global_norm` receives it); the loss is the sink's summed loss
over all microbatches divided by the supervised-token count of the global batch.

One function, :func:`finish_step`, finishes a step in one process and in many; the two
differ only in where per-stage scalars meet, a :class:`Totals` strategy:

- :class:`OnDevice` (one process): every scalar is summed on one device, so the
  :class:`StepMetrics` values stay device scalars until first read and the host loop can
  dispatch step N before reading step N-1 (STYLE 12: the host never stalls the devices).
- :class:`OnHosts` (many processes): ``jax.device_put`` cannot gather scalars from
  other processes' devices, so each stage's scalars are counted by the process owning
  its first device and one host all-gather per batch of names combines them; the values
  arrive as host floats.

A stage on other processes' devices only (``StageProgram.local`` False) is neither
reduced nor updated: its state stays the stand-ins it is, and its norms count zero,
under the names its owners report (every process sums the same names). Every reduce
and update that runs is reported to the observers (``record``), in either case.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from hetjax.distributed.rendezvous import FirstCalls
from hetjax.runtime.inflight import InFlight
from hetjax.runtime.lowering import StageKey
from hetjax.runtime.placement import put_global
from hetjax.runtime.programs import StageProgram
from hetjax.runtime.state import TrainState


@jax.tree_util.register_pytree_node_class
class StepMetrics(Mapping[str, float]):
    """One step's metrics (``loss``, ``grad_norm``, ``grad_norm/<module>``, ...).

    A read-only mapping of host floats. Values computed on devices are fetched together
    on the first read (one ``jax.device_get``), not when the step returns; ``on_host``
    says they already are host floats. A pytree, so ``jax.block_until_ready`` and
    ``jax.device_get`` work on it.
    """

    def __init__(self, values: Mapping[str, Any], *, on_host: bool = False):
        self._values = dict(values)
        self.on_host = on_host

    def _fetch(self) -> None:
        if not self.on_host:
            fetched = jax.device_get(self._values)
            self._values = {k: float(v) for k, v in fetched.items()}
            self.on_host = True

    def is_ready(self) -> bool:
        """Whether every value is computed (reading them would not wait)."""
        return self.on_host or all(
            v.is_ready() if isinstance(v, jax.Array) else True for v in self._values.values()
        )

    def __getitem__(self, key: str) -> float:
        self._fetch()
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"StepMetrics({dict(self)})"

    def tree_flatten(self):
        keys = tuple(self._values)
        return tuple(self._values[k] for k in keys), (keys, self.on_host)

    @classmethod
    def tree_unflatten(cls, aux, children):
        keys, on_host = aux
        return cls(dict(zip(keys, children, strict=True)), on_host=on_host)


class Totals(Protocol):
    """Where the per-stage scalars of a step meet (norms, the loss): the strategy that
    :func:`finish_step` is given."""

    def total(self, parts: Mapping[str, Sequence[tuple[StageProgram, Any]]]) -> dict[str, Any]:
        """Per name, the sum of the scalars of every stage (``(program, value)``; the
        value None for a stage on other processes' devices)."""

    def sqrt(self, x: Any) -> Any:
        """The square root of a total."""

    def put(self, x: Any, program: StageProgram) -> jax.Array:
        """A total replicated on ``program``'s stage mesh (an argument of its update)."""

    def metrics(self, values: Mapping[str, Any]) -> StepMetrics:
        """The step's metrics from totals and the normalizer."""


class OnDevice:
    """One process: per-stage scalars summed on ``anchor`` (asynchronously)."""

    def __init__(self, anchor: jax.Device):
        self.anchor = anchor

    def total(self, parts: Mapping[str, Sequence[tuple[StageProgram, Any]]]) -> dict[str, Any]:
        return {n: sum(jax.device_put(v, self.anchor) for _, v in vs) for n, vs in parts.items()}

    def sqrt(self, x: Any) -> Any:
        return jnp.sqrt(x)

    def put(self, x: Any, program: StageProgram) -> jax.Array:
        return jax.device_put(x, program.replicated)

    def metrics(self, values: Mapping[str, Any]) -> StepMetrics:
        return StepMetrics(values)


class OnHosts:
    """Many processes: each stage's scalars counted by the process that owns its first
    device, then summed over processes by a host all-gather per :meth:`total`.

    Args:
        first_calls: the executor's; every process meets all others before its first
            host all-gather of each size (it compiles a small collective program inside,
            and before it the processes compiled different reduce/update programs: see
            :mod:`hetjax.distributed.rendezvous`).
    """

    def __init__(self, first_calls: FirstCalls):
        self.first_calls = first_calls
        self.everyone = tuple(range(jax.process_count()))

    @staticmethod
    def _owned(program: StageProgram) -> bool:  # this process reports the stage's scalars
        return program.mesh.devices.flat[0].process_index == jax.process_index()

    def total(self, parts: Mapping[str, Sequence[tuple[StageProgram, Any]]]) -> dict[str, Any]:
        from jax.experimental import multihost_utils

        local = {
            n: sum(float(v.addressable_data(0)) if self._owned(p) else 0.0 for p, v in vs)
            for n, vs in parts.items()
        }
        names = sorted(local)  # one order on every process
        mine = np.asarray([local[n] for n in names], np.float64)
        self.first_calls.once("finish allgather", self.everyone, key=mine.shape)
        summed = dict(zip(names, multihost_utils.process_allgather(mine).sum(0), strict=True))
        return {n: summed[n] for n in parts}  # in the order of one process's

    def sqrt(self, x: Any) -> Any:
        return float(np.sqrt(x))

    def put(self, x: Any, program: StageProgram) -> jax.Array:
        return put_global(np.float32(x), program.replicated)

    def metrics(self, values: Mapping[str, Any]) -> StepMetrics:
        return StepMetrics({k: float(v) for k, v in values.items()}, on_host=True)


def finish_step(
    programs: Mapping[StageKey, StageProgram],
    state: TrainState,
    acc: Mapping[StageKey, Any],
    losses: Sequence[jax.Array],
    normalizer: jax.Array,
    *,
    totals: Totals,
    guard: InFlight,
    record: Callable[[StageKey, str, tuple, Any, float], None],
) -> tuple[TrainState, StepMetrics]:
    """Reduce, clip with the global norm, update: the end of a step, in one process or many.

    Args:
        programs: every stage's programs.
        state: the :class:`~hetjax.runtime.state.TrainState` (its arrays are donated).
        acc: per-stage accumulated per-replica gradients (stand-ins for other processes'
            stages).
        losses: the sink's summed loss per microbatch.
        normalizer: supervised tokens of the global batch.
        totals: where per-stage scalars meet: :class:`OnDevice` in one process,
            :class:`OnHosts` across processes.
        guard: the executor's in-flight guard (``wait``/``hold`` around programs with
            collectives; off across processes).
        record: reports a program call to the observers.

    Returns:
        The updated state and the metrics.
    """

    def call(k: StageKey, p: StageProgram, kind: str, *args: Any) -> Any:
        t0 = time.perf_counter()  # the call's window includes its compile (collectives)
        collective = guard.enabled and p.collectives(kind, *args)
        guard.wait(p.devices, collective)
        out = getattr(p, kind)(*args)
        record(k, kind, args, out, t0)
        guard.hold(p.devices, out, collective)
        return out

    def norms(p: StageProgram, out: Any, shardings: Mapping[str, Any]) -> dict[str, Any]:
        return out[-1] if p.local else dict.fromkeys(shardings)  # a remote stage's: names

    reduced, grad_sq = {}, defaultdict(list)
    for k, p in programs.items():
        reduced[k] = call(k, p, "reduce", acc[k]) if p.local else None
        for name, v in norms(p, reduced[k], p.acc_shardings).items():
            grad_sq[name].append((p, v))
    sq = totals.total(grad_sq)
    global_norm = totals.sqrt(sum(sq.values()))
    params, opt_state = dict(state.params), dict(state.opt_state)
    param_sq = defaultdict(list)
    for k, p in programs.items():
        out = None
        if p.local:
            args = (params[k], opt_state[k], reduced[k][0], totals.put(global_norm, p))
            params[k], opt_state[k], _ = out = call(k, p, "update", *args)
        for name, v in norms(p, out, p.param_shardings).items():
            param_sq[f"param_norm/{name}"].append((p, v))
    guard.clear()
    sink = next(p for p in programs.values() if p.is_sink and p.last)
    rest = totals.total({"loss": [(sink, l) for l in losses], **param_sq})
    metrics = {
        "loss": rest.pop("loss"),
        "grad_norm": global_norm,
        **{f"grad_norm/{n}": totals.sqrt(v) for n, v in sq.items()},
        **{n: totals.sqrt(v) for n, v in rest.items()},
        "supervised_tokens": normalizer,
    }
    return TrainState(params, opt_state, state.step + 1), totals.metrics(metrics)
