"""hetjax: heterogeneous parallelism for multimodal LLM training in JAX.

Every module of a multimodal graph (encoders with their projectors, the LLM) gets its
own parallel layout and devices. The public API:

- :class:`StagedModule` - wrap a Flax NNX module as pre / stacked blocks / post.
- :class:`Layout` - a module's ``dp, tp, cp, pp, ep`` degrees (``Layout.parse("dp=2,tp=2")``).
- :class:`ModuleSpec`, :class:`Link`, :class:`TrainGraph` - the training graph.
- :func:`plan_run` / :class:`RunPlan` - a run's settings checked and planned, before any
  parameter exists.
- :class:`Executor` - trains a graph colocated (three-phase), non-colocated (graph-aware
  1F1B on disjoint islands) or as the homogeneous baseline.
- :class:`Trainer` (:mod:`hetjax.train`) - a config, a model and its data in; layouts
  checked once, the plan, the executor, checkpoints and resume, the step loop with hooks.
- :class:`ReferenceTrainer` - single-mesh data-parallel training, the numerical reference.
- :class:`AdamWConfig` / :func:`make_optimizer` - AdamW + warm-up/cosine + clipping;
  the executor takes any optax transformation (:func:`clip_by_global_norm` clips by the
  norm over all pipeline stages).
- :class:`TrainState`, :class:`StepMetrics`, :class:`Observer` - the state pytree, one
  step's metrics, the hooks for compiles, dispatches, transfers and steps.
- :func:`run_training` and hooks - the host loop, metrics file, progress bar, summary,
  TensorBoard scalars (:class:`TensorBoardWriter`), end-of-run plots
  (:class:`MetricsPlot`); ``hetjax.train.ProfileHook`` traces chosen steps with
  ``jax.profiler``.
- :func:`gpu_flags` / :func:`apply_gpu_flags` - suggested XLA:GPU flags (collective
  overlap), set before the backend starts.
"""

import importlib
from typing import TYPE_CHECKING

# The names above, each with the module that defines it, imported on first use (PEP 562):
# ``import hetjax.launch`` (the process supervisor) or ``hetjax.argtypes`` then costs no
# JAX import (0.8 s per process on a 2-core machine), while ``hetjax.Executor`` and
# ``from hetjax import Trainer`` work as before.
_EXPORTS = {
    "apply_gpu_flags": "hetjax.gpu",
    "gpu_flags": "hetjax.gpu",
    "Layout": "hetjax.meshes",
    "LayoutError": "hetjax.meshes",
    "Params": "hetjax.modules",
    "StagedModule": "hetjax.modules",
    "AdamWConfig": "hetjax.runtime",
    "Executor": "hetjax.runtime",
    "JsonlWriter": "hetjax.runtime",
    "Link": "hetjax.runtime",
    "MetricsPlot": "hetjax.runtime",
    "ModuleSpec": "hetjax.runtime",
    "Observer": "hetjax.runtime",
    "ParallelOptions": "hetjax.runtime",
    "ProgressBar": "hetjax.runtime",
    "ReferenceTrainer": "hetjax.runtime",
    "RunPlan": "hetjax.runtime",
    "StepMetrics": "hetjax.runtime",
    "Summary": "hetjax.runtime",
    "TensorBoardWriter": "hetjax.runtime",
    "TrainGraph": "hetjax.runtime",
    "TrainState": "hetjax.runtime",
    "clip_by_global_norm": "hetjax.runtime",
    "make_optimizer": "hetjax.runtime",
    "plan_run": "hetjax.runtime",
    "run_training": "hetjax.runtime",
    "Trainer": "hetjax.train",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:  # a subpackage: ``import hetjax`` then ``hetjax.runtime``
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:
    from hetjax.gpu import apply_gpu_flags as apply_gpu_flags
    from hetjax.gpu import gpu_flags as gpu_flags
    from hetjax.meshes import Layout as Layout
    from hetjax.meshes import LayoutError as LayoutError
    from hetjax.modules import Params as Params
    from hetjax.modules import StagedModule as StagedModule
    from hetjax.runtime import AdamWConfig as AdamWConfig
    from hetjax.runtime import Executor as Executor
    from hetjax.runtime import JsonlWriter as JsonlWriter
    from hetjax.runtime import Link as Link
    from hetjax.runtime import MetricsPlot as MetricsPlot
    from hetjax.runtime import ModuleSpec as ModuleSpec
    from hetjax.runtime import Observer as Observer
    from hetjax.runtime import ParallelOptions as ParallelOptions
    from hetjax.runtime import ProgressBar as ProgressBar
    from hetjax.runtime import ReferenceTrainer as ReferenceTrainer
    from hetjax.runtime import RunPlan as RunPlan
    from hetjax.runtime import StepMetrics as StepMetrics
    from hetjax.runtime import Summary as Summary
    from hetjax.runtime import TensorBoardWriter as TensorBoardWriter
    from hetjax.runtime import TrainGraph as TrainGraph
    from hetjax.runtime import TrainState as TrainState
    from hetjax.runtime import clip_by_global_norm as clip_by_global_norm
    from hetjax.runtime import make_optimizer as make_optimizer
    from hetjax.runtime import plan_run as plan_run
    from hetjax.runtime import run_training as run_training
    from hetjax.train import Trainer as Trainer

__version__ = "0.1.0"

__all__ = list(_EXPORTS)  # the names of the module docstring's API
