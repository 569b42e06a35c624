"""Explicitly-parallel ops that run inside a stage: context-parallel attention and MoE.

Both are pure functions of global-view arrays plus a mesh; they use ``jax.shard_map``
internally where GSPMD cannot express the communication (a K/V ring over ``"cp"``, token
all-to-all over ``"ep"``) and fall back to plain single-device maths when the relevant
mesh axis has size 1.
``models/`` imports what it uses from here (and ``hetjax.ops.context``).
"""

from hetjax.meshes.sequence import inverse_permutation as inverse_permutation
from hetjax.meshes.sequence import zigzag_permutation as zigzag_permutation
from hetjax.ops import context as context
from hetjax.ops.aux_loss import attach_aux_loss as attach_aux_loss
from hetjax.ops.aux_loss import load_balance_loss_per_sample as load_balance_loss_per_sample
from hetjax.ops.dense import dense as dense
from hetjax.ops.embedding import vocab_parallel_lookup as vocab_parallel_lookup
from hetjax.ops.moe import MoEFFN as MoEFFN
from hetjax.ops.moe import expert_capacity as expert_capacity
from hetjax.ops.moe import moe_ffn as moe_ffn
from hetjax.ops.moe import route as route
from hetjax.ops.ring_attention import causal_attention as causal_attention
from hetjax.ops.ring_attention import ring_attention as ring_attention
from hetjax.ops.token_routing import merge_modality_tokens as merge_modality_tokens
from hetjax.ops.token_routing import merge_routed as merge_routed
from hetjax.ops.token_routing import merge_whole_per_rank as merge_whole_per_rank

__all__ = [
    "MoEFFN",
    "attach_aux_loss",
    "causal_attention",
    "context",
    "dense",
    "expert_capacity",
    "inverse_permutation",
    "load_balance_loss_per_sample",
    "merge_modality_tokens",
    "merge_routed",
    "merge_whole_per_rank",
    "moe_ffn",
    "ring_attention",
    "route",
    "vocab_parallel_lookup",
    "zigzag_permutation",
]
