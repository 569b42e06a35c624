"""Optimiser: AdamW with linear warm-up + cosine decay and global-norm clipping.

:class:`AdamWConfig` is the convenience that builds it; the executor and the
reference trainer take any optax transformation. The one cross-stage piece, global-norm
clipping, is :func:`clip_by_global_norm`, fed the norm over all stages.

Weight decay follows Megatron: matrices decay, biases and norm scales do not. Which
leaves are matrices is decided from logical axis names (ignoring the stacked
``"layers"`` axis), not from ``ndim``, because stacking blocks adds a dimension.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class AdamWConfig:
    """AdamW hyper-parameters and the learning-rate schedule."""

    lr: float = 3e-3  # peak learning rate
    total_steps: int = 100  # schedule length (cosine reaches end_lr_ratio * lr here)
    warmup_steps: int = 10  # linear warm-up from 0 to lr
    end_lr_ratio: float = 0.1  # final learning rate as a fraction of the peak
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0  # global gradient-norm clipping threshold (<= 0 disables)

    def __post_init__(self):
        if self.total_steps < 1 or self.warmup_steps < 0:
            raise ValueError(
                f"schedule needs total_steps >= 1 and warmup_steps >= 0, got "
                f"{self.total_steps} and {self.warmup_steps}"
            )
        if self.lr <= 0:
            raise ValueError(f"learning rate must be positive, got lr={self.lr}; use e.g. lr=0.003")


def learning_rate_schedule(cfg: AdamWConfig) -> optax.Schedule:
    warmup = min(cfg.warmup_steps, cfg.total_steps - 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=warmup,
        decay_steps=max(cfg.total_steps, warmup + 1),
        end_value=cfg.lr * cfg.end_lr_ratio,
    )


def decay_mask(logical_axes: Any) -> Any:
    """True for leaves with at least two non-``layers`` axes (matrices)."""
    return jax.tree.map(
        lambda names: sum(n != "layers" for n in names) >= 2,
        logical_axes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """``optax.clip_by_global_norm`` whose norm can be given from outside.

    The executor updates every pipeline stage separately, so no stage sees all the
    gradients; it passes the norm over ALL stages as the ``global_norm`` extra argument
    (``optax.chain`` forwards it). Without one (the reference trainer, which holds the
    whole tree) the norm is computed from ``updates``, exactly as optax does. Put it
    first in a chain given to :class:`hetjax.Executor` instead of optax's own, which
    would clip every stage by its own norm.

    Example:
        >>> tx = optax.chain(clip_by_global_norm(1.0), optax.sgd(1e-2, momentum=0.9))
    """

    def init(params):
        del params
        return optax.EmptyState()

    def update(updates, state, params=None, *, global_norm=None, **extra_args):
        del params, extra_args
        norm = tree_norm(updates) if global_norm is None else global_norm
        clipped = jax.tree.map(
            lambda g: jnp.where(norm < max_norm, g, (g / norm.astype(g.dtype)) * max_norm),
            updates,
        )
        return clipped, state

    return optax.GradientTransformationExtraArgs(init, update)


def tree_norm(tree: Any) -> jax.Array:
    """The L2 norm of all leaves, as optax computes it (``optax.tree.norm`` when present)."""
    tree_utils = getattr(optax, "tree", None)
    return tree_utils.norm(tree) if hasattr(tree_utils, "norm") else optax.global_norm(tree)


def make_optimizer(
    cfg: AdamWConfig, *, logical_axes: Any | None = None
) -> optax.GradientTransformation:
    """AdamW (+ clipping); decays every leaf when ``logical_axes`` is not given."""
    parts = [clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm > 0 else []
    parts.append(
        optax.adamw(
            learning_rate_schedule(cfg),
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=None if logical_axes is None else decay_mask(logical_axes),
        )
    )
    return optax.chain(*parts)
