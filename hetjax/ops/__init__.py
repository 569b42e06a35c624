"""Explicitly-parallel ops that run inside a stage: context-parallel attention and MoE.

Both are pure functions of global-view arrays plus a mesh; they use ``jax.shard_map``
internally where GSPMD cannot express the communication (a K/V ring over ``"cp"``, token
all-to-all over ``"ep"``) and fall back to plain single-device maths when the relevant
mesh axis has size 1.
"""

from hetjax.ops.moe import MoEFFN as MoEFFN
from hetjax.ops.moe import expert_capacity as expert_capacity
from hetjax.ops.moe import moe_ffn as moe_ffn
from hetjax.ops.moe import route as route
from hetjax.ops.ring_attention import causal_attention as causal_attention
from hetjax.ops.ring_attention import inverse_permutation as inverse_permutation
from hetjax.ops.ring_attention import ring_attention as ring_attention
from hetjax.ops.ring_attention import zigzag_permutation as zigzag_permutation

__all__ = [
    "MoEFFN",
    "causal_attention",
    "expert_capacity",
    "inverse_permutation",
    "moe_ffn",
    "ring_attention",
    "route",
    "zigzag_permutation",
]
