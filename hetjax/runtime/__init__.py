"""Training runtime: the reference trainer, the optimiser, the host loop and its hooks."""

from .executor import Executor as Executor
from .executor import island_positions as island_positions
from .executor import parse_layouts as parse_layouts
from .graph import Link as Link
from .graph import ModuleSpec as ModuleSpec
from .graph import TrainGraph as TrainGraph
from .loop import Hook as Hook
from .loop import JsonlWriter as JsonlWriter
from .loop import ProgressBar as ProgressBar
from .loop import Summary as Summary
from .loop import run_training as run_training
from .optim import OptimizerConfig as OptimizerConfig
from .optim import decay_mask as decay_mask
from .optim import learning_rate_schedule as learning_rate_schedule
from .optim import make_optimizer as make_optimizer
from .programs import ParallelOptions as ParallelOptions
from .reference import ReferenceTrainer as ReferenceTrainer
from .reference import check_batch_split as check_batch_split
from .reference import split_microbatches as split_microbatches

__all__ = [
    "Executor",
    "Link",
    "ModuleSpec",
    "TrainGraph",
    "island_positions",
    "parse_layouts",
    "Hook",
    "JsonlWriter",
    "OptimizerConfig",
    "ParallelOptions",
    "ProgressBar",
    "ReferenceTrainer",
    "Summary",
    "check_batch_split",
    "decay_mask",
    "learning_rate_schedule",
    "make_optimizer",
    "run_training",
    "split_microbatches",
]
