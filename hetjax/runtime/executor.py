"""The heterogeneous executor: per-stage programs dispatched in schedule order.

A :class:`~hetjax.runtime.plan.RunPlan` fixes where every module runs and in which order
its stages work (:func:`~hetjax.runtime.plan.plan_run` checks it, with no parameters).
The executor builds each stage's compiled programs (:class:`StageProgram`) and the
transfers between stages and modules, then walks the plan's ops for every step and
dispatches each asynchronously: JAX queues work per device set, so stages on different
devices run concurrently while the Python loop moves on.

Transfers between stages and modules (the ``SEND_F`` / ``SEND_B`` ops) are
:mod:`hetjax.runtime.sends`'s.

A step whose batch gives an encoder nothing to do (no image) runs the schedule without it
(:func:`~hetjax.runtime.feed.absent_modules`): no F or B of it, nothing across its
boundary, ``skipped/<module>`` 1 in the metrics. Its update still runs, on a zero
gradient: the single-device step's (nothing reads the encoder's output), and AdamW moves
parameters on a zero gradient too (decayed moments, weight decay).

The step ends in :mod:`hetjax.runtime.reduce`. The state between steps is one pytree,
:class:`~hetjax.runtime.state.TrainState`; observers (:mod:`hetjax.runtime.observers`)
see compiles, dispatches and transfers.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hetjax import schedules as hs
from hetjax.distributed.rendezvous import FirstCalls
from hetjax.runtime.feed import Feed, absent_modules, skippable_modules
from hetjax.runtime.inflight import InFlight
from hetjax.runtime.lowering import Op, StageKey, drop_frozen, lower
from hetjax.runtime.observers import Dispatch, Observers, Stash
from hetjax.runtime.optim import AdamWConfig
from hetjax.runtime.plan import RunPlan
from hetjax.runtime.programs import ParallelOptions, StageProgram
from hetjax.runtime.reduce import OnDevice, OnHosts, StepMetrics, finish_step
from hetjax.runtime.sends import Sends
from hetjax.runtime.state import TrainState, full_params


class Executor:
    """Trains a planned run (a :class:`~hetjax.runtime.graph.TrainGraph` with per-module
    layouts, placed and scheduled) on ``devices``.

    Args:
        plan: the run's :class:`RunPlan` (:func:`plan_run`: mode, islands, microbatches,
            schedule, encoder offload; checked there, before any parameter exists).
        params: initial parameters keyed by part name (all parts of all modules). With
            neither ``params`` nor ``state`` the executor has no state until one is
            restored into it (:func:`hetjax.checkpoint.restore`).
        devices: all devices of the run, in canonical order.
        optimizer: any optax transformation (every stage runs it on its own parameters;
            put :func:`hetjax.clip_by_global_norm` in it for clipping by the norm over
            all stages), or :class:`AdamWConfig` (AdamW, warm-up + cosine, clipping).
        mask_key: batch key whose global sum normalises the loss.
        options: ZeRO-1 and sequence parallelism switches for every stage.
        observers: :class:`~hetjax.runtime.observers.Observer` s told of compiles,
            dispatches and transfers.
        state: a :class:`TrainState` to start from (e.g. :attr:`state` of an executor
            with the same plan) instead of ``params``.
    """

    def __init__(
        self,
        plan: RunPlan,
        params: Mapping[str, Any] | None = None,
        *,
        devices: Sequence[jax.Device],
        optimizer: AdamWConfig | optax.GradientTransformation = AdamWConfig(),
        mask_key: str = "loss_mask",
        options: ParallelOptions = ParallelOptions(),
        observers: Sequence[Any] = (),
        state: TrainState | None = None,
    ):
        if not isinstance(plan, RunPlan):
            raise TypeError(
                f"Executor takes a RunPlan, not a {type(plan).__name__}: plan the graph first "
                "with hetjax.plan_run(graph, num_devices=..., mode=..., microbatches=...)"
            )
        self.plan = plan
        self.graph, self.mode, self.microbatches = plan.graph, plan.mode, plan.microbatches
        self.schedule: hs.Schedule = plan.schedule
        self.ops: tuple[Op, ...] = plan.ops
        self.skippable = skippable_modules(self.graph)  # encoders a batch may leave out
        self._step_ops: dict[frozenset[str], tuple[Op, ...]] = {frozenset(): plan.ops}
        # A stage with one backward per step writes its gradients in it: no accumulator.
        self._one_backward = {
            k for k, n in Counter(o.stage for o in self.ops if o.kind == "B").items() if n == 1
        }
        self.offload_encoders = plan.offload_encoders
        self.mask_key = mask_key
        self.observers = Observers(observers)
        self.memory_log: list[tuple[int, str]] = []  # (phase, memory kind of encoder params)
        devices = list(devices)
        self.meshes = plan.meshes(devices)
        self.anchor = devices[0]  # where per-stage scalars meet (norms, loss)
        # Multi-controller: every process walks the same ops. A stage whose devices are
        # all other processes' is never compiled or run here: stand-ins with no local
        # shards (StageProgram.stand_in, from jax.eval_shape) take its outputs' place, so
        # the transfers into and out of it still see their shapes. Transfers and stages
        # that span processes are collectives, issued by each process owning a device of
        # them, in the one order of the ops.
        self.multiprocess = jax.process_count() > 1
        # Programs compile on their first call, and processes compile different ones, so
        # the first call of each program whose collectives span processes (stage programs,
        # transfers, the finish's host all-gathers) compiles ahead and then meets the
        # processes of its devices (hetjax.distributed.rendezvous): a peer never waits at a
        # collective's 30 s communicator set-up while another still compiles.
        self._first_calls = FirstCalls()  # the finish's meetings
        self.programs: dict[StageKey, StageProgram] = {
            key: StageProgram(
                self.graph.module(key[0]),
                key[1],
                self.meshes[key[0]].stage_mesh(key[1]),
                is_sink=key[0] == self.graph.sink,
                optimizer=optimizer,
                options=options,
                observers=self.observers,
                backward=self.graph.has_backward(key),
                input_grad=self._input_grad(key),
                stash_frozen_output=self.graph.stashes_frozen_output(key),
            )
            for key in plan.stage_keys
        }
        if state is None and params is not None:
            placed = {k: p.place_params(params) for k, p in self.programs.items()}
            state = TrainState(
                placed, {k: p.init_opt_state(placed[k]) for k, p in self.programs.items()}
            )
        self.state = state
        self._inflight = InFlight(devices[0].platform == "cpu" and not self.multiprocess)
        self.sends = Sends(
            self.graph,
            self.meshes,
            {k: p.devices for k, p in self.programs.items()},
            routed=plan.routed,
            inflight=self._inflight,
            observers=self.observers,
            multiprocess=self.multiprocess,
        )
        self.links, self.stage_links = self.sends.links, self.sends.stage_links
        self.op_times: dict[tuple[str, StageKey], list[float]] = defaultdict(list)

    def _input_grad(self, key: StageKey) -> bool | frozenset[str]:
        """What stage ``key``'s backward differentiates besides its trainable parameters:
        on a first stage the link inputs whose source runs a backward, later stages
        their input if anything upstream trains."""
        if key[1] > 0:
            return self.graph.needs_input_grad(key)
        return frozenset(
            l.name
            for l in self.graph.links_into(key[0])
            if self.graph.has_backward((l.src, self.graph.module(l.src).layout.pp - 1))
        )

    # -- state --------------------------------------------------------------------------

    @property
    def params(self) -> dict[StageKey, Any]:
        """Per-stage parameters (placed on their stage meshes)."""
        return self.state.params

    @property
    def opt_state(self) -> dict[StageKey, Any]:
        """Per-stage optimizer states."""
        return self.state.opt_state

    def abstract_state(self) -> tuple[dict[StageKey, Any], dict[StageKey, Any]]:
        """Per-stage parameters and optimizer states as ``ShapeDtypeStruct`` s with their
        shardings; needs no state (what a restore reads into)."""
        pairs = {k: p.abstract_state() for k, p in self.programs.items()}
        return {k: v[0] for k, v in pairs.items()}, {k: v[1] for k, v in pairs.items()}

    def full_params(self) -> dict[str, Any]:
        """All parameters gathered into the reference's layout (host numpy arrays)."""
        return full_params(self.graph, self.state.params)

    @property
    def inflight_guard(self) -> bool:
        """Whether dispatch waits for in-flight programs on overlapping devices
        (:class:`~hetjax.runtime.inflight.InFlight`: XLA:CPU in one process only)."""
        return self._inflight.enabled

    @property
    def inflight_syncs(self) -> int:
        """Host syncs the in-flight guard has made so far (0 when it is off)."""
        return self._inflight.syncs

    @property
    def stage_ids(self) -> dict[StageKey, int]:
        return self.plan.stage_ids

    def validate_batch(self, global_batch: int) -> None:
        self.plan.check_batch(global_batch)

    # -- one step -----------------------------------------------------------------------

    def step(self, batch: Mapping[str, np.ndarray], *, profile: bool = False) -> StepMetrics:
        """One optimiser step over the global ``batch``; returns its metrics.

        With ``profile=True`` every F/B waits for its result and its wall time is kept in
        :attr:`op_times` (for :meth:`timeline`); values are unchanged, only slower.
        """
        if self.state is None:
            raise ValueError("the executor has no state: give params=, state= or restore one")
        self.validate_batch(next(iter(batch.values())).shape[0])
        normalizer = jnp.float32(max(float(np.sum(batch[self.mask_key])), 1.0))
        # Processes would have to agree (one may hold only its rows): they run every module.
        absent = frozenset()
        if not self.multiprocess:
            absent = absent_modules(batch, self.graph, self.skippable)
        feed = Feed(
            batch,
            self.microbatches,
            routed=self.plan.routed,
            links=self.links,
            cp={m.name: m.layout.cp for m in self.graph.modules},
            rebalance=tuple(map(self.graph.module, self.plan.rebalance)),
        )
        params = self.state.params
        acc = {}
        for k, p in self.programs.items():
            if (k in self._one_backward and k[0] not in absent) or not p.local:
                # One B per step writes the gradients itself (update.accumulate); a
                # module left out has none: its gradient is the zeros.
                acc[k] = None if k in self._one_backward else p.stand_in("zeros")
                continue
            t0 = time.perf_counter()
            acc[k] = p.zeros()
            self._record(k, "zeros", (), acc[k], t0)
        inbox: dict[tuple[StageKey, int], Any] = {}  # forward inputs waiting for F
        outbox: dict[tuple[StageKey, int], Any] = {}  # forward outputs waiting for SEND_F
        stash: dict[tuple[StageKey, int], Any] = {}  # F inputs kept for B
        grads_in: dict[tuple[StageKey, int], Any] = {}  # output cotangents waiting for B
        grads_out: dict[tuple[StageKey, int], Any] = {}  # input cotangents for SEND_B
        data: dict[tuple[StageKey, int], Any] = {}
        losses = []
        phase = 0
        for op in self.ops_without(absent):
            if op.phase != phase:
                phase = op.phase
                if self.offload_encoders:
                    self._move_encoders("pinned_host" if phase == 1 else "device")
                    self.memory_log.append((phase, self._encoder_memory_kind()))
            key, m = op.stage, op.microbatch
            prog = self.programs[key]
            if op.kind == "F":
                x = inbox.pop((key, m), {} if prog.first else None)
                data[(key, m)] = feed.inputs(prog, m)
                kept = x  # what B starts from (recompute full: the input)
                if not (prog.is_sink and prog.last):  # the loss stage's F runs inside B
                    args = (params[key], x, data[(key, m)], normalizer)
                    outbox[(key, m)] = self._run(op, prog, "fwd", args, profile)
                    if prog.forward_stashes:  # residuals, or a frozen encoder's output
                        outbox[(key, m)], kept = outbox[(key, m)]
                if prog.backward:  # a forward-only stage keeps nothing for a B
                    stash[(key, m)] = kept
                    self._observe_stash(op, kept, stash)
                else:
                    data.pop((key, m))
            elif op.kind == "B":
                g_out = grads_in.pop((key, m), None)
                kept = stash.pop((key, m))
                self._observe_stash(op, kept, stash)
                args = (params[key], acc[key], kept, data.pop((key, m)))
                args += (g_out, normalizer)
                acc[key], gx, loss = self._run(op, prog, "bwd", args, profile)
                if prog.is_sink and prog.last:
                    losses.append(loss)
                if prog.input_grad:  # sources and stages with nothing trainable upstream: none
                    grads_out[(key, m)] = gx
            elif op.kind == "SEND_F":
                # Free the output after its last send, so live activations follow the
                # schedule's bound (1F1B: one per in-flight microbatch), not M.
                y = (outbox.pop if op.last_send else outbox.get)((key, m))
                sent = self.sends.forward(op, feed, y)
                if op.peer[0] == key[0]:
                    inbox[(op.peer, m)] = sent
                else:
                    link = self.sends.link_name(key[0], op.peer[0])
                    inbox.setdefault((op.peer, m), {})[link] = sent
            elif op.kind == "SEND_B":
                gx = (grads_out.pop if op.last_send else grads_out.get)((key, m))
                src = op.peer
                g_src, collective = self.sends.backward(op, feed, gx)
                prev = grads_in.get((src, m))
                local = self.programs[src].local  # a stand-in is not summed: no values
                grads_in[(src, m)] = g_src if prev is None or not local else prev + g_src
                devices = prog.devices | self.programs[src].devices
                self._inflight.hold(devices, grads_in[(src, m)], collective)
        if self.offload_encoders and phase == 1:  # no encoder backward ran (all frozen)
            self._move_encoders("device")
        values, (keys, on_host) = self._finish(acc, losses, normalizer).tree_flatten()
        skipped = {f"skipped/{n}": float(n in absent) for n in self.skippable} | feed.metrics
        return StepMetrics({**dict(zip(keys, values, strict=True)), **skipped}, on_host=on_host)

    def ops_without(self, absent: frozenset[str]) -> tuple[Op, ...]:
        """The step's ops with the modules ``absent`` left out (their schedule checked on
        first use)."""
        if absent not in self._step_ops:
            sched = hs.without_modules(self.schedule, absent)
            hs.check_schedule(sched)
            # The baseline's encoders interleave with the LLM's first stage; none left: plain.
            fused = self.mode == "homogeneous" and any(e.is_boundary for e in sched.edges)
            self._step_ops[absent] = drop_frozen(lower(sched, fused=fused), self.graph)
        return self._step_ops[absent]

    def _run(self, op: Op, prog: StageProgram, kind: str, args: tuple, profile: bool) -> Any:
        """Dispatches one F/B program call (waits for it when profiling); on a process
        that owns none of the stage's devices, returns stand-ins and runs nothing."""
        if not prog.local:
            return prog.stand_in(kind, *args)
        t0 = time.perf_counter()
        collective = self._inflight.enabled and prog.collectives(kind, *args)
        self._inflight.wait(prog.devices, collective)
        out = getattr(prog, kind)(*args)
        self._inflight.hold(prog.devices, out, collective)
        if profile:
            jax.block_until_ready(out)
            self.op_times[(op.kind, op.stage)].append(time.perf_counter() - t0)
        self._record(op.stage, kind, args, out, t0, op)
        return out

    def _record(
        self, key: StageKey, kind: str, args: tuple, out: Any, t0: float, op: Op | None = None
    ) -> None:
        if self.observers.dispatch:
            event = Dispatch(key, kind, op, args, out, t0, time.perf_counter())
            self.observers.on_dispatch(event)

    def _observe_stash(self, op: Op, value: Any, stash: Mapping) -> None:
        if self.observers.stash:
            live = sum(1 for k, _ in stash if k == op.stage)
            self.observers.on_stash(Stash(op, value, live))

    def _finish(self, acc, losses, normalizer) -> StepMetrics:
        totals = OnHosts(self._first_calls) if self.multiprocess else OnDevice(self.anchor)
        self.state, metrics = finish_step(
            self.programs,
            self.state,
            acc,
            losses,
            normalizer,
            totals=totals,
            guard=self._inflight,
            record=self._record,
        )
        return metrics

    # -- encoder offload (colocated) ----------------------------------------------------

    def _encoder_keys(self) -> list[StageKey]:
        return [k for k in self.programs if k[0] != self.graph.sink]

    def _move_encoders(self, memory_kind: str) -> None:
        """Moves encoder parameters and optimiser state to ``memory_kind`` (async copies)."""

        def move(tree, shardings):
            if memory_kind != "device":  # back to device: exactly the compiled shardings
                shardings = jax.tree.map(lambda s: s.with_memory_kind(memory_kind), shardings)
            return jax.device_put(tree, shardings)

        params, opt_state = dict(self.state.params), dict(self.state.opt_state)
        for k in self._encoder_keys():
            prog = self.programs[k]
            params[k] = move(params[k], prog.param_shardings)
            opt_state[k] = move(opt_state[k], prog.state_shardings)
        self.state = dataclasses.replace(self.state, params=params, opt_state=opt_state)

    def _encoder_memory_kind(self) -> str:
        kinds = {
            a.sharding.memory_kind
            for k in self._encoder_keys()
            for a in jax.tree.leaves((self.state.params[k], self.state.opt_state[k]))
        }
        return ",".join(sorted(kinds))

    # -- inspection ---------------------------------------------------------------------

    def timeline(self) -> hs.Timeline:
        """The schedule simulated with the mean F/B times measured by profiled steps."""
        if not self.op_times:
            raise ValueError("no profiled step yet: call step(batch, profile=True) first")
        ids = self.plan.stage_ids
        # The sink's last stage does its forward inside its backward (F only stashes).
        durations = {(k, info.stage): 0.0 for info in self.schedule.stages for k in "FB"}
        for (kind, key), times in self.op_times.items():
            durations[(kind, ids[key])] += sum(times) / len(times)
        return hs.simulate(self.schedule, dict(durations))
