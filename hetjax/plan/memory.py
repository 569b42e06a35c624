"""Bytes per device of one pipeline stage: weights, gradients, optimizer, activations.

Megatron's mixed-precision accounting, per parameter on a device: a BF16 copy (2 B), an
FP32 gradient accumulator (4 B) and the FP32 master copy with Adam's two moments (12 B);
ZeRO-1 shards the 12 B over the module's data-parallel ranks (context-parallel ranks hold
the same parameters, so they share the shard too). TP divides everything.

Activations follow the Korthikanti et al. count with flash attention (no score matrix)
and sequence parallelism (every saved tensor split over TP), per token and layer in BF16:
the two norm inputs and the two matmul inputs (4 D), queries, keys, values and the
attention output (2 Q + 2 KV), and the MLP's hidden activations (gate, up, product for
SwiGLU: 3 F; up and GELU for a plain MLP: 2 F). A GPT block (Q = KV = D, F = 4 D) gets
32 D, close to the paper's 34 D. Full recompute keeps each layer's input (D) and one
layer's activations for its backward. Selective recompute keeps what hetjax's engine
saves under it (:mod:`hetjax.recompute`): the weight matmuls' outputs - queries, keys and
values (Q + 2 KV), the MLP's up and gate projections ((mats - 1) F; none in an MoE layer,
whose expert matmuls batch over experts and are recomputed) and the two output
projections (2 D) - and rebuilds one layer's other activations at a time in its backward.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hetjax.recompute import Recompute

from .parts import ModuleShape, image_tokens

BF16, FP32 = 2, 4
WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = BF16, FP32, 3 * FP32


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Bytes per device of one stage."""

    weights: float  # BF16 parameters
    grads: float  # FP32 gradient accumulators
    optimizer: float  # FP32 master copy + Adam moments (ZeRO-1: sharded)
    activations: float  # saved for the backward, all live microbatches
    transient: float  # the largest short-lived buffer (logits and their gradient)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.transient


def activation_bytes_per_token(shape: ModuleShape, tp: int = 1, *, sp: bool = True) -> float:
    """BF16 bytes one token leaves for the backward in one layer on one of ``tp`` ranks
    (see the module doc); without sequence parallelism (``sp``) the 4 D of norm and
    matmul inputs are replicated over TP."""
    s = shape
    split = 2 * s.q_width + 2 * s.kv_width + s.mlp_mats * s.mlp
    return BF16 * ((4 * s.width + split) / tp if sp else 4 * s.width + split / tp)


def selective_bytes_per_token(shape: ModuleShape, tp: int = 1, *, sp: bool = True) -> float:
    """BF16 bytes one token keeps in one layer on one of ``tp`` ranks under ``selective``
    recompute (see the module doc): the column-parallel matmuls' outputs are split over
    TP, the two output projections only with sequence parallelism (``sp``)."""
    s = shape
    mlp = (s.mlp_mats - 1) * s.mlp if s.experts <= 1 else 0
    split = s.q_width + 2 * s.kv_width + mlp
    return BF16 * (split / tp + 2 * s.width / (tp if sp else 1))


def stage_memory(
    shape: ModuleShape,
    *,
    params: float,
    layers: int,
    tokens_per_microbatch: float,
    live_microbatches: int,
    tp: int,
    shard: int,
    recompute: Recompute,
    sp: bool = True,
    logits_vocab: int = 0,
) -> StageMemory:
    """Memory of one stage on one device.

    Args:
        shape: The module.
        params: Parameters the stage holds (all TP ranks together).
        layers: Blocks on the stage.
        tokens_per_microbatch: Tokens one device's share of a microbatch holds inside the
            blocks (after the CP split, before the TP split).
        live_microbatches: Microbatches whose activations are stashed at the peak (the
            schedule's ``max_live``).
        tp: Tensor-parallel degree.
        shard: Ranks the ZeRO-1 optimizer shard spans (1: no ZeRO-1).
        recompute: The activation policy (``"full"``: checkpointing of every block).
        sp: Sequence parallelism (saved activations split over TP).
        logits_vocab: Vocabulary of the LM head on this stage (0: no head).

    Returns:
        The stage's :class:`StageMemory`.
    """
    local = params / tp
    per_layer = tokens_per_microbatch * activation_bytes_per_token(shape, tp, sp=sp)
    if recompute == "full":
        kept = tokens_per_microbatch * shape.width * BF16 / (tp if sp else 1)  # block inputs
        acts = live_microbatches * layers * kept + per_layer
    elif recompute == "selective":
        kept = tokens_per_microbatch * selective_bytes_per_token(shape, tp, sp=sp)
        acts = live_microbatches * layers * kept + per_layer - kept  # one layer rebuilt
    else:
        acts = live_microbatches * layers * per_layer
    logits = 2 * tokens_per_microbatch * logits_vocab / tp * FP32
    return StageMemory(
        weights=local * WEIGHT_BYTES,
        grads=local * GRAD_BYTES,
        optimizer=local * OPTIMIZER_BYTES / shard,
        activations=acts,
        transient=logits,
    )


def colocated_held_bytes(cfg: Any, plan: Any, work: Any) -> float:
    """Bytes per device of the LLM's first stage that a colocated plan's three-phase
    schedule holds beyond its stages' own: phase 1 runs the encoder's forward over every
    microbatch, so their outputs (in the LLM's layout: the image tokens of the device's
    data lane and CP share at the LLM's width, replicated over TP, as the colocated
    transform leaves them) wait for the LLM's first stage, and the gradients it returns
    for them wait for phase 3's encoder backward. Between them, one buffer per
    microbatch but those in flight in the LLM's pipeline (its stage stash holds them)."""
    lay, m = plan.llm.layout, plan.microbatches
    images = work.global_batch / m / lay.data_ranks * work.images_per_sample
    per_microbatch = images * image_tokens(cfg) / lay.cp * cfg.llm.width * work.act_bytes
    return (m - min(lay.pp, m)) * per_microbatch
