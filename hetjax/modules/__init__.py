"""Module adapters: Flax NNX modules as stage-sliceable pure functions."""

from .staged import Params as Params
from .staged import StagedModule as StagedModule

__all__ = ["Params", "StagedModule"]
