"""The cost model: a plan's step time, throughput and memory per GPU.

A :class:`Plan` is the mode (``homogeneous``: the encoder inherits the LLM's layout
inside its first pipeline stage; ``colocated``: both modules on all GPUs, three-phase
schedule; ``non-colocated``: disjoint islands, graph-aware 1F1B), one
:class:`~hetjax.plan.stage.ModulePlan` per module and the microbatch count.
:func:`estimate` prices each stage (:mod:`hetjax.plan.stage`), builds the schedule hetjax
would run (:mod:`hetjax.schedules`) and times it with the schedule simulator, so bubbles,
the three-phase barriers and the encoder's share of the pipeline come from the same code
the runtime walks. With ``simulate=False`` the makespan is the closed form of a 1F1B chain
(``sum(t) + (M - 1) max(t)``, exact for the schedules above with buffered sends), which
the planner uses to rank candidates before simulating the best.

Host work is priced by calls (:func:`calls`, checked against the executor by
``experiments.validate_plan``), ``dispatch_us`` each: a program per forward and backward
of a stage and microbatch (none for the loss stage's forward, which runs inside its
backward), a transfer per stage edge crossed each way, and per step and stage, frozen or
not, the zeroed accumulators (not with one microbatch), the reduction and the update.
On devices sharing one pool of cores (``shared_compute``: simulated CPU devices) the
step is the host's calls plus every device's work spread over all the devices; a
pipeline bubble costs nothing (an idle device's cores serve the busy ones).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hetjax import schedules as hs
from hetjax.meshes.placement import Placement
from hetjax.runtime.flops import FACTORS, TRAINED

from .hardware import HardwareProfile, get_profile
from .memory import BF16, colocated_held_bytes
from .parts import ENCODER, LLM, encoder_shape, image_tokens, llm_shape
from .stage import ModulePlan, StageCost, module_stages

Mode = Placement  # one definition: hetjax.meshes.placement
MODES: tuple[str, ...] = ("homogeneous", "colocated", "non-colocated")  # the search's order


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one step trains on."""

    global_batch: int  # samples per step
    seq_len: int  # LLM tokens per sample, image tokens included
    images_per_sample: int = 1  # images the encoder sees per sample
    act_bytes: int = BF16  # bytes per activation element (BF16 2, FP32 4)
    full_attention: bool = False  # kernels compute the masked half too (hetjax's XLA attention)
    fused_columns: bool = True  # one TP gradient reduction per block region (Megatron)
    # hetjax's engine: ep (and cp, but a dense LLM's) gradient sums in every backward
    replica_grads_per_microbatch: bool = False

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len


@dataclasses.dataclass(frozen=True)
class Plan:
    """A candidate: mode, per-module plans, microbatches per step."""

    mode: Mode
    vision: ModulePlan
    llm: ModulePlan
    microbatches: int

    @property
    def num_gpus(self) -> int:
        n = self.llm.layout.num_devices
        return n + self.vision.layout.num_devices if self.mode == "non-colocated" else n

    @property
    def heterogeneous(self) -> bool:
        return self.mode != "homogeneous"

    def __str__(self) -> str:
        where = f" | islands {self.vision.layout.num_devices}+{self.llm.layout.num_devices}"
        where = where if self.mode == "non-colocated" else ""
        return f"{self.mode}: vision {self.vision} | llm {self.llm} | M={self.microbatches}{where}"


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A plan's predicted figures."""

    plan: Plan
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float  # model FLOPs (3x forward, no recompute) per second per GPU
    peak_memory_bytes: float  # the fullest GPU
    memory_limit_bytes: float
    stages: tuple[StageCost, ...]
    simulated: bool  # makespan from the schedule simulator (else the closed form)

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.memory_limit_bytes

    def collective_bytes(self) -> dict[str, float]:
        """Buffer bytes per device per step by collective kind, summed over stages."""
        out: dict[str, float] = {}
        for st in self.stages:
            for k, v in st.comm.items():
                out[k] = out.get(k, 0.0) + v
        return out


def homogeneous(llm: ModulePlan, microbatches: int, **vision: Any) -> Plan:
    """The baseline: the encoder takes the LLM's dp, tp and cp (no pp) on its first stage."""
    lay = dataclasses.replace(llm.layout, pp=1, ep=1)
    return Plan("homogeneous", ModulePlan(lay, **vision), llm, microbatches)


def check_plan(cfg: Any, plan: Plan, work: Workload) -> None:
    """Raises ValueError (one line, naming the fix) if ``plan`` cannot run ``work``."""
    m = plan.microbatches
    if plan.mode not in MODES:
        raise ValueError(f"unknown mode {plan.mode!r}; use one of {', '.join(MODES)}")
    if m < 1 or work.global_batch % m:
        raise ValueError(
            f"microbatches={m} must divide global_batch={work.global_batch}; pick a divisor"
        )
    if work.images_per_sample * image_tokens(cfg) > work.seq_len:
        raise ValueError(
            f"{work.images_per_sample} images of {image_tokens(cfg)} tokens do not fit in "
            f"seq_len={work.seq_len}; raise seq_len or lower images_per_sample"
        )
    samples = work.global_batch // m
    images = samples * work.images_per_sample
    for name, mp, depth, n, what in (
        (ENCODER, plan.vision, cfg.vision.depth, images, "images"),
        (LLM, plan.llm, cfg.llm.depth, samples, "samples"),
    ):
        if mp.layout.pp > depth:
            raise ValueError(f"{name}: pp={mp.layout.pp} exceeds its {depth} layers")
        if name == ENCODER and plan.mode == "colocated":
            n = work.global_batch * work.images_per_sample  # it may fuse microbatches
        if n % mp.layout.data_ranks:  # dp x fsdp data ranks
            raise ValueError(
                f"{name}: dp*fsdp={mp.layout.data_ranks} must divide the {n} {what} of a "
                "microbatch; use fewer microbatches or degrees that divide it"
            )
    v, l = plan.vision.layout, plan.llm.layout
    if plan.mode == "colocated" and (v.num_devices != l.num_devices or v.pp != 1):
        raise ValueError(
            f"colocated: the encoder ({v}) must span the LLM's {l.num_devices} devices with pp=1"
        )
    vd, ld = v.data_ranks, l.data_ranks  # batch slices on either side: dp x fsdp
    if plan.mode != "homogeneous" and vd % ld and ld % vd:
        raise ValueError(f"boundary: vision dp*fsdp={vd} or llm dp*fsdp={ld} must divide the other")


def _boundary(cfg: Any, plan: Plan, work: Workload, hw: HardwareProfile) -> float:
    """Seconds to move one microbatch's image tokens across the boundary (each way)."""
    from .comm import collective_time, crosses_nodes

    v, l = plan.vision.layout, plan.llm.layout
    vd, ld = v.data_ranks, l.data_ranks  # batch slices on either side: dp x fsdp
    total = work.global_batch / plan.microbatches * work.images_per_sample * image_tokens(cfg)
    nbytes = total * cfg.llm.width * work.act_bytes  # projector output of the microbatch
    if plan.mode == "colocated":  # fan-in all-gather / fan-out slice among the same ranks
        scale = max(vd // ld, 1)
        return collective_time(
            "all-gather", nbytes / ld, scale, crosses=crosses_nodes(v.tp, scale, hw), hw=hw
        )
    if plan.mode == "homogeneous":
        return 0.0
    leaders = min(vd, ld)  # one point-to-point pair per lane, then a broadcast in TP/CP
    p2p = collective_time("p2p", nbytes / leaders, 2, crosses=True, hw=hw)
    fan = l.tp * l.cp
    return p2p + collective_time("all-gather", nbytes / ld, fan, crosses=False, hw=hw)


def _schedule(plan: Plan) -> hs.Schedule:
    m, pp = plan.microbatches, plan.llm.layout.pp
    if plan.mode == "colocated":
        return hs.three_phase([ENCODER], pp, m)
    graph = hs.ModuleGraph({ENCODER: plan.vision.layout.pp, LLM: pp}, [(ENCODER, LLM)])
    if plan.mode == "homogeneous":
        return hs.fused_encoders(graph, m)
    return hs.graph_one_f_one_b(graph, m)


def live_microbatches(plan: Plan) -> tuple[list[int], list[int]]:
    """Microbatches stashed at the peak per stage (vision, llm), as the schedule bounds them."""
    m, pv, pl = plan.microbatches, plan.vision.layout.pp, plan.llm.layout.pp
    llm = [min(pl - s, m) for s in range(pl)]
    if plan.mode == "colocated":
        return [m], llm  # three-phase: every encoder forward precedes the LLM phase
    if plan.mode == "homogeneous":
        return [llm[0]], llm
    graph = hs.ModuleGraph({ENCODER: pv, LLM: pl}, [(ENCODER, LLM)])
    live = [min(w + 1, m) for w in hs.warmup_counts(graph, m)]
    return live[:pv], live[pv:]


def estimate(
    cfg: Any,
    plan: Plan,
    work: Workload,
    hw: HardwareProfile | str,
    *,
    simulate: bool = True,
) -> Estimate:
    """Predicted step time, throughput and memory of ``plan``.

    Args:
        cfg: The model (``models.config.MLLMConfig`` or anything shaped like it).
        plan: The plan (checked with :func:`check_plan`).
        work: Global batch and sequence length.
        hw: A :class:`HardwareProfile` or its name.
        simulate: Time the schedule with the simulator (else the closed form).

    Returns:
        The :class:`Estimate`; ``fits`` says whether it is within the memory limit.
    """
    hw = get_profile(hw)
    check_plan(cfg, plan, work)
    vis = vision_stages(cfg, plan, work, hw)
    llm = llm_stages(cfg, plan, work, hw)
    return assemble(cfg, plan, work, hw, vis, llm, simulate=simulate)


def vision_stages(cfg: Any, plan: Plan, work: Workload, hw: HardwareProfile) -> list[StageCost]:
    """The encoder's stages under ``plan`` (checked), per LLM microbatch."""
    m = plan.microbatches
    images = work.global_batch * work.images_per_sample
    chunks = encoder_chunks(plan, images)
    vis = module_stages(
        encoder_shape(cfg),
        plan.vision,
        samples=images / chunks,  # the encoder's samples are images
        microbatches=chunks,
        live=live_microbatches(plan)[0] if plan.mode != "colocated" else [chunks],
        cp_redundant=plan.mode == "homogeneous",
        hw=hw,
        act_bytes=work.act_bytes,
        fused_columns=work.fused_columns,
        replica_grads_per_microbatch=work.replica_grads_per_microbatch,
        upstream_trains=False,
    )
    if chunks == m:
        return vis
    scale = chunks / m  # spread the fused chunks over the schedule's M encoder actions
    return [
        dataclasses.replace(s, forward_s=s.forward_s * scale, backward_s=s.backward_s * scale)
        for s in vis
    ]


def llm_stages(cfg: Any, plan: Plan, work: Workload, hw: HardwareProfile) -> list[StageCost]:
    """The LLM's stages under ``plan`` (checked); they do not depend on the encoder."""
    m = plan.microbatches
    return module_stages(
        llm_shape(cfg, work.seq_len, work.full_attention),
        plan.llm,
        samples=work.global_batch / m,
        microbatches=m,
        live=live_microbatches(plan)[1],
        vocab=cfg.llm.vocab,
        hw=hw,
        act_bytes=work.act_bytes,
        fused_columns=work.fused_columns,
        replica_grads_per_microbatch=work.replica_grads_per_microbatch,
        upstream_trains=not plan.vision.frozen,
    )


def calls(plan: Plan, work: Workload, vis: list[StageCost], llm: list[StageCost]) -> list:
    """Per stage (vision's, then the LLM's): host calls per microbatch in the forward and
    backward, and per step (see the module doc); a colocated encoder's scaled to its chunks."""
    chunks = encoder_chunks(plan, work.global_batch * work.images_per_sample)
    stages, out = vis + llm, []
    for i, st in enumerate(stages):
        fwd = 0 if st.loss else 2  # the program, the send of its output
        bwd = (1 + (i > 0 and stages[i - 1].backward)) * st.backward  # + the gradient sent back
        scale = chunks / plan.microbatches if i < len(vis) else 1.0
        out.append((fwd * scale, bwd * scale, 2 + (plan.microbatches > 1)))
    return out


def assemble(
    cfg: Any,
    plan: Plan,
    work: Workload,
    hw: HardwareProfile,
    vis: list[StageCost],
    llm: list[StageCost],
    *,
    simulate: bool,
) -> Estimate:
    """The step from priced stages: schedule makespan, then the slowest device group's
    gradient reductions and optimizer update."""
    edge = _boundary(cfg, plan, work, hw)
    m, host = plan.microbatches, hw.dispatch_us * 1e-6
    per_call = calls(plan, work, vis, llm)
    if hw.shared_compute:
        return _shared(cfg, plan, work, hw, vis + llm, per_call, edge)
    stages = vis + llm
    fwd = [s.forward_s + f * host for s, (f, _, _) in zip(stages, per_call, strict=True)]
    bwd = [s.backward_s + b * host for s, (_, b, _) in zip(stages, per_call, strict=True)]
    t = [f + b for f, b in zip(fwd, bwd, strict=True)]
    recv = [s.recv_s for s in stages]
    if plan.mode == "colocated":
        makespan = m * (t[0] + edge) + _chain(t[1:], recv[1:], m)
    elif plan.mode == "homogeneous":
        makespan = _chain([t[0] + t[1]] + t[2:], recv[1:], m)
    else:
        recv[len(vis)] = edge
        makespan = _chain(t, recv, m)
    if simulate:
        makespan = _simulate(plan, fwd, bwd, recv, edge)
    n = 2 + (m > 1)  # step programs per stage (see calls)
    update = lambda g: sum(s.reduce_s + s.optimizer_s + n * host for s in g)  # noqa: E731
    step = makespan + max(update(g) for g in _device_groups(plan, vis, llm))
    return _estimate(cfg, plan, work, hw, stages, step, simulated=simulate)


def _estimate(cfg, plan, work, hw, stages, step: float, *, simulated: bool) -> Estimate:
    nv = plan.vision.layout.pp
    groups = _device_groups(plan, stages[:nv], stages[nv:])
    peaks = [sum(s.memory.total for s in g) for g in groups]  # colocated: [0] has LLM stage 0
    peaks[0] += colocated_held_bytes(cfg, plan, work) if plan.mode == "colocated" else 0.0
    return Estimate(
        plan=plan,
        step_time_s=step,
        tokens_per_s=work.tokens / step,
        tflops_per_gpu=model_flops(cfg, work) / step / plan.num_gpus / 1e12,
        peak_memory_bytes=max(peaks),
        memory_limit_bytes=hw.memory_bytes,
        stages=tuple(stages),
        simulated=simulated,
    )


def _shared(cfg, plan, work, hw, stages, per_call, edge: float) -> Estimate:
    """A step on devices sharing one pool of cores (see the module doc): the host's calls,
    then every device's work over all devices (the boundary's copies are the host's)."""
    m = plan.microbatches
    host = hw.dispatch_us * 1e-6 * sum(m * (f + b) + n for f, b, n in per_call)
    work_s = sum(
        s.devices * (m * (s.forward_s + s.backward_s + 2 * s.recv_s) + s.reduce_s + s.optimizer_s)
        for s in stages
    )
    step = host + work_s / plan.num_gpus + 2 * m * edge
    return _estimate(cfg, plan, work, hw, stages, step, simulated=False)


def model_flops(cfg: Any, work: Workload) -> float:
    """Model FLOPs of one step: the trained-part rule (3x forward) over the model's own
    forward counts, the LM head over every token, no recompute."""
    v, l = encoder_shape(cfg), llm_shape(cfg, work.seq_len)  # routed tokens, causal
    per_sample = work.images_per_sample * _forward(v) + _forward(l)
    return FACTORS[TRAINED] * per_sample * work.global_batch


def encoder_chunks(plan: Plan, images: int) -> int:
    """Microbatches the encoder runs in. Colocated, its forward and backward phases hold
    nothing else, so it may fuse the step's M microbatches into fewer, larger chunks: the
    most chunks (a divisor of M) that still give each of its dp ranks whole images."""
    m, dp = plan.microbatches, plan.vision.layout.data_ranks
    if plan.mode != "colocated":
        return m
    return max(d for d in range(1, m + 1) if m % d == 0 and (images // d) % dp == 0)


def _forward(shape) -> float:
    return shape.depth * shape.layer_flops + shape.first_flops + shape.last_flops


def _chain(t: list[float], recv: list[float], m: int) -> float:
    """Closed-form 1F1B makespan of a chain: stage times ``t`` (F + B), transfers ``recv``
    (each way) into each stage."""
    per = [a + 2 * r for a, r in zip(t, recv, strict=True)]
    return sum(per) + (m - 1) * max(per)


def _device_groups(plan: Plan, vis: list[StageCost], llm: list[StageCost]) -> list[list]:
    if plan.mode == "colocated":
        return [vis + [s] for s in llm]
    if plan.mode == "homogeneous":
        return [vis + llm[:1]] + [[s] for s in llm[1:]]
    return [[s] for s in vis + llm]


def _simulate(plan: Plan, fwd: list, bwd: list, recv: list[float], edge: float) -> float:
    sched = _schedule(plan)
    table: dict = {}
    for gid, (f, b) in enumerate(zip(fwd, bwd, strict=True)):
        table[("F", gid)] = f
        table[("B", gid)] = b
        table[("RECV_F", gid)] = recv[gid]
        if gid > 0:
            table[("RECV_B", gid - 1)] = recv[gid]
    if plan.mode == "colocated":
        table[("SEND_F", 0)] = edge
        table[("RECV_F", 1)] = 0.0
    return hs.simulate(sched, table, check=False).makespan
