"""hetjax: heterogeneous parallelism for multimodal LLM training in JAX.

Every module of a multimodal graph (encoders with their projectors, the LLM) gets its
own parallel layout and devices. The public API:

- :class:`StagedModule` - wrap a Flax NNX module as pre / stacked blocks / post.
- :class:`Layout` - a module's ``dp, tp, cp, pp, ep`` degrees (``Layout.parse("dp=2,tp=2")``).
- :class:`ModuleSpec`, :class:`Link`, :class:`TrainGraph` - the training graph.
- :class:`Executor` - trains a graph colocated (three-phase), non-colocated (graph-aware
  1F1B on disjoint islands) or as the homogeneous baseline.
- :class:`ReferenceTrainer` - single-mesh data-parallel training, the numerical reference.
- :class:`OptimizerConfig` / :func:`make_optimizer` - AdamW + warm-up/cosine + clipping.
- :func:`run_training` and hooks - the host loop, metrics file, progress bar, summary.
"""

from hetjax.meshes import Layout as Layout
from hetjax.meshes import LayoutError as LayoutError
from hetjax.modules import Params as Params
from hetjax.modules import StagedModule as StagedModule
from hetjax.runtime import Executor as Executor
from hetjax.runtime import JsonlWriter as JsonlWriter
from hetjax.runtime import Link as Link
from hetjax.runtime import ModuleSpec as ModuleSpec
from hetjax.runtime import OptimizerConfig as OptimizerConfig
from hetjax.runtime import ParallelOptions as ParallelOptions
from hetjax.runtime import ProgressBar as ProgressBar
from hetjax.runtime import ReferenceTrainer as ReferenceTrainer
from hetjax.runtime import Summary as Summary
from hetjax.runtime import TrainGraph as TrainGraph
from hetjax.runtime import make_optimizer as make_optimizer
from hetjax.runtime import run_training as run_training

__version__ = "0.1.0"

__all__ = [
    "Executor",
    "JsonlWriter",
    "Layout",
    "LayoutError",
    "Link",
    "ModuleSpec",
    "OptimizerConfig",
    "ParallelOptions",
    "Params",
    "ProgressBar",
    "ReferenceTrainer",
    "StagedModule",
    "Summary",
    "TrainGraph",
    "make_optimizer",
    "run_training",
]
