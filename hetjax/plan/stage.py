"""One module's pipeline stages priced: compute and communication time, memory, bytes.

Per microbatch and stage: forward time is the stage's FLOPs on one device over the
achieved matmul rate (:meth:`HardwareProfile.matmul_tflops` at the width a TP shard
leaves), plus its exposed collectives: TP (two all-gathers and two reduce-scatters per
block with sequence parallelism, two all-reduces without; the backward as many), the CP
ring (``cp - 1`` key/value passes per block, hidden behind attention where attention is
longer), MoE all-to-alls (dispatch and combine). Backward is twice the forward's compute
plus what the activation policy (:mod:`hetjax.recompute`) replays: ``full`` the whole
forward with its collectives; ``selective`` the attention core (QK^T and PV, with the CP
ring that feeds it) and an MoE layer's experts (with their all-to-alls), since those
matmuls batch over heads or experts and the engine saves only weight matmuls' outputs;
``none`` nothing. Its TP collectives are one per column-parallel input gradient. With
``fsdp`` the stage holds ``1 / fsdp`` of its weights, gradients and optimizer state; per
microbatch its forward all-gathers every layer's weights, its backward gathers them again
and reduce-scatters their gradients (float32, as the engine stores them:
:mod:`hetjax.runtime.fsdp`), overlapped with the layers' compute (only the excess is
exposed); one collective per layer, or on XLA:CPU (``shared_compute``), where the engine
chains them, a gather per parameter array (:func:`fsdp_calls`), each paying the call's
latency and ``hw.fsdp_call_us`` (what the chain costs beyond a bare collective); the
once-per-step reduction then spans the remaining dp. The DP gradient reduction (ZeRO-1:
reduce-scatter of gradients, all-gather of parameters) runs once per step and overlaps
only the last microbatch's backward, as Megatron's bucketed overlap does. On devices
that share the host's cores (``shared_compute``) nothing overlaps (:func:`exposed`): a
collective there is the cores' own copying.

``cp_redundant`` prices the homogeneous baseline's encoder under the LLM's CP: stock
Megatron runs the encoder on every CP rank of a data lane (an image is not a sequence to
split), so CP ranks repeat its work.

What is not a weight matmul (the time model; each rate is a
:class:`~hetjax.plan.hardware.HardwareProfile` constant): attention's ``QK^T`` and ``PV``
run as a fused kernel at its own rate where the device has one (BF16 on GPU), else as
thin matmuls (contracting over ``head_dim``) whose score matrix is written, softmaxed
and read again (``hw.score_passes`` passes over ``heads x keys`` elements per token);
norms, residual adds and the MLP's activation move ``10 D + mats F`` elements per token
and layer (:func:`elementwise_elements`) at ``hw.elementwise_scale`` times their bytes,
an MoE layer's dispatch buffers (``top_k`` executed slots of ``D`` per token)
``hw.moe_buffer_passes`` passes (and ``hw.moe_launch_us`` per MoE block and pass), a
trained stage's backward ``hw.weight_passes`` over its block weights (their gradients
written and moved), the loss head's softmax and its gradient
``LOSS_PASSES`` FP32 passes over the vocabulary. Backward moves twice the forward's
bytes. Each block (and the embedding or head) costs ``launch_us`` per forward pass on
every device, twice in the backward: the fixed cost of its kernels, whatever their
size. A frozen module (``ModulePlan.frozen``) computes only input gradients (one
forward's matmuls, none at all without a trainable module upstream) and has no
gradient, optimizer state or update.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from hetjax.meshes.layout import Layout
from hetjax.recompute import DEFAULT_RECOMPUTE, Recompute

from .comm import collective_time, crosses_nodes
from .hardware import HardwareProfile
from .memory import BF16, FP32, OPTIMIZER_BYTES, StageMemory, stage_memory
from .parts import ModuleShape

LOSS_PASSES = (2, 3)  # FP32 passes over the logits: forward (softmax), backward


def attention_kernel(
    hw: HardwareProfile, act_bytes: int, head_dim: float, tokens: float
) -> tuple[float, float]:
    """FLOP/s of attention's ``QK^T`` and ``PV`` on one device, and the passes over the
    score matrix that go to memory: a fused kernel's rate and none, or plain attention's
    thin matmuls (the curve at ``head_dim``) and ``hw.score_passes``."""
    if hw.fused_attention(act_bytes):
        return hw.peak_tflops * hw.fused_attention_efficiency * 1e12, 0
    return hw.matmul_tflops(min(head_dim, tokens)) * 1e12, hw.score_passes


def fsdp_calls(
    shape: ModuleShape, layers: int, first: bool, last: bool, hw: HardwareProfile
) -> tuple[int, int, int]:
    """An fsdp stage's collectives per microbatch: the forward's gathers, the backward's
    gathers and its gradient reduce-scatters. One of each per layer where XLA combines a
    layer's (GPU); on XLA:CPU (``shared_compute``), where the engine chains them
    (:mod:`hetjax.runtime.fsdp`), a gather per parameter array
    (``shape.fsdp_arrays``; the backward's of the matrices, ``shape.fsdp_regathered``),
    and XLA still combines the reduce-scatters: one per layer, one for the arrays outside
    the blocks."""
    if not hw.shared_compute:
        return layers, layers, layers
    n = lambda c: layers * c[0] + first * c[1] + last * c[2]  # noqa: E731
    return n(shape.fsdp_arrays), n(shape.fsdp_regathered), layers + (first or last)


def exposed(comm: float, compute: float, hw: HardwareProfile) -> float:
    """Seconds of ``comm`` not hidden behind ``compute``: the excess where collectives run
    beside the kernels (GPU links and streams), all of it where the host's cores run both
    (``shared_compute``: XLA:CPU's collectives are copies between host buffers, made by
    the same cores that run the kernels)."""
    return comm if hw.shared_compute else max(0.0, comm - compute)


def elementwise_elements(shape: ModuleShape, tp: int = 1, *, sp: bool = True) -> float:
    """Elements one token's norms, residual adds and MLP activation read and write in one
    layer on one of ``tp`` ranks: two norms (``4 D``), two residual adds (``6 D``) - split
    over TP only with sequence parallelism - and the activation (GELU reads and writes
    ``F``; SwiGLU reads two and writes one: ``mats x F``)."""
    return 10 * shape.width / (tp if sp else 1) + shape.mlp_mats * shape.mlp / tp


@dataclasses.dataclass(frozen=True)
class ModulePlan:
    """How one module trains: its degrees and its memory savers."""

    layout: Layout  # dp, fsdp, tp, cp, pp, ep
    recompute: Recompute = DEFAULT_RECOMPUTE  # what the backward replays (hetjax.recompute)
    zero1: bool = False  # optimizer state sharded over the data-parallel (and cp) ranks
    sequence_parallel: bool = True  # with tp > 1: activations between TP regions on sequence
    frozen: bool = False  # no parameter gradients, optimizer state or update

    def __str__(self) -> str:
        names = ("dp", "fsdp", "tp", "cp", "pp", "ep")
        degrees = [f"{k}={getattr(self.layout, k)}" for k in names]
        on = [("zero1", self.zero1), (f"recompute={self.recompute}", self.recompute != "none")]
        on.append(("frozen", self.frozen))
        return ",".join([d for d in degrees if not d.endswith("=1")] + [k for k, v in on if v])


@dataclasses.dataclass(frozen=True)
class StageCost:
    """One pipeline stage of one module, per device."""

    module: str
    index: int  # stage index in the module
    devices: int  # devices of the stage (dp x fsdp x tp x cp)
    forward_s: float  # per microbatch
    backward_s: float  # per microbatch
    recv_s: float  # receiving one microbatch's activation from the previous stage
    reduce_s: float  # the step's gradient reduction left exposed
    optimizer_s: float  # the optimizer update (HBM bound)
    loss: bool  # the sink's last stage: its forward runs inside its backward program
    backward: bool  # it runs a backward (not a frozen module with nothing trainable upstream)
    trains: bool  # it has gradients to reduce and an update (not frozen)
    memory: StageMemory
    flops: float  # model forward FLOPs of one microbatch, all devices of the stage
    comm: dict[str, float]  # per device per step: buffer bytes by collective kind
    forward_comm: dict[str, float]  # ... of one microbatch's forward pass
    backward_comm: dict[str, float]  # ... of one microbatch's backward pass (no recompute)
    step_comm: dict[str, float]  # ... once per step (the DP gradient reduction)


def module_stages(
    shape: ModuleShape,
    plan: ModulePlan,
    *,
    samples: float,
    microbatches: int,
    live: list[int],
    hw: HardwareProfile,
    act_bytes: int = BF16,
    cp_redundant: bool = False,
    vocab: int = 0,
    fused_columns: bool = True,
    replica_grads_per_microbatch: bool = False,
    upstream_trains: bool = False,
) -> list[StageCost]:
    """Costs of every pipeline stage of a module.

    Args:
        shape: The module (:mod:`hetjax.plan.parts`).
        plan: Its layout and memory savers.
        samples: Samples of one global microbatch (all data lanes together).
        microbatches: Microbatches per step (M).
        live: Per stage, microbatches whose activations are stashed at the peak.
        hw: The hardware.
        act_bytes: Bytes per activation element (BF16: 2, FP32: 4).
        cp_redundant: CP ranks repeat the module's work (see the module doc).
        vocab: Vocabulary of a vocabulary-parallel embedding (first stage) and LM head
            (last stage); 0: none.
        fused_columns: The backward all-reduces one input gradient per block region
            (Megatron fuses QKV and gate/up); False: one per column-parallel matrix
            (``shape.column_mats``), as XLA does for separate weights.
        replica_grads_per_microbatch: hetjax's stage programs: gradients of parameters
            replicated over the ep ranks, and over the cp ranks of a module the engine
            does not run per cp rank, are summed inside every microbatch's backward (as
            GSPMD does), and only the rest reduce once per step. A dense loss module
            (``vocab`` > 0) runs per cp rank (``StageProgram.cp_local``): its gradients
            are reduced over dp x cp once per step. False: one reduction over dp x cp per
            step everywhere (Megatron).
        upstream_trains: a module upstream trains, so a frozen module still computes input
            gradients.

    Returns:
        One :class:`StageCost` per stage.
    """
    lay = plan.layout
    tp, cp, pp, dp, ep, fsdp = lay.tp, lay.cp, lay.pp, lay.dp, lay.ep, lay.fsdp
    split = 1 if cp_redundant else cp
    lane = samples / lay.data_ranks  # samples per data lane per microbatch
    tokens = lane * shape.tokens / split  # per device, inside the blocks
    rate = hw.matmul_tflops(min(min(shape.width, shape.mlp) / tp, tokens)) * 1e12
    layers = -(-shape.depth // pp)  # uneven splits priced as their largest stage
    buf = tokens * shape.width * act_bytes  # one block's residual stream, per device
    tp_x, cp_x = crosses_nodes(1, tp, hw), crosses_nodes(tp, cp, hw)
    fsdp_x, dp_x = crosses_nodes(tp * cp * ep, fsdp, hw), crosses_nodes(tp * cp * fsdp, dp, hw)
    pp_x = crosses_nodes(tp * cp * dp * fsdp, 2, hw)
    moe = shape.experts > 1 and ep > 1
    out = []
    attn_rate, passes = attention_kernel(hw, act_bytes, shape.q_width / shape.heads, tokens)
    scores = passes * shape.heads / tp * shape.tokens  # score elements moved per token
    elementwise = tokens * layers * (elementwise_elements(shape, tp, sp=plan.sequence_parallel))
    elementwise *= hw.elementwise_scale
    # an MoE layer's [E, C, D] dispatch buffers (executed slots), filled and read per pass
    moe_buf = (shape.experts > 1) * tokens * layers * shape.top_k * shape.width * act_bytes
    moe_buf *= hw.moe_buffer_passes
    trains = not plan.frozen
    runs_backward = trains or upstream_trains
    for s in range(pp):
        first, last = s == 0, s == pp - 1
        per_lane = layers * shape.layer_flops + first * shape.first_flops + last * shape.last_flops
        attention = lane * layers * shape.attention_flops / (tp * split) / attn_rate
        weights = lane * (per_lane - layers * shape.attention_flops) / (tp * split) / rate
        compute = weights + attention
        ew_bytes = (elementwise + tokens * layers * scores) * act_bytes + moe_buf
        loss_bytes = tokens * vocab / tp * FP32 if vocab and last else 0.0
        # Kernel launches: the stage's blocks, plus its embedding or head, once per pass.
        launch = (layers + (first or last)) * hw.launch_us * 1e-6
        launch += (shape.experts > 1) * layers * hw.moe_launch_us * 1e-6  # routing kernels
        memory_f = hw.memory_seconds(ew_bytes + LOSS_PASSES[0] * loss_bytes) + launch
        memory_b = hw.memory_seconds(2 * ew_bytes + LOSS_PASSES[1] * loss_bytes) + 2 * launch
        # TP collectives per pass: two per block forward (after attention and MLP), the
        # vocabulary-parallel embedding's on the first stage; backward one per input
        # gradient of the column-parallel matmuls, the LM head's on the last stage.
        head = vocab > 0
        calls_f = 2 * layers + (first and head)
        calls_b = (2 if fused_columns else shape.column_mats) * layers + (last and head)
        kinds = ("all-gather", "reduce-scatter") if plan.sequence_parallel else ("all-reduce",)
        tp_f = sum(collective_time(k, buf, tp, crosses=tp_x, hw=hw, calls=calls_f) for k in kinds)
        tp_b = sum(collective_time(k, buf, tp, crosses=tp_x, hw=hw, calls=calls_b) for k in kinds)
        kv = tokens * 2 * shape.kv_width / tp * act_bytes
        ring = collective_time("p2p", kv, cp, crosses=cp_x, hw=hw, calls=(cp - 1) * layers)
        if cp_redundant:
            ring = 0.0
        a2a_buf = tokens * shape.top_k * shape.width * act_bytes  # [E, C, D] buffers
        ep_x = crosses_nodes(tp * cp, ep, hw)
        a2a_calls = 2 * layers  # dispatch and combine per block
        a2a = moe * collective_time("all-to-all", a2a_buf, ep, crosses=ep_x, hw=hw, calls=a2a_calls)
        forward = compute + memory_f + tp_f + exposed(ring, attention, hw) + a2a
        # A frozen module's backward is its input gradients: one forward's matmuls.
        backward = (2 if trains else 1) * compute + memory_b + tp_b + a2a
        # held: the blocks' dense part and 1 / ep of their experts
        experts = layers * shape.expert_params
        blocks = layers * shape.layer_params - experts * (1 - 1 / ep)
        # the blocks' weight gradients written and moved (hw.weight_passes; 0 on GPU)
        backward += trains * hw.memory_seconds(blocks / tp / fsdp * FP32 * hw.weight_passes)
        backward += exposed(2 * ring, 2 * attention, hw)
        if plan.recompute == "full":
            backward += forward
        elif plan.recompute == "selective":
            # Two FLOPs per expert weight per token slot (top_k slots of one expert each).
            per_sample = 2 * shape.tokens * shape.top_k * shape.expert_params / shape.experts
            expert_s = lane * layers * per_sample / (tp * split) / rate
            scores_s = hw.memory_seconds(tokens * layers * scores * act_bytes)
            core = attention + scores_s
            backward += core + exposed(ring, core, hw) + expert_s + a2a
            backward += hw.memory_seconds(moe_buf)
        backward *= runs_backward
        fwd_comm: dict[str, float] = defaultdict(float)
        bwd_comm: dict[str, float] = defaultdict(float)
        for kind in kinds if tp > 1 else ():
            fwd_comm[kind] += calls_f * buf
            bwd_comm[kind] += calls_b * buf
        if shape.projector and last and tp > 1:  # its row-parallel output, column input
            fwd_comm[kinds[0]] += tokens * shape.out_width * act_bytes
            bwd_comm[kinds[0]] += buf
        if cp > 1 and not cp_redundant:
            fwd_comm["collective-permute"] += (cp - 1) * layers * kv
            # K/V pass the ring again; the dK/dV accumulators travel all cp hops home.
            bwd_comm["collective-permute"] += (2 * cp - 1) * layers * kv
        if moe:
            fwd_comm["all-to-all"] += a2a_calls * a2a_buf
            bwd_comm["all-to-all"] += a2a_calls * a2a_buf
        recv = 0.0
        if not first:
            act = buf / (tp if plan.sequence_parallel else 1)
            recv = collective_time("p2p", act, 2, crosses=pp_x, hw=hw)
        params = blocks + first * shape.first_params + last * shape.last_params
        group = dp * cp
        grads = params / tp / fsdp * FP32
        if fsdp > 1:  # gathers and reduce-scatters per microbatch, float32 as stored
            held, each = params / tp * FP32, dict(crosses=fsdp_x, hw=hw)
            calls, again, scatters = fsdp_calls(shape, layers, first, last, hw)
            gathers = collective_time("all-gather", held / calls, fsdp, **each, calls=calls)
            regathers = collective_time("all-gather", held / again, fsdp, **each, calls=again)
            scatter = collective_time(
                "reduce-scatter", held / scatters, fsdp, **each, calls=scatters
            )
            chained = hw.fsdp_call_us * 1e-6  # per collective, where the engine chains
            forward += exposed(gathers, compute, hw) + calls * chained
            fwd_comm["all-gather"] += held
            if runs_backward:
                backward += exposed(regathers + trains * scatter, 2 * compute, hw)
                backward += (again + trains * scatters) * chained
                bwd_comm["all-gather"] += held
                bwd_comm["reduce-scatter"] += held * trains
        # What hetjax's engine sums in the backward (see replica_grads_per_microbatch).
        cp_local = vocab > 0 and shape.experts <= 1
        sync = 1 if cp_redundant or cp_local else cp * (ep if moe else 1)
        if replica_grads_per_microbatch and sync > 1 and trains:
            dense = (params - experts / ep) / tp * FP32
            backward += collective_time("all-reduce", dense, sync, crosses=cp_x, hw=hw)
            bwd_comm["all-reduce"] += dense
            group = dp // ep if moe else dp
        if plan.zero1:
            reduce = collective_time("reduce-scatter", grads, group, crosses=dp_x, hw=hw)
            gather = params / tp / fsdp * act_bytes  # the compute copy
            reduce += collective_time("all-gather", gather, group, crosses=dp_x, hw=hw)
        else:
            reduce = collective_time("all-reduce", grads, group, crosses=dp_x, hw=hw)
        step_comm = {"all-reduce": grads} if group > 1 else {}  # one FP32 all-reduce
        if plan.zero1 and group > 1:
            step_comm["all-gather"] = gather
        if not trains:
            reduce, step_comm = 0.0, {}
        if not runs_backward:
            bwd_comm.clear()
        # The forward collectives the backward runs again (see the module doc).
        replayed = {"none": (), "selective": ("collective-permute", "all-to-all"), "full": fwd_comm}
        replayed = replayed[plan.recompute]
        comm = defaultdict(float, step_comm)
        for kind in set(fwd_comm) | set(bwd_comm):
            again = fwd_comm[kind] if kind in replayed else 0.0
            comm[kind] += microbatches * (fwd_comm[kind] + again + bwd_comm[kind])
        shard = group if plan.zero1 else 1
        mem = stage_memory(
            shape,
            params=params / fsdp,
            layers=layers,
            tokens_per_microbatch=tokens,
            live_microbatches=live[s],
            tp=tp,
            shard=shard,
            recompute=plan.recompute,
            sp=plan.sequence_parallel,
            logits_vocab=vocab if last else 0,
        )
        touched = params / tp / fsdp * (OPTIMIZER_BYTES / shard + FP32 + BF16) * 2  # r + w
        if not trains:
            touched, mem = 0.0, dataclasses.replace(mem, grads=0.0, optimizer=0.0)
        out.append(
            StageCost(
                module=shape.name,
                index=s,
                devices=lay.devices_per_stage,
                forward_s=forward,
                backward_s=backward,
                recv_s=recv,
                reduce_s=exposed(reduce, backward, hw),
                optimizer_s=hw.memory_seconds(touched),
                loss=bool(vocab) and last,
                backward=runs_backward,
                trains=trains,
                memory=mem,
                flops=samples * per_lane,
                comm=dict(comm),
                forward_comm=dict(fwd_comm),
                backward_comm=dict(bwd_comm),
                step_comm=step_comm,
            )
        )
    return out
