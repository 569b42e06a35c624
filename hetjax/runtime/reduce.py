"""The end of a step: one reduction and update per stage, and the step's metrics.

Every stage sums its per-replica gradients once (the one DP reduction) and reports its
squared gradient norms; the global norm over ALL stages clips every stage's update
(:func:`hetjax.clip_by_global_norm` receives it); the loss is the sink's summed loss
over all microbatches divided by the supervised-token count of the global batch.

Both finishes return :class:`StepMetrics`. In one process its values stay device
scalars until first read, so the host loop can dispatch step N before reading step N-1
(STYLE 12: the host never stalls the devices). Across processes a global norm needs the
host: each stage's scalars are counted by the process that owns its first device and
one host all-gather per kind combines them, so the values arrive as host floats.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hetjax.distributed.rendezvous import FirstCalls
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


def finish_step(
    programs: Mapping[StageKey, StageProgram],
    state: TrainState,
    acc: Mapping[StageKey, Any],
    losses: Sequence[jax.Array],
    normalizer: jax.Array,
    *,
    anchor: jax.Device,
    guard: Any,
    record: Callable[[StageKey, str, tuple, Any, float], None],
) -> tuple[TrainState, StepMetrics]:
    """One process: reduce, clip with the global norm, update; device-scalar metrics.

    Args:
        programs: every stage's programs.
        state: the :class:`~hetjax.runtime.state.TrainState` (its arrays are donated).
        acc: per-stage accumulated per-replica gradients.
        losses: the sink's summed loss per microbatch.
        normalizer: supervised tokens of the global batch.
        anchor: the device where per-stage scalars are summed.
        guard: the executor's in-flight guard (``wait``/``hold`` around programs with collectives).
        record: reports a program call to the observers.

    Returns:
        The updated state and the metrics.
    """

    def gather(scalars):  # sums per-stage scalars on the anchor device (asynchronously)
        return sum(jax.device_put(s, anchor) for s in scalars)

    reduced = {}
    for k, p in programs.items():
        t0 = time.perf_counter()  # the call's window includes its compile (collectives)
        collective = guard.enabled and p.collectives("reduce", acc[k])
        guard.wait(p.devices, collective)
        reduced[k] = p.reduce(acc[k])
        record(k, "reduce", (acc[k],), reduced[k], t0)
        guard.hold(p.devices, reduced[k], collective)
    sq = defaultdict(list)
    for _, norms in reduced.values():
        for name, v in norms.items():
            sq[name].append(v)
    sq = {name: gather(vs) for name, vs in sq.items()}
    global_norm = jnp.sqrt(sum(sq.values()))
    params, opt_state = dict(state.params), dict(state.opt_state)
    param_sq = defaultdict(list)
    for k, p in programs.items():
        args = (params[k], opt_state[k], reduced[k][0], jax.device_put(global_norm, p.replicated))
        t0 = time.perf_counter()
        collective = guard.enabled and p.collectives("update", *args)
        guard.wait(p.devices, collective)
        params[k], opt_state[k], norms = out = p.update(*args)
        record(k, "update", args, out, t0)
        guard.hold(p.devices, (params[k], norms), collective)
        for name, v in norms.items():
            param_sq[name].append(v)
    guard.clear()
    metrics = StepMetrics(
        {
            "loss": gather(losses),
            "grad_norm": global_norm,
            **{f"grad_norm/{n}": jnp.sqrt(v) for n, v in sq.items()},
            **{f"param_norm/{n}": jnp.sqrt(gather(v)) for n, v in param_sq.items()},
            "supervised_tokens": normalizer,
        }
    )
    return TrainState(params, opt_state, state.step + 1), metrics


def finish_step_multiprocess(
    programs: Mapping[StageKey, StageProgram],
    state: TrainState,
    acc: Mapping[StageKey, Any],
    losses: Sequence[jax.Array],
    normalizer: jax.Array,
    *,
    sink_last: StageKey,
    first_calls: FirstCalls,
) -> tuple[TrainState, StepMetrics]:
    """As :func:`finish_step`, with scalars summed on the host across processes.

    A stage on other processes' devices only (``StageProgram.local`` False) is neither
    reduced nor updated here: its state stays the stand-ins it is, and its norms count
    zero, under the names its owners report (every process sums the same names).

    ``first_calls``: the executor's; every process meets all others before its first
    host all-gather of each size (it compiles a small collective program inside, and
    before it the processes compiled different reduce/update programs: see
    :mod:`hetjax.distributed.rendezvous`)."""
    from jax.experimental import multihost_utils

    everyone = tuple(range(jax.process_count()))

    def owned(key: StageKey) -> bool:  # this process reports the stage's scalars
        return programs[key].mesh.devices.flat[0].process_index == jax.process_index()

    def allsum(local: dict[str, float]) -> dict[str, float]:
        names = sorted(local)
        mine = np.asarray([local[n] for n in names], np.float64)
        first_calls.once("finish allgather", everyone, key=mine.shape)
        return dict(zip(names, multihost_utils.process_allgather(mine).sum(0), strict=True))

    def local_sums(per_stage: dict[StageKey, dict[str, jax.Array]]) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for key, norms in per_stage.items():
            for name, v in norms.items():
                out[name] += float(v.addressable_data(0)) if owned(key) else 0.0
        return out

    def names_only(names) -> dict[str, None]:  # a remote stage's norms, never read
        return dict.fromkeys(names)

    reduced = {
        k: p.reduce(acc[k]) if p.local else (None, names_only(p.acc_shardings))
        for k, p in programs.items()
    }
    sq = allsum(local_sums({k: r[1] for k, r in reduced.items()}))
    global_norm = float(np.sqrt(sum(sq.values())))
    params, opt_state = dict(state.params), dict(state.opt_state)
    param_norms = {}
    for k, p in programs.items():
        if not p.local:
            param_norms[k] = names_only(p.param_shardings)
            continue
        params[k], opt_state[k], param_norms[k] = p.update(
            params[k],
            opt_state[k],
            reduced[k][0],
            put_global(np.float32(global_norm), p.replicated),
        )
    loss = sum(float(l.addressable_data(0)) for l in losses) if owned(sink_last) else 0.0
    totals = allsum({**{f"sq/{n}": v for n, v in local_sums(param_norms).items()}, "loss": loss})
    metrics = {
        "loss": totals["loss"],
        "grad_norm": global_norm,
        **{f"grad_norm/{n}": float(np.sqrt(v)) for n, v in sq.items()},
        **{
            f"param_norm/{n[3:]}": float(np.sqrt(v))
            for n, v in totals.items()
            if n.startswith("sq/")
        },
        "supervised_tokens": float(normalizer),
    }
    return TrainState(params, opt_state, state.step + 1), StepMetrics(metrics, on_host=True)
