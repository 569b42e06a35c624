"""One module's pipeline stages priced: compute and communication time, memory, bytes.

Per microbatch and stage: forward time is the stage's FLOPs on one device over the
achieved matmul rate (:meth:`HardwareProfile.matmul_tflops` at the width a TP shard
leaves), plus its exposed collectives: TP (two all-gathers and two reduce-scatters per
block with sequence parallelism, two all-reduces without; the backward as many), the CP
ring (``cp - 1`` key/value passes per block, hidden behind attention where attention is
longer), MoE all-to-alls (dispatch and combine). Backward is twice the forward's compute
(three times with full recompute, which also repeats the forward's collectives). The DP
gradient reduction (ZeRO-1: reduce-scatter of gradients, all-gather of parameters) runs
once per step and overlaps only the last microbatch's backward, as Megatron's bucketed
overlap does.

``cp_redundant`` prices the homogeneous baseline's encoder under the LLM's CP: stock
Megatron runs the encoder on every CP rank of a data lane (an image is not a sequence to
split), so CP ranks repeat its work.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from hetjax.meshes.layout import Layout

from .comm import collective_time, crosses_nodes
from .hardware import HardwareProfile
from .memory import BF16, FP32, OPTIMIZER_BYTES, Recompute, StageMemory, stage_memory
from .parts import ModuleShape


@dataclasses.dataclass(frozen=True)
class ModulePlan:
    """How one module trains: its degrees and its memory savers."""

    layout: Layout  # dp, tp, cp, pp, ep
    recompute: Recompute = "none"  # "full": every block's activations recomputed in backward
    zero1: bool = False  # optimizer state sharded over the data-parallel (and cp) ranks
    sequence_parallel: bool = True  # with tp > 1: activations between TP regions on sequence

    def __str__(self) -> str:
        degrees = [f"{k}={getattr(self.layout, k)}" for k in ("dp", "tp", "cp", "pp", "ep")]
        on = (("zero1", self.zero1), ("recompute", self.recompute == "full"))
        return ",".join([d for d in degrees if not d.endswith("=1")] + [k for k, v in on if v])


@dataclasses.dataclass(frozen=True)
class StageCost:
    """One pipeline stage of one module, per device."""

    module: str
    index: int  # stage index in the module
    devices: int  # devices of the stage (dp x tp x cp)
    forward_s: float  # per microbatch
    backward_s: float  # per microbatch
    recv_s: float  # receiving one microbatch's activation from the previous stage
    reduce_s: float  # the step's gradient reduction left exposed
    optimizer_s: float  # the optimizer update (HBM bound)
    memory: StageMemory
    flops: float  # model forward FLOPs of one microbatch, all devices of the stage
    comm: dict[str, float]  # per device per step: buffer bytes by collective kind


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
        vocab: LM-head vocabulary on the last stage (0: none).

    Returns:
        One :class:`StageCost` per stage.
    """
    lay = plan.layout
    tp, cp, pp, dp, ep = lay.tp, lay.cp, lay.pp, lay.dp, lay.ep
    split = 1 if cp_redundant else cp
    lane = samples / dp  # samples per data lane per microbatch
    tokens = lane * shape.tokens / split  # per device, inside the blocks
    rate = hw.matmul_tflops(min(min(shape.width, shape.mlp) / tp, tokens)) * 1e12
    layers = -(-shape.depth // pp)  # uneven splits priced as their largest stage
    buf = tokens * shape.width * act_bytes  # one block's residual stream, per device
    tp_x, cp_x = crosses_nodes(1, tp, hw), crosses_nodes(tp, cp, hw)
    dp_x, pp_x = crosses_nodes(tp * cp, dp, hw), crosses_nodes(tp * cp * dp, 2, hw)
    moe = shape.experts > 1 and ep > 1
    out = []
    for s in range(pp):
        first, last = s == 0, s == pp - 1
        per_lane = layers * shape.layer_flops + first * shape.first_flops + last * shape.last_flops
        compute = lane * per_lane / (tp * split) / rate
        comm: dict[str, float] = defaultdict(float)
        fwd_calls = 2 * layers  # per kind: two per block (attention, MLP)
        if plan.sequence_parallel:
            tp_f = collective_time("all-gather", buf, tp, crosses=tp_x, hw=hw, calls=fwd_calls)
            tp_f += collective_time("reduce-scatter", buf, tp, crosses=tp_x, hw=hw, calls=fwd_calls)
            tp_kinds = ("all-gather", "reduce-scatter")
        else:
            tp_f = collective_time("all-reduce", buf, tp, crosses=tp_x, hw=hw, calls=fwd_calls)
            tp_kinds = ("all-reduce",)
        kv = tokens * 2 * shape.kv_width / tp * act_bytes
        ring = collective_time("p2p", kv, cp, crosses=cp_x, hw=hw, calls=(cp - 1) * layers)
        if cp_redundant:
            ring = 0.0
        attention = lane * layers * shape.attention_flops / (tp * split) / rate
        a2a_buf = tokens * shape.top_k * shape.width * act_bytes
        ep_x = crosses_nodes(tp * cp, ep, hw)
        a2a = moe * collective_time("all-to-all", a2a_buf, ep, crosses=ep_x, hw=hw, calls=fwd_calls)
        forward = compute + tp_f + max(0.0, ring - attention) + a2a
        backward = 2 * compute + tp_f + max(0.0, 2 * ring - 2 * attention) + a2a
        passes = 2  # collectives of one microbatch: forward, backward
        if plan.recompute == "full":
            backward += forward
            passes = 3
        if tp > 1:
            for kind in tp_kinds:
                comm[kind] += microbatches * passes * fwd_calls * buf
        if cp > 1 and not cp_redundant:
            comm["collective-permute"] += microbatches * (passes + 1) * (cp - 1) * layers * kv
        if moe:
            comm["all-to-all"] += microbatches * passes * fwd_calls * a2a_buf
        recv = 0.0
        if not first:
            act = buf / (tp if plan.sequence_parallel else 1)
            recv = collective_time("p2p", act, 2, crosses=pp_x, hw=hw)
        params = layers * shape.layer_params + first * shape.first_params + last * shape.last_params
        group = dp * cp
        grads = params / tp * FP32
        if plan.zero1:
            reduce = collective_time("reduce-scatter", grads, group, crosses=dp_x, hw=hw)
            reduce += collective_time("all-gather", params / tp * BF16, group, crosses=dp_x, hw=hw)
        else:
            reduce = collective_time("all-reduce", grads, group, crosses=dp_x, hw=hw)
        if group > 1:
            comm["all-reduce"] += grads  # hetjax reduces FP32 gradients with one all-reduce
        shard = group if plan.zero1 else 1
        mem = stage_memory(
            shape,
            params=params,
            layers=layers,
            tokens_per_microbatch=tokens,
            live_microbatches=live[s],
            tp=tp,
            shard=shard,
            recompute=plan.recompute,
            sp=plan.sequence_parallel,
            logits_vocab=vocab if last else 0,
        )
        touched = params / tp * (OPTIMIZER_BYTES / shard + FP32 + BF16) * 2  # read + write
        out.append(
            StageCost(
                module=shape.name,
                index=s,
                devices=dp * tp * cp,
                forward_s=forward,
                backward_s=backward,
                recv_s=recv,
                reduce_s=max(0.0, reduce - backward),
                optimizer_s=touched / (hw.hbm_tbps * 1e12),
                memory=mem,
                flops=samples * per_lane,
                comm=dict(comm),
            )
        )
    return out
