"""The library trainer: a config and a model in, a planned, checkpointed training run out.

- :class:`Trainer` - layouts parsed and checked once, graph (freeze, recompute),
  :func:`~hetjax.plan_run`, the executor, resume, the step loop with hooks.
- :class:`TrainableModel`, :class:`BatchSource` - what a model and its data provide.
- :class:`LayoutChoice`, :func:`resolve_layouts`, :func:`default_layouts` - layouts as
  objects (a planner's choices included).
- :class:`Hook` and the stock hooks :class:`Every`, :class:`CheckpointHook`, :class:`ProfileHook`,
  :class:`TimelineHook`; :func:`logging_hooks`, :func:`check_outputs` for
  ``config.logging``.
"""

from .hooks import CheckpointHook as CheckpointHook
from .hooks import Every as Every
from .hooks import Hook as Hook
from .hooks import ProfileHook as ProfileHook
from .hooks import TimelineHook as TimelineHook
from .layouts import LayoutChoice as LayoutChoice
from .layouts import default_layouts as default_layouts
from .layouts import resolve_layouts as resolve_layouts
from .outputs import check_outputs as check_outputs
from .outputs import logging_hooks as logging_hooks
from .protocols import BatchSource as BatchSource
from .protocols import TrainableModel as TrainableModel
from .trainer import Trainer as Trainer

__all__ = [
    "BatchSource",
    "CheckpointHook",
    "Every",
    "Hook",
    "LayoutChoice",
    "ProfileHook",
    "TimelineHook",
    "TrainableModel",
    "Trainer",
    "check_outputs",
    "default_layouts",
    "logging_hooks",
    "resolve_layouts",
]
