"""What every section of :mod:`experiments.gpu_check` shares: timing, the matmul
ceiling, MFU/HFU rows, the time budget, guarded sections."""

from __future__ import annotations

import sys
import time
import traceback
from typing import Any


class Run:
    """One call's shared state: sizes, devices, the peak and the measured ceiling, the
    time budget (rows past it are skipped, so one GPU call ends in time) and what the
    sections share (one LLaVA trainer for ``llava_step``, ``profile`` and
    ``executor_vs_fused``)."""

    def __init__(self, sizes: Any, devices: list, peak: float | None, budget_s: float):
        self.sizes, self.devices, self.peak = sizes, devices, peak
        self.deadline = time.perf_counter() + budget_s
        self.ceiling_tflops: float | None = None
        self.shared: dict[str, Any] = {}
        self.stage_rows: dict[tuple, dict] = {}  # (model, policy, batch) -> module -> row

    def left_s(self) -> float:
        return self.deadline - time.perf_counter()

    def over(self) -> dict | None:
        """``{"skipped": ...}`` once the budget is spent, else None."""
        return {"skipped": "time budget spent"} if self.left_s() <= 0 else None

    def rates(self, model_flops: float, hardware_flops: float | None, seconds: float) -> dict:
        """TFLOP/s, MFU, HFU and the share of the measured matmul ceiling of a timed
        program doing ``model_flops`` (the anchors' count) and ``hardware_flops`` (the
        compiled program's matmuls and fused attention kernels)."""
        tflops = model_flops / 1e12 / seconds
        hw = None if hardware_flops is None else hardware_flops / 1e12 / seconds
        peak, ceiling = self.peak, self.ceiling_tflops
        return {
            "time_s": seconds,
            "model_tflops": model_flops / 1e12,
            "hardware_tflops": None if hardware_flops is None else hardware_flops / 1e12,
            "tflops_per_s": tflops,
            "mfu": tflops / peak if peak else None,
            "hfu": hw / peak if peak and hw is not None else None,
            "of_ceiling": tflops / ceiling if ceiling else None,
        }


def timed(step: Any, args: tuple, reps: int, *, chain: bool = False) -> tuple[Any, float]:
    """(the first result of ``step(*args)``, the median wall time of ``reps`` more calls,
    each waited for). ``chain``: each call takes the previous call's first result as its
    first argument (a step that donates and returns its parameters)."""
    import jax

    from hetjax.inspect import Timer

    first = jax.block_until_ready(step(*args))
    timer = Timer()
    out = first
    for _ in range(reps):
        if chain:
            args = (out[0], *args[1:])
        with timer:
            out = jax.block_until_ready(step(*args))
    return first, timer.median


def guarded(fn, *args, **kwargs) -> Any:
    """``fn(...)``, or ``{"error": ...}`` if it raises (so later rows and sections run)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # out of memory, an XLA error: report it, keep going
        traceback.print_exc(file=sys.stderr)
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}


def peak_bytes(compiled: Any) -> int | None:
    """Device bytes a compiled program needs (arguments, outputs, temporaries; aliased
    donated outputs counted once), from XLA's memory analysis."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )


def random_tree(abstract: Any, key: Any, dtype: Any = None) -> Any:
    """Random normal arrays (scale 0.02) shaped like ``abstract``, made on the device in
    one program (a 7B-wide stack initialised layer by layer on the host would take
    minutes)."""
    import jax

    leaves, treedef = jax.tree.flatten(abstract)

    def make(key):
        keys = jax.random.split(key, len(leaves))
        return [
            0.02 * jax.random.normal(k, a.shape, dtype or a.dtype)
            for k, a in zip(keys, leaves, strict=True)
        ]

    return jax.tree.unflatten(treedef, jax.jit(make)(key))
