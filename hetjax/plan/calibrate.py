"""Fit a profile's constants to measured program times.

The cost model prices a matmul of smallest per-device width ``w`` at ``R w / (w + k)``
FLOP/s (:meth:`HardwareProfile.matmul_tflops`, ``R = peak x matmul_efficiency``):
:func:`fit_matmul` fits ``R`` and ``k`` (and a fixed cost per call, which the time model
charges as ``dispatch_us``). Element-wise programs and collectives are lines, a fixed
cost plus bytes over a rate (:func:`fit_line`). Where only whole programs were timed (a
GPU's stage rows), :func:`fit_efficiencies` fits the two efficiencies that make the cost
model itself price them as measured. ``experiments.calibrate`` measures the points and
writes the profile files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

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

    A program call also has a fixed cost (the executor's is priced per call, as
    ``dispatch_us``), so the fit is ``t = c + F / R + F k / (R w)``: least squares over
    ``(1, F, F / w)``; with fewer than three widths, the line of the module doc (no ``c``).
    Where the points give a negative knee (no width runs slower than the wide ones but
    for the fixed cost), the knee is 0 and ``c`` and ``R`` are fitted again without it.

    Raises:
        ValueError: fewer than two distinct widths, or a fit without a positive rate.
    """
    w, f, t = (np.asarray(x, dtype=float) for x in zip(*samples, strict=True))
    if len(set(w.tolist())) < 2:
        raise ValueError("calibration needs matmuls of at least two different widths")
    if len(set(w.tolist())) >= 3:
        a = np.stack([np.ones_like(f), f, f / w], 1) / t[:, None]  # relative error
        (fixed, slope, intercept), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
        if intercept < 0:  # no knee: the fixed cost and the rate alone
            (fixed, slope), *_ = np.linalg.lstsq(a[:, :2], np.ones_like(t), rcond=None)
            intercept = 0.0
        fixed = max(float(fixed), 0.0)
    else:
        slope, intercept = np.polyfit(w, t * w / f, 1)
        fixed = 0.0
    if slope <= 0:
        raise ValueError("calibration: time does not fall with width; measure wider matmuls")
    rate, knee = 1.0 / slope, max(intercept / slope, 0.0)
    predicted = fixed + f * (w + knee) / (rate * w)
    return Fit(rate / 1e12, knee, float(np.max(np.abs(predicted / t - 1))))


@dataclasses.dataclass(frozen=True)
class Line:
    """``seconds = fixed + size / rate``: a fixed cost per call and a rate per unit."""

    fixed: float  # seconds per call
    rate: float  # units (bytes) per second
    max_rel_error: float  # the worst point's |predicted / measured - 1|


def fit_line(samples: Sequence[tuple[float, float]]) -> Line:
    """Fits ``fixed`` and ``rate`` to ``(size, seconds)`` samples (element-wise programs,
    collectives) by least squares on the relative error (the sizes span decades: on
    absolute seconds the largest would set the line alone and the fixed cost, which
    is what small buffers pay, would be noise); a negative intercept is clipped to 0.

    Raises:
        ValueError: fewer than two distinct sizes, or time that does not grow with size.
    """
    x, t = (np.asarray(v, dtype=float) for v in zip(*samples, strict=True))
    if len(set(x.tolist())) < 2:
        raise ValueError("calibration needs at least two different sizes")
    (slope, intercept), *_ = np.linalg.lstsq(np.stack([x / t, 1 / t], 1), np.ones_like(t))
    if slope <= 0:
        raise ValueError("calibration: time does not grow with size; measure larger buffers")
    fixed = max(float(intercept), 0.0)
    predicted = fixed + x * slope
    return Line(fixed, 1.0 / slope, float(np.max(np.abs(predicted / t - 1))))


def fit_efficiencies(
    hw: HardwareProfile, measured: Sequence[tuple[float, Callable[[HardwareProfile], float]]]
) -> tuple[HardwareProfile, list[float]]:
    """``hw`` with ``matmul_efficiency`` and ``memory_efficiency`` fitted so that the cost
    model prices each measured program as timed.

    A price is ``X / matmul_efficiency + Y / memory_efficiency + Z`` (compute, bytes, the
    rest); evaluating ``price`` with one rate made infinite separates the three, and a
    least-squares solve over the programs gives the two efficiencies (with two programs,
    exactly). The fused attention rate and the knee are kept.

    Args:
        hw: The profile to fit (its peak, bandwidth and knee are kept).
        measured: ``(seconds, price)`` per timed program, ``price(profile) -> seconds``.

    Returns:
        The fitted profile and each program's ``predicted / measured - 1``.

    Raises:
        ValueError: fewer than two programs, or a fit without positive efficiencies.
    """
    if len(measured) < 2:
        raise ValueError("fitting two efficiencies needs at least two timed programs")
    inf = 1e30
    unit = dataclasses.replace(hw, matmul_efficiency=1.0, memory_efficiency=1.0)
    no_mem = dataclasses.replace(unit, memory_efficiency=inf)
    no_flops = dataclasses.replace(unit, matmul_efficiency=inf)
    no_both = dataclasses.replace(no_mem, matmul_efficiency=inf)
    rows, rhs = [], []
    for seconds, price in measured:
        z = price(no_both)
        rows.append([price(no_mem) - z, price(no_flops) - z])
        rhs.append(seconds - z)
    inv, *_ = np.linalg.lstsq(np.asarray(rows), np.asarray(rhs), rcond=None)
    if min(inv) <= 0:
        raise ValueError(f"calibration: the programs give no positive efficiencies ({inv})")
    fitted = dataclasses.replace(
        hw, matmul_efficiency=float(1 / inv[0]), memory_efficiency=float(1 / inv[1])
    )
    return fitted, [price(fitted) / seconds - 1 for seconds, price in measured]
