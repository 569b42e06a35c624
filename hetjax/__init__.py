"""hetjax: heterogeneous parallelism for multimodal LLM training in JAX.

Every module of a multimodal graph (encoders, projectors, LLM) gets its own parallel
layout and devices. This package exposes the pieces a trainer is built from:

- :class:`StagedModule` - wrap a Flax NNX module as pre / stacked blocks / post.
- :class:`ReferenceTrainer` - single-mesh data-parallel training, the numerical reference.
- :func:`make_optimizer` / :class:`OptimizerConfig` - AdamW + warm-up/cosine + clipping.
- :func:`run_training` and hooks - the host loop, metrics file, progress bar, summary.
"""

from hetjax.modules import Params as Params
from hetjax.modules import StagedModule as StagedModule
from hetjax.runtime import JsonlWriter as JsonlWriter
from hetjax.runtime import OptimizerConfig as OptimizerConfig
from hetjax.runtime import ProgressBar as ProgressBar
from hetjax.runtime import ReferenceTrainer as ReferenceTrainer
from hetjax.runtime import Summary as Summary
from hetjax.runtime import make_optimizer as make_optimizer
from hetjax.runtime import run_training as run_training

__version__ = "0.1.0"

__all__ = [
    "JsonlWriter",
    "OptimizerConfig",
    "Params",
    "ProgressBar",
    "ReferenceTrainer",
    "StagedModule",
    "Summary",
    "make_optimizer",
    "run_training",
]
