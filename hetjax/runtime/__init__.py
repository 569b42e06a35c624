"""Training runtime: the executor, its plan and state, the reference trainer, the
optimiser, observers and the host loop."""

from .executor import Executor as Executor
from .graph import Link as Link
from .graph import ModuleSpec as ModuleSpec
from .graph import TrainGraph as TrainGraph
from .graph import frozen_parts as frozen_parts
from .loop import Hook as Hook
from .loop import JsonlWriter as JsonlWriter
from .loop import NonFiniteError as NonFiniteError
from .loop import NonFiniteGuard as NonFiniteGuard
from .loop import ProgressBar as ProgressBar
from .loop import Summary as Summary
from .loop import run_training as run_training
from .lowering import Op as Op
from .observers import Dispatch as Dispatch
from .observers import Observer as Observer
from .observers import Stash as Stash
from .observers import Transfer as Transfer
from .optim import AdamWConfig as AdamWConfig
from .optim import clip_by_global_norm as clip_by_global_norm
from .optim import decay_mask as decay_mask
from .optim import learning_rate_schedule as learning_rate_schedule
from .optim import make_optimizer as make_optimizer
from .plan import RunPlan as RunPlan
from .plan import check_batch as check_batch
from .plan import homogeneous_graph as homogeneous_graph
from .plan import plan_run as plan_run
from .plots import MetricsPlot as MetricsPlot
from .programs import ParallelOptions as ParallelOptions
from .reduce import StepMetrics as StepMetrics
from .reference import ReferenceTrainer as ReferenceTrainer
from .reference import check_batch_split as check_batch_split
from .reference import split_microbatches as split_microbatches
from .state import TrainState as TrainState
from .state import full_params as full_params
from .state import slice_stage as slice_stage
from .tensorboard import TensorBoardWriter as TensorBoardWriter

__all__ = [
    "Dispatch",
    "Executor",
    "Hook",
    "JsonlWriter",
    "Link",
    "MetricsPlot",
    "ModuleSpec",
    "NonFiniteError",
    "NonFiniteGuard",
    "Observer",
    "Op",
    "AdamWConfig",
    "ParallelOptions",
    "ProgressBar",
    "ReferenceTrainer",
    "RunPlan",
    "Stash",
    "StepMetrics",
    "Summary",
    "TensorBoardWriter",
    "TrainGraph",
    "TrainState",
    "Transfer",
    "check_batch",
    "check_batch_split",
    "clip_by_global_norm",
    "decay_mask",
    "full_params",
    "frozen_parts",
    "homogeneous_graph",
    "learning_rate_schedule",
    "make_optimizer",
    "plan_run",
    "run_training",
    "slice_stage",
    "split_microbatches",
]
