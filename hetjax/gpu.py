"""Suggested XLA:GPU flags for training: overlap communication with compute.

XLA reads ``XLA_FLAGS`` once, when the first backend starts, so these must be set
before anything touches a JAX device. :func:`apply_gpu_flags` merges them into
``XLA_FLAGS`` (a flag the user already set keeps the user's value) and refuses once a
backend runs. On CPU the flags are accepted and ignored.

Every flag is one of those XLA documents as part of its GPU optimisation level O1
(https://openxla.org/xla/gpu_optimization_levels, defined in
``xla/debug_options_flags.cc``); XLA aborts the process on an unknown flag, and the test
checks that this jaxlib knows them all. What they do:

- ``xla_gpu_enable_latency_hiding_scheduler``: schedules asynchronous collectives early
  and their ``-done`` late, so compute runs between them (the main overlap switch; the
  TP all-reduces / reduce-scatters of a stage, the ring attention's K/V permutes).
- ``xla_gpu_enable_pipelined_all_gather``, ``..._reduce_scatter``, ``..._all_reduce``:
  moves the collective of loop iteration ``i + 1`` into iteration ``i`` of a ``while``
  loop (our scanned layers), so it overlaps the current layer's compute.
- ``xla_gpu_enable_while_loop_double_buffering``: unrolls ``while`` loops by two, which
  removes the loop barrier between a layer's compute and the next layer's collectives.

Pipelining and double buffering grow the HLO and the compile time (XLA's reason for
leaving them off by default); the per-stage programs here are small, so that is cheap.

``recipe="maxtext"`` adds what MaxText's GPU recipes set on top (its Llama-2-7B A3 scripts,
``src/maxtext/configs/gpu/a3/llama_2_7b/*.sh``, and its single-host GPU guide): cuBLAS for
every gemm instead of Triton's (``xla_gpu_enable_triton_gemm=false``), no CUDA graphs
(``xla_gpu_enable_command_buffer=``), collectives on the highest-priority stream, larger
collective combine thresholds without combining by dimension, and XLA's
rematerialisation pass off. (Its ``xla_gpu_pipeline_*=on`` are the newer names of the
``xla_gpu_enable_pipelined_*`` flags above; jaxlib 0.10 does not know them.)
``experiments.gpu_check`` measures both recipes and none; O1 stays the default until a
GPU run shows the other faster.
"""

from __future__ import annotations

import os
from typing import Literal

GPU_FLAGS: dict[str, str] = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
    "xla_gpu_enable_while_loop_double_buffering": "true",
}


MAXTEXT_FLAGS: dict[str, str] = {
    "xla_gpu_enable_triton_gemm": "false",
    "xla_gpu_enable_command_buffer": "",
    "xla_gpu_enable_highest_priority_async_stream": "true",
    "xla_gpu_all_reduce_combine_threshold_bytes": "134217728",
    "xla_gpu_all_gather_combine_threshold_bytes": "134217728",
    "xla_gpu_reduce_scatter_combine_threshold_bytes": "67108864",
    "xla_gpu_enable_all_gather_combine_by_dim": "false",
    "xla_gpu_enable_reduce_scatter_combine_by_dim": "false",
    "xla_disable_hlo_passes": "rematerialization",
}
Recipe = Literal["o1", "maxtext"]
RECIPES: dict[str, dict[str, str]] = {"o1": GPU_FLAGS, "maxtext": {**GPU_FLAGS, **MAXTEXT_FLAGS}}


def gpu_flags(recipe: Recipe = "o1") -> list[str]:
    """The suggested flags of ``recipe``, each as ``--name=value`` (see the module
    docstring)."""
    return [f"--{name}={value}" for name, value in RECIPES[recipe].items()]


def _flag_name(flag: str) -> str:
    return flag.lstrip("-").split("=", 1)[0]


def merge_flags(existing: str, flags: list[str]) -> str:
    """``existing`` (an ``XLA_FLAGS`` value) plus those of ``flags`` it does not set yet;
    a flag already present keeps its value, whatever it is."""
    have = {_flag_name(f) for f in existing.split()}
    added = [f for f in flags if _flag_name(f) not in have]
    return " ".join([*existing.split(), *added])


def _backend_started() -> bool:
    # No public API says whether a backend exists; xla_bridge is where JAX keeps them.
    from jax._src import xla_bridge

    started = getattr(xla_bridge, "backends_are_initialized", None)
    return started() if started is not None else bool(getattr(xla_bridge, "_backends", {}))


def apply_gpu_flags(recipe: Recipe = "o1") -> str:
    """Adds :func:`gpu_flags` of ``recipe`` to ``XLA_FLAGS``; call before JAX starts a
    backend.

    Returns:
        The new ``XLA_FLAGS``.

    Raises:
        RuntimeError: a JAX backend is already running (XLA has read its flags); call
            this at the top of the program, before ``jax.devices()`` or any array.

    Example:
        >>> import hetjax.gpu  # doctest: +SKIP
        >>> hetjax.gpu.apply_gpu_flags()  # then import models, build meshes, train
    """
    if _backend_started():
        raise RuntimeError(
            "apply_gpu_flags: a JAX backend is already running, so XLA has read XLA_FLAGS; "
            "call hetjax.gpu.apply_gpu_flags() before jax.devices() or any array, or set "
            f"XLA_FLAGS='{' '.join(gpu_flags())}' in the environment"
        )
    os.environ["XLA_FLAGS"] = merge_flags(os.environ.get("XLA_FLAGS", ""), gpu_flags(recipe))
    return os.environ["XLA_FLAGS"]
