"""Stability of Newton–Schulz schedules, judged on the scalar map of singular values.

After Frobenius normalisation every singular value ``x`` of the iterate lies in
``[0, 1]``; each step maps it through ``p(x) = a x + b x³ + c x⁵``. A schedule is stable
when its K-fold composition stays inside ``[0, 1 + delta]`` on a dense grid of
``[0, 1]`` and — for a repeated tuple — no local maximum of ``p`` lies above ``p``'s
largest fixed point (otherwise more iterations diverge: the paper's 2048x2048 entry).
All arithmetic is float64 so the verdict does not depend on the iteration dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rootopt.coeffs.presets import Coeff

DEFAULT_DELTA = 0.25


def apply_schedule(schedule: Sequence[Coeff], x: np.ndarray) -> np.ndarray:
    """Composition of the scalar maps of ``schedule`` applied to ``x`` (float64)."""
    y = np.asarray(x, dtype=np.float64).copy()
    for a, b, c in schedule:
        y2 = y * y
        y = y * (a + y2 * (b + c * y2))
    return y


def critical_points(coeff: Coeff) -> list[float]:
    """Positive real x where p'(x) = a + 3 b x² + 5 c x⁴ = 0."""
    a, b, c = coeff
    roots = np.roots([5 * c, 3 * b, a]) if c != 0 else np.roots([3 * b, a])
    xs = []
    for r in roots:
        if abs(r.imag) < 1e-12 and r.real > 0:
            xs.append(float(np.sqrt(r.real)))
    return sorted(xs)


def upper_fixed_point(coeff: Coeff) -> float:
    """Largest positive x with p(x) = x (inf if p(x) > x for every large x)."""
    a, b, c = coeff
    roots = np.roots([c, b, a - 1]) if c != 0 else np.roots([b, a - 1])
    xs = [float(np.sqrt(r.real)) for r in roots if abs(r.imag) < 1e-12 and r.real > 0]
    return max(xs) if xs else float("inf")


@dataclass(frozen=True)
class StabilityReport:
    stable: bool
    peak: float  # max of the K-fold composition on [0, 1]
    minimum: float  # min of the composition on [0, 1]
    reason: str


def check_stability(
    schedule: Sequence[Coeff],
    *,
    delta: float = DEFAULT_DELTA,
    grid: int = 20001,
) -> StabilityReport:
    """Check ``schedule`` (one tuple per iteration) against the stability constraints."""
    x = np.linspace(0.0, 1.0, grid)
    y = apply_schedule(schedule, x)
    peak, lo = float(y.max()), float(y.min())
    if not np.all(np.isfinite(y)):
        return StabilityReport(False, float("inf"), lo, "composition is not finite")
    if peak > 1 + delta:
        return StabilityReport(False, peak, lo, f"peak {peak:.4f} exceeds 1 + delta = {1 + delta}")
    if lo < 0:
        return StabilityReport(False, peak, lo, f"composition goes negative ({lo:.4g})")
    distinct = set(schedule)
    if len(distinct) == 1:
        (coeff,) = distinct
        a, b, c = coeff
        fp = upper_fixed_point(coeff)
        for xc in critical_points(coeff):
            pc = a * xc + b * xc**3 + c * xc**5
            # A local max (p'' < 0) above the upper fixed point escapes under iteration.
            second = 6 * b * xc + 20 * c * xc**3
            if second < 0 and pc > fp:
                return StabilityReport(
                    False,
                    peak,
                    lo,
                    f"local max {pc:.4f} at x={xc:.3f} exceeds upper fixed point {fp:.4f}",
                )
    return StabilityReport(True, peak, lo, "ok")
