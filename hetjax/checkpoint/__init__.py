"""Checkpoints in a logical (layout-free) format with orbax; restore into any layout.

- :class:`Checkpointer` - asynchronous saves of a run, the ``keep`` most recent kept.
- :func:`save` / :func:`restore` - one-shot helpers for a loop of your own.
- :class:`CheckpointError` - a directory or checkpoint that cannot be used.
"""

from .manager import Checkpointer as Checkpointer
from .manager import CheckpointError as CheckpointError
from .manager import restore as restore
from .manager import save as save

__all__ = ["CheckpointError", "Checkpointer", "restore", "save"]
