"""Measurement tools: what observers, benchmarks and tests measure a run with.

- :mod:`~hetjax.inspect.hlo` - the one parser of collectives in compiled HLO text
  (:func:`collectives`, :func:`replica_groups`, :func:`varied_axes`, ...);
- :mod:`~hetjax.inspect.compiles` - compile counting on ``jax.monitoring`` events
  (:class:`CompileCounter`, :func:`expect_compiles`);
- :mod:`~hetjax.inspect.memory` - live bytes per device and compiled peak bytes;
- :mod:`~hetjax.inspect.timers` - a wall-clock :class:`Timer` that keeps samples;
- :mod:`~hetjax.inspect.observers` - :class:`Recorder`, an executor observer keeping
  compiled programs, call counts and transfer bytes;
- :mod:`~hetjax.inspect.probes` - observers that measure one step from inside:
  :class:`LiveSampler` (stash bytes per stage) and :class:`AsyncTimer` (the measured
  bubble of an unprofiled step).

It reads programs, arrays and observer events only; it knows nothing of models,
experiments or the executor (which it must not import).
"""

from .compiles import BACKEND_COMPILE_EVENT as BACKEND_COMPILE_EVENT
from .compiles import CompileCounter as CompileCounter
from .compiles import expect_compiles as expect_compiles
from .hlo import KINDS as KINDS
from .hlo import Collective as Collective
from .hlo import bytes_by_kind as bytes_by_kind
from .hlo import collectives as collectives
from .hlo import dp_all_reduce_shapes as dp_all_reduce_shapes
from .hlo import replica_groups as replica_groups
from .hlo import varied_axes as varied_axes
from .memory import array_bytes_per_device as array_bytes_per_device
from .memory import live_arrays as live_arrays
from .memory import live_bytes_per_device as live_bytes_per_device
from .memory import peak_bytes as peak_bytes
from .observers import Recorder as Recorder
from .probes import AsyncTimer as AsyncTimer
from .probes import LiveSampler as LiveSampler
from .probes import wait_alive as wait_alive
from .timers import Timer as Timer

__all__ = [
    "BACKEND_COMPILE_EVENT",
    "KINDS",
    "AsyncTimer",
    "Collective",
    "CompileCounter",
    "LiveSampler",
    "Recorder",
    "Timer",
    "array_bytes_per_device",
    "bytes_by_kind",
    "collectives",
    "dp_all_reduce_shapes",
    "expect_compiles",
    "live_arrays",
    "live_bytes_per_device",
    "peak_bytes",
    "replica_groups",
    "varied_axes",
    "wait_alive",
]
