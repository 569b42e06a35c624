"""The heterogeneous executor: per-stage programs dispatched in schedule order.

Each module of a :class:`TrainGraph` is placed on its own devices with its own layout
(:func:`hetjax.meshes.place_modules`) and split into pipeline stages; every stage gets
its compiled programs (:class:`StageProgram`). A step walks a schedule - three-phase for
colocated modules, graph-aware 1F1B for disjoint islands, plain 1F1B with the encoders
fused into the LLM's first stage for the homogeneous baseline - and dispatches each
action asynchronously: JAX queues work per device set, so stages on different devices
run concurrently while the Python loop moves on.

Transfers: inside a module, a pipeline stage hands its activation to the next stage's
submesh (same per-device layout, so a direct device-to-device copy); between modules, a
boundary communicator (:mod:`hetjax.boundary`) moves it from the source's layout to the
destination's, and its backward routes the gradient back. Into a ``cp > 1`` module that
merges the tokens into placeholders (``ModuleSpec.token_slots``), each cp rank receives
only the tokens of the positions it stores; the routing is computed on the host from the
step's token ids (:mod:`hetjax.ops.token_routing`).

Once per step every stage sums its per-replica gradients (the one DP reduction), the
global gradient norm is formed from all stages' partial norms, and every stage applies
the clipped optax update. The loss is the sink's summed loss over all microbatches
divided by the supervised-token count of the global batch - exactly the reference's.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from hetjax import schedules as hs
from hetjax.meshes import Layout, LayoutError, ModuleMesh, place_modules, validate_batch
from hetjax.ops.ring_attention import zigzag_permutation
from hetjax.ops.token_routing import exchange_routes, token_routes
from hetjax.runtime.graph import TrainGraph
from hetjax.runtime.optim import OptimizerConfig
from hetjax.runtime.programs import ParallelOptions, StageProgram, batch_sharding, put_global
from hetjax.runtime.transfer import LinkTransfer, Route, StageTransfer

Mode = Literal["colocated", "non-colocated", "homogeneous"]
StageKey = tuple[str, int]  # (module name, pipeline stage index)


@dataclasses.dataclass(frozen=True)
class Op:
    """One dispatchable step: compute on a stage, or a transfer along a stage edge."""

    kind: Literal["F", "B", "SEND_F", "SEND_B"]
    stage: StageKey  # where it runs (for sends: the producing side)
    microbatch: int
    peer: StageKey | None = None  # for sends: the receiving stage
    phase: int = 0  # three-phase: 0 encoder forward, 1 LLM pipeline, 2 encoder backward
    last_send: bool = True  # sends: no later send of this step reads the same output


def check_batch(graph: TrainGraph, global_batch: int, microbatches: int) -> None:
    """Every module's ``dp x microbatches`` divides the global batch (one-line errors).

    Needs no devices or parameters, so a CLI can call it before anything compiles.
    """
    for spec in graph.modules:
        validate_batch(spec.name, spec.layout, global_batch, microbatches)


def homogeneous_graph(graph: TrainGraph) -> TrainGraph:
    """Every encoder inherits the sink's layout (without PP), as in stock Megatron."""
    sink = graph.module(graph.sink).layout
    inherited = dataclasses.replace(sink, pp=1)
    return graph.with_layouts({m.name: inherited for m in graph.modules if m.name != graph.sink})


class Executor:
    """Trains a :class:`TrainGraph` with per-module layouts on ``devices``.

    Args:
        graph: modules with their layouts, and the links between them.
        params: initial parameters keyed by part name (all parts of all modules).
        devices: all devices of the run, in canonical order.
        mode: ``"colocated"`` (modules share all devices; three-phase schedule),
            ``"non-colocated"`` (disjoint islands; graph-aware 1F1B), or ``"homogeneous"``
            (the baseline: encoders use the sink's layout on its first stage's devices).
        islands: module -> device count, for non-colocated placement.
        microbatches: pipeline microbatches per global batch.
        schedule: ``"1f1b"`` or ``"gpipe"`` ordering of the pipelined part.
        optimizer: AdamW settings (its clipping is applied with the global norm).
        mask_key: batch key whose global sum normalises the loss.
        offload_encoders: colocated only: keep encoder parameters and optimiser state in
            host memory (``pinned_host``) during the LLM pipeline phase.
        options: ZeRO-1 and sequence parallelism switches for every stage.
    """

    def __init__(
        self,
        graph: TrainGraph,
        params: Mapping[str, Any],
        *,
        devices: Sequence[jax.Device],
        mode: Mode = "colocated",
        islands: Mapping[str, int] | None = None,
        microbatches: int = 1,
        schedule: Literal["1f1b", "gpipe"] = "1f1b",
        optimizer: OptimizerConfig = OptimizerConfig(),
        mask_key: str = "loss_mask",
        offload_encoders: bool = False,
        options: ParallelOptions = ParallelOptions(),
    ):
        if microbatches < 1:
            raise LayoutError(f"microbatches must be >= 1, got {microbatches}")
        if schedule not in ("1f1b", "gpipe"):
            raise LayoutError(f"unknown schedule {schedule!r}; use '1f1b' or 'gpipe'")
        if mode not in ("colocated", "non-colocated", "homogeneous"):
            raise LayoutError(
                f"unknown mode {mode!r}; use 'colocated', 'non-colocated' or 'homogeneous'"
            )
        if mode == "homogeneous":
            graph = homogeneous_graph(graph)
        if offload_encoders and mode != "colocated":
            raise LayoutError(
                "encoder offload needs the colocated three-phase schedule (the encoder is idle "
                "during the LLM phase); drop --offload-encoder or use --placement colocated"
            )
        if mode == "colocated" and schedule != "1f1b":
            raise LayoutError(
                f"colocated placement runs the three-phase schedule (its LLM phase is 1F1B); "
                f"--schedule {schedule} is only for non-colocated or homogeneous runs"
            )
        self.offload_encoders = offload_encoders
        self.memory_log: list[tuple[int, str]] = []  # (phase, memory kind of encoder params)
        self.graph, self.mode, self.microbatches = graph, mode, microbatches
        self.mask_key = mask_key
        self.meshes = self._place(graph, list(devices), mode, islands)
        self.anchor = devices[0]  # where per-stage scalars meet (norms, loss)
        # Multi-controller: every process walks the same ops; programs whose devices are
        # all remote are no-ops here; transfers are collectives on union meshes.
        self.multiprocess = jax.process_count() > 1
        # Links into a cp > 1 module that merges them into placeholder positions deliver
        # each cp rank only its own positions' tokens (the homogeneous baseline keeps
        # stock behaviour: its encoders already sit on the LLM's devices).
        self.routable: dict[tuple[str, str], tuple[str, int]] = {}
        for l in graph.links:
            dst = graph.module(l.dst)
            slots = {name: (key, pid) for name, key, pid in dst.token_slots}
            if mode != "homogeneous" and dst.layout.cp > 1 and l.name in slots:
                self.routable[(l.src, l.dst)] = slots[l.name]
        self.programs: dict[StageKey, StageProgram] = {
            (spec.name, s): StageProgram(
                spec,
                s,
                self.meshes[spec.name].stage_mesh(s),
                is_sink=spec.name == graph.sink,
                optimizer=optimizer,
                options=options,
            )
            for spec in graph.modules
            for s in range(spec.layout.pp)
        }
        self.params = {k: p.place_params(params) for k, p in self.programs.items()}
        self.opt_state = {k: p.init_opt_state(self.params[k]) for k, p in self.programs.items()}
        self.links = {
            (l.src, l.dst): LinkTransfer(
                self.meshes[l.src],
                self.meshes[l.dst],
                src_stage=self.graph.module(l.src).layout.pp - 1,
                dst_stage=0,
                multiprocess=self.multiprocess,
                routed=(l.src, l.dst) in self.routable,
            )
            for l in graph.links
        }
        self.stage_links = {
            (spec.name, s): StageTransfer(self.meshes[spec.name], s, multiprocess=self.multiprocess)
            for spec in graph.modules
            for s in range(spec.layout.pp - 1)
        }
        self.ops = mark_last_sends(self._build_ops(schedule))
        self.op_times: dict[tuple[str, StageKey], list[float]] = defaultdict(list)
        self._serialize_overlaps = devices[0].platform == "cpu" and not self.multiprocess
        self._inflight: dict[frozenset, Any] = {}

    # -- set-up -------------------------------------------------------------------------

    @staticmethod
    def _place(graph, devices, mode, islands) -> dict[str, ModuleMesh]:
        layouts = {m.name: m.layout for m in graph.modules}
        if mode == "homogeneous":
            sink = graph.sink
            meshes = place_modules({sink: layouts[sink]}, devices, placement="colocated")
            first = list(meshes[sink].stage_devices(0))
            enc = {n: l for n, l in layouts.items() if n != sink}
            meshes.update(place_modules(enc, first, placement="colocated") if enc else {})
            return meshes
        if mode == "non-colocated":
            islands = island_positions(islands, layouts, len(devices))
        return place_modules(layouts, devices, placement=mode, islands=islands)

    def _build_ops(self, name: str) -> list[Op]:
        g = self.graph
        if self.mode == "homogeneous":
            return self._homogeneous_ops(name)
        module_graph = hs.ModuleGraph(
            {m.name: m.layout.pp for m in g.modules}, [(l.src, l.dst) for l in g.links]
        )
        if self.mode == "colocated" and name == "1f1b":
            sched = hs.three_phase_for_graph(module_graph, self.microbatches)
        elif name == "1f1b":
            sched = hs.graph_one_f_one_b(module_graph, self.microbatches)
        else:
            sched = hs.graph_gpipe(module_graph, self.microbatches)
        hs.check_schedule(sched)
        self.schedule = sched
        where = {info.stage: (info.module, info.index) for info in sched.stages}
        self.stage_ids = {v: k for k, v in where.items()}
        ops = []
        for a in hs.dispatch_order(sched):
            if a.kind in ("F", "B"):
                ops.append(Op(a.kind, where[a.stage], a.microbatch, phase=a.phase))
            elif a.kind == "SEND_F":
                ops.append(
                    Op(
                        "SEND_F",
                        where[a.edge.src_stage],
                        a.microbatch,
                        where[a.edge.dst_stage],
                        phase=a.phase,
                    )
                )
            elif a.kind == "SEND_B":
                ops.append(
                    Op(
                        "SEND_B",
                        where[a.edge.dst_stage],
                        a.microbatch,
                        where[a.edge.src_stage],
                        phase=a.phase,
                    )
                )
        return ops

    def _homogeneous_ops(self, name: str) -> list[Op]:
        """The sink's pipeline schedule with each encoder fused into its first stage."""
        sink = self.graph.sink
        pp = self.graph.module(sink).layout.pp
        sched = (hs.one_f_one_b if name == "1f1b" else hs.gpipe)(pp, self.microbatches, module=sink)
        hs.check_schedule(sched)
        self.schedule = sched
        self.stage_ids = {(sink, s): s for s in range(pp)}
        encoders = [l.src for l in self.graph.links_into(sink)]
        ops: list[Op] = []
        for a in hs.dispatch_order(sched):
            m = a.microbatch
            if a.kind == "F":
                if a.stage == 0:
                    for e in encoders:
                        ops += [Op("F", (e, 0), m), Op("SEND_F", (e, 0), m, (sink, 0))]
                ops.append(Op("F", (sink, a.stage), m))
            elif a.kind == "B":
                ops.append(Op("B", (sink, a.stage), m))
                if a.stage == 0:
                    for e in encoders:
                        ops += [Op("SEND_B", (sink, 0), m, (e, 0)), Op("B", (e, 0), m)]
            elif a.kind == "SEND_F":
                ops.append(Op("SEND_F", (sink, a.edge.src_stage), m, (sink, a.edge.dst_stage)))
            elif a.kind == "SEND_B":
                ops.append(Op("SEND_B", (sink, a.edge.dst_stage), m, (sink, a.edge.src_stage)))
        return ops

    # -- one step -----------------------------------------------------------------------

    def validate_batch(self, global_batch: int) -> None:
        check_batch(self.graph, global_batch, self.microbatches)

    def _microbatch(self, batch: Mapping[str, np.ndarray], key: StageKey, m: int):
        prog = self.programs[key]
        size = next(iter(batch.values())).shape[0] // self.microbatches
        out = {}
        for k in prog.batch_keys:
            value = batch[k][m * size : (m + 1) * size]
            seq = k in prog.spec.seq_inputs
            if seq and prog.spec.layout.cp > 1:  # stored load-balanced, as the model expects
                value = value[:, zigzag_permutation(value.shape[1], prog.spec.layout.cp)]
            out[k] = put_global(value, batch_sharding(prog.mesh, value.ndim, sequence=seq))
        return out

    def _route(
        self, cache: dict, batch: Mapping[str, np.ndarray], link: tuple[str, str], m: int, n: int
    ) -> Route | None:
        """Microbatch ``m``'s token routing on a routed ``link`` (``n`` tokens per sample).

        Built on the first send of the step from the whole batch, so every microbatch of
        the step uses one slot count (one compiled shape)."""
        if link not in self.routable:
            return None
        if link not in cache:
            key, placeholder = self.routable[link]
            cp = self.graph.module(link[1]).layout.cp
            idx = token_routes(np.asarray(batch[key]) == placeholder, n, cp)
            size = len(idx) // self.microbatches
            transfer = self.links[link]
            routes = []
            for i in range(self.microbatches):
                part = idx[i * size : (i + 1) * size]
                if transfer.exchange and n % cp == 0:  # across islands: exchange at dst
                    send, recv = exchange_routes(part, n)
                    sharding = transfer.split_sharding
                    send, recv = put_global(send, sharding), put_global(recv, sharding)
                    routes.append(Route(n, send=send, recv=recv))
                else:
                    routes.append(Route(n, index=put_global(part, transfer.index_sharding)))
            cache[link] = routes
        return cache[link][m]

    def step(
        self, batch: Mapping[str, np.ndarray], *, profile: bool = False
    ) -> dict[str, jax.Array]:
        """One optimiser step over the global ``batch``; returns metrics (device scalars).

        With ``profile=True`` every F/B waits for its result and its wall time is kept in
        :attr:`op_times` (for :meth:`timeline`); values are unchanged, only slower.
        """
        self.validate_batch(next(iter(batch.values())).shape[0])
        normalizer = jnp.float32(max(float(np.sum(batch[self.mask_key])), 1.0))
        g = self.graph
        acc = {k: p.zeros() for k, p in self.programs.items()}
        inbox: dict[tuple[StageKey, int], Any] = {}  # forward inputs waiting for F
        outbox: dict[tuple[StageKey, int], Any] = {}  # forward outputs waiting for SEND_F
        stash: dict[tuple[StageKey, int], Any] = {}  # F inputs kept for B
        grads_in: dict[tuple[StageKey, int], Any] = {}  # output cotangents waiting for B
        grads_out: dict[tuple[StageKey, int], Any] = {}  # input cotangents for SEND_B
        data: dict[tuple[StageKey, int], Any] = {}
        routes: dict[tuple[str, str], list[Route]] = {}  # token routing into cp > 1 modules
        losses = []
        phase = 0
        for op in self.ops:
            if op.phase != phase:
                phase = op.phase
                if self.offload_encoders:
                    self._move_encoders("pinned_host" if phase == 1 else "device")
                    self.memory_log.append((phase, self._encoder_memory_kind()))
            key, m = op.stage, op.microbatch
            prog = self.programs[key]
            if op.kind == "F":
                x = inbox.pop((key, m), {} if prog.first else None)
                data[(key, m)] = self._microbatch(batch, key, m)
                stash[(key, m)] = x
                if not (prog.is_sink and prog.last):
                    t0 = time.perf_counter()
                    self._guard(prog.devices)
                    outbox[(key, m)] = prog.fwd(self.params[key], x, data[(key, m)])
                    self._in_flight(prog.devices, outbox[(key, m)])
                    if profile:
                        jax.block_until_ready(outbox[(key, m)])
                        self.op_times[("F", key)].append(time.perf_counter() - t0)
            elif op.kind == "B":
                x = stash.pop((key, m))
                t0 = time.perf_counter()
                self._guard(prog.devices)
                acc[key], gx, loss = prog.bwd(
                    self.params[key],
                    acc[key],
                    x,
                    data.pop((key, m)),
                    grads_in.pop((key, m), None),
                    normalizer,
                )
                self._in_flight(prog.devices, (acc[key], gx))
                if profile:
                    jax.block_until_ready((acc[key], gx))
                    self.op_times[("B", key)].append(time.perf_counter() - t0)
                if prog.is_sink and prog.last:
                    losses.append(loss)
                if not (prog.first and not g.links_into(key[0])):  # sources send nothing back
                    grads_out[(key, m)] = gx
            elif op.kind == "SEND_F":
                # Free the output after its last send, so live activations follow the
                # schedule's bound (1F1B: one per in-flight microbatch), not M.
                y, dst = (outbox.pop if op.last_send else outbox.get)((key, m)), op.peer
                self._guard(prog.devices | self.programs[dst].devices)
                if dst[0] == key[0]:
                    inbox[(dst, m)] = self.stage_links[key].forward(y)
                else:
                    link = next(l for l in g.links_into(dst[0]) if l.src == key[0])
                    pair = (key[0], dst[0])
                    route = self._route(routes, batch, pair, m, y.shape[1])
                    inbox.setdefault((dst, m), {})[link.name] = self.links[pair].forward(y, route)
            elif op.kind == "SEND_B":
                gx, src = (grads_out.pop if op.last_send else grads_out.get)((key, m)), op.peer
                self._guard(prog.devices | self.programs[src].devices)
                if src[0] == key[0]:
                    g_src = self.stage_links[src].backward(gx)
                else:
                    link = next(l for l in g.links_into(key[0]) if l.src == src[0])
                    pair = (src[0], key[0])
                    route = routes[pair][m] if pair in routes else None
                    g_src = self.links[pair].backward(gx[link.name], route)
                prev = grads_in.get((src, m))
                grads_in[(src, m)] = g_src if prev is None else prev + g_src
                self._in_flight(prog.devices | self.programs[src].devices, grads_in[(src, m)])
        return self._finish_step(acc, losses, normalizer)

    def _guard(self, devices: frozenset) -> None:
        """XLA:CPU only: wait for in-flight programs on overlapping device sets.

        The CPU runtime does not order two executions per device, so a program on devices
        0-7 and one on devices 4-7 can meet their collectives in opposite orders and
        deadlock (seen with 8 simulated devices, also with identical device sets under
        heavy load). GPU streams execute in dispatch order per device, so there this is
        off and stages overlap freely; on CPU, disjoint islands still run concurrently.
        """
        if not self._serialize_overlaps:
            return
        for other in [d for d in self._inflight if d & devices]:
            jax.block_until_ready(self._inflight.pop(other))

    def _in_flight(self, devices: frozenset, outputs: Any) -> None:
        if self._serialize_overlaps:
            self._inflight[devices] = outputs

    def _encoder_keys(self) -> list[StageKey]:
        return [k for k in self.programs if k[0] != self.graph.sink]

    def _move_encoders(self, memory_kind: str) -> None:
        """Moves encoder parameters and optimiser state to ``memory_kind`` (async copies)."""

        def move(tree, shardings):
            if memory_kind != "device":  # back to device: exactly the compiled shardings
                shardings = jax.tree.map(lambda s: s.with_memory_kind(memory_kind), shardings)
            return jax.device_put(tree, shardings)

        for k in self._encoder_keys():
            prog = self.programs[k]
            self.params[k] = move(self.params[k], prog.param_shardings)
            self.opt_state[k] = move(self.opt_state[k], prog.state_shardings)

    def _encoder_memory_kind(self) -> str:
        kinds = {
            a.sharding.memory_kind
            for k in self._encoder_keys()
            for a in jax.tree.leaves((self.params[k], self.opt_state[k]))
        }
        return ",".join(sorted(kinds))

    def _gather(self, scalars: Sequence[jax.Array]) -> jax.Array:
        """Sums per-stage scalars on the anchor device (asynchronously)."""
        return sum(jax.device_put(s, self.anchor) for s in scalars)

    def _owned(self, key: StageKey) -> bool:
        """Whether this process reports stage ``key``'s scalars (it owns its first device)."""
        return self.programs[key].mesh.devices.flat[0].process_index == jax.process_index()

    def _finish_step_multiprocess(self, acc, losses, normalizer) -> dict[str, float]:
        """As :meth:`_finish_step`, with scalars summed on the host across processes.

        Each stage's scalars are counted by the process owning its first device, then one
        host all-gather per kind of scalar combines the processes. This syncs the host
        once per step - the price of a global gradient norm across process boundaries.
        """
        from jax.experimental import multihost_utils

        def allsum(local: dict[str, float]) -> dict[str, float]:
            names = sorted(local)
            mine = np.asarray([local[n] for n in names], np.float64)
            return dict(zip(names, multihost_utils.process_allgather(mine).sum(0), strict=True))

        def local_sums(per_stage: dict[StageKey, dict[str, jax.Array]]) -> dict[str, float]:
            out: dict[str, float] = defaultdict(float)
            for key, norms in per_stage.items():
                for name, v in norms.items():
                    out[name] += float(v.addressable_data(0)) if self._owned(key) else 0.0
            return out

        reduced = {k: p.reduce(acc[k]) for k, p in self.programs.items()}
        sq = allsum(local_sums({k: r[1] for k, r in reduced.items()}))
        global_norm = float(np.sqrt(sum(sq.values())))
        param_norms = {}
        for k, p in self.programs.items():
            self.params[k], self.opt_state[k], param_norms[k] = p.update(
                self.params[k],
                self.opt_state[k],
                reduced[k][0],
                put_global(np.float32(global_norm), p.replicated),
            )
        sink_last = (self.graph.sink, self.graph.module(self.graph.sink).layout.pp - 1)
        loss = sum(float(l.addressable_data(0)) for l in losses) if self._owned(sink_last) else 0.0
        totals = allsum(
            {**{f"sq/{n}": v for n, v in local_sums(param_norms).items()}, "loss": loss}
        )
        return {
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

    def _finish_step(self, acc, losses, normalizer) -> dict[str, jax.Array]:
        if self.multiprocess:
            return self._finish_step_multiprocess(acc, losses, normalizer)
        reduced = {}
        for k, p in self.programs.items():
            self._guard(p.devices)
            reduced[k] = p.reduce(acc[k])
            self._in_flight(p.devices, reduced[k])
        sq = defaultdict(list)
        for _, norms in reduced.values():
            for name, v in norms.items():
                sq[name].append(v)
        sq = {name: self._gather(vs) for name, vs in sq.items()}
        global_norm = jnp.sqrt(sum(sq.values()))
        param_sq = defaultdict(list)
        for k, p in self.programs.items():
            self._guard(p.devices)
            self.params[k], self.opt_state[k], norms = p.update(
                self.params[k],
                self.opt_state[k],
                reduced[k][0],
                jax.device_put(global_norm, p.replicated),
            )
            self._in_flight(p.devices, (self.params[k], norms))
            for name, v in norms.items():
                param_sq[name].append(v)
        self._inflight.clear()
        return {
            "loss": self._gather(losses),
            "grad_norm": global_norm,
            **{f"grad_norm/{n}": jnp.sqrt(v) for n, v in sq.items()},
            **{f"param_norm/{n}": jnp.sqrt(self._gather(v)) for n, v in param_sq.items()},
            "supervised_tokens": normalizer,
        }

    # -- inspection ---------------------------------------------------------------------

    def timeline(self) -> hs.Timeline:
        """The schedule simulated with the mean F/B times measured by profiled steps.

        In the homogeneous baseline the encoders run inside the LLM's first stage, so their
        times are added to that stage's.
        """
        if not self.op_times:
            raise ValueError("no profiled step yet: call step(batch, profile=True) first")
        # The sink's last stage does its forward inside its backward (F only stashes).
        durations = {(k, info.stage): 0.0 for info in self.schedule.stages for k in "FB"}
        for (kind, key), times in self.op_times.items():
            stage = self.stage_ids.get(key, self.stage_ids.get((self.graph.sink, 0)))
            durations[(kind, stage)] += sum(times) / len(times)
        return hs.simulate(self.schedule, dict(durations))

    def full_params(self) -> dict[str, Any]:
        """All parameters gathered into the reference's layout (host numpy arrays)."""
        out: dict[str, Any] = {}
        for spec in self.graph.modules:
            main = spec.parts[0]
            stages = [jax.device_get(self.params[(spec.name, s)]) for s in range(spec.layout.pp)]
            tree = {}
            if "pre" in stages[0][main.name]:
                tree["pre"] = stages[0][main.name]["pre"]
            if "blocks" in stages[0][main.name]:
                tree["blocks"] = jax.tree.map(
                    lambda *xs: np.concatenate(xs), *[s[main.name]["blocks"] for s in stages]
                )
            if "post" in stages[-1][main.name]:
                tree["post"] = stages[-1][main.name]["post"]
            out[main.name] = tree
            for part in spec.parts[1:]:
                out[part.name] = stages[-1][part.name]
        return out


def mark_last_sends(ops: list[Op]) -> list[Op]:
    """Marks each send that is the last one of its step reading its stage's output."""
    seen: set[tuple[str, StageKey, int]] = set()
    out = []
    for op in reversed(ops):
        if op.kind in ("SEND_F", "SEND_B"):
            key = (op.kind, op.stage, op.microbatch)
            op = dataclasses.replace(op, last_send=key not in seen)
            seen.add(key)
        out.append(op)
    return out[::-1]


def island_positions(
    counts: Mapping[str, int] | None, layouts: Mapping[str, Layout], num_devices: int
) -> dict[str, tuple[int, ...]]:
    """Island device COUNTS (``--island vision:4``), assigned in order -> device positions."""
    if not counts:
        raise LayoutError(
            "non-colocated placement needs an island per module: "
            + " ".join(f"--island {n}:{l.num_devices}" for n, l in layouts.items())
            + f" for these layouts (islands are assigned in order and must fit the "
            f"{num_devices} devices)"
        )
    missing = [n for n in layouts if n not in counts]
    unknown = [n for n in counts if n not in layouts]
    if missing or unknown:
        raise LayoutError(
            f"islands must name each module once: missing {missing}, unknown {unknown}"
        )
    positions, start = {}, 0
    for name, count in counts.items():
        if count != layouts[name].num_devices:
            raise LayoutError(
                f"{name}: island of {count} devices but its layout {layouts[name]} needs "
                f"{layouts[name].num_devices}; make --island {name}:N match the layout"
            )
        positions[name] = tuple(range(start, start + count))
        start += count
    if start > num_devices:
        raise LayoutError(
            f"islands need {start} devices but only {num_devices} exist; shrink the islands "
            f"or use --devices {start}"
        )
    return positions


def parse_layouts(items: Sequence[str], modules: Sequence[str]) -> dict[str, Layout]:
    """``["vision:dp=8", "llm:dp=2,tp=2,pp=2"]`` -> layouts; unknown modules are errors."""
    out = {}
    for item in items:
        name, sep, text = item.partition(":")
        if not sep or name not in modules:
            raise LayoutError(
                f"--layout {item!r}: expected MODULE:LAYOUT with MODULE one of {list(modules)}"
            )
        out[name] = Layout.parse(text, module=name)
    return out
