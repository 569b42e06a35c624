"""The typed training configuration: a frozen dataclass tree, its files and its checks.

:class:`TrainConfig` holds every setting of a run in sections (``model``, ``data``,
``parallel``, ``optimizer``, ``checkpoint``, ``distributed``, ``logging``); it checks
itself when built. :func:`load` / :func:`dump` read and write it as YAML (or JSON), and
:func:`from_dict` / :func:`to_dict` convert it to plain data. Front ends (the CLI, a
notebook) build one resolved config and pass it down; nothing below re-parses settings.
This package imports neither ``models`` nor ``experiments``.
"""

from .fields import InvalidConfigError as InvalidConfigError
from .fields import Leaf as Leaf
from .io import dump as dump
from .io import flatten as flatten
from .io import from_dict as from_dict
from .io import load as load
from .io import module_layouts as module_layouts
from .io import parse_module_items as parse_module_items
from .io import parse_weighted as parse_weighted
from .io import read as read
from .io import to_dict as to_dict
from .tree import CheckpointConfig as CheckpointConfig
from .tree import DataConfig as DataConfig
from .tree import DistributedConfig as DistributedConfig
from .tree import LoggingConfig as LoggingConfig
from .tree import ModelConfig as ModelConfig
from .tree import OptimizerConfig as OptimizerConfig
from .tree import ParallelConfig as ParallelConfig
from .tree import TrainConfig as TrainConfig
from .tree import leaves as leaves

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "DistributedConfig",
    "InvalidConfigError",
    "Leaf",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "TrainConfig",
    "dump",
    "flatten",
    "from_dict",
    "leaves",
    "load",
    "module_layouts",
    "parse_module_items",
    "parse_weighted",
    "read",
    "to_dict",
]
