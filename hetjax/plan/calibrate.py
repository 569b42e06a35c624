"""Fit a profile's matmul efficiency curve to measured program times.

The cost model prices a matmul of smallest per-device width ``w`` at ``R w / (w + k)``
FLOP/s (:meth:`HardwareProfile.matmul_tflops`, ``R = peak x matmul_efficiency``). Then
``t w / F = w / R + k / R`` is linear in ``w``: a least-squares line through measured
``(w, t w / F)`` points gives ``R`` (1 / slope) and ``k`` (intercept / slope).
``experiments.calibrate`` measures the points on this machine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .hardware import HardwareProfile


@dataclasses.dataclass(frozen=True)
class Fit:
    """The fitted curve and how well it explains the points."""

    tflops: float  # R: achieved TFLOP/s of a wide matmul (peak x efficiency)
    knee: float  # k: width at which half of R is reached
    max_rel_error: float  # the worst point's |predicted / measured time - 1|

    def apply(self, hw: HardwareProfile) -> HardwareProfile:
        """``hw`` with this curve (the peak kept, the efficiency and knee fitted)."""
        return dataclasses.replace(
            hw, matmul_efficiency=self.tflops / hw.peak_tflops, matmul_knee=self.knee
        )


def fit_matmul(samples: Sequence[tuple[float, float, float]]) -> Fit:
    """Fits ``R`` and ``k`` to ``(width, flops, seconds)`` samples (per device).

    Raises:
        ValueError: fewer than two distinct widths, or a fit without a positive rate.
    """
    w, f, t = (np.asarray(x, dtype=float) for x in zip(*samples, strict=True))
    if len(set(w.tolist())) < 2:
        raise ValueError("calibration needs matmuls of at least two different widths")
    slope, intercept = np.polyfit(w, t * w / f, 1)
    if slope <= 0:
        raise ValueError("calibration: time does not fall with width; measure wider matmuls")
    rate, knee = 1.0 / slope, max(intercept / slope, 0.0)
    predicted = f * (w + knee) / (rate * w)
    return Fit(rate / 1e12, knee, float(np.max(np.abs(predicted / t - 1))))
