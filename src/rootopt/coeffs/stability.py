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


def verify_schedule(
    schedule: Sequence[Coeff],
    *,
    delta: float = DEFAULT_DELTA,
    prefix_bound: float | None = None,
    grid: int = 20001,
) -> StabilityReport:
    """:func:`check_stability` plus a refined search for the extrema, and (optionally) a
    bound on every partial composition.

    The uniform grid can step over a narrow peak of a steep composition (slopes of
    thousands near 0), so the extrema are also searched on a geometric grid of
    ``[1e-8, 1]`` and refined around every grid-local maximum near the bound (and minimum
    near 0) by a fine local grid. With ``prefix_bound`` each partial composition
    ``p_k ∘ … ∘ p_1`` (k < K) must also stay in ``[0, prefix_bound]``: every intermediate
    iterate is then bounded too (Polar Express and CANS overshoot to ≈1.99 after their
    first step by design).
    """
    base = check_stability(schedule, delta=delta, grid=grid)
    if not base.stable:
        return base
    x = np.unique(np.concatenate([np.linspace(0.0, 1.0, grid), np.geomspace(1e-8, 1.0, grid)]))
    K = len(schedule)
    which = range(K) if prefix_bound is not None else [K - 1]
    peak, lo = base.peak, base.minimum
    t = np.linspace(0.0, 1.0, 201)
    for k in which:
        y = apply_schedule(schedule[: k + 1], x)
        bound = 1 + delta if k == K - 1 else float(prefix_bound or 0.0)
        # Grid-local maxima near the bound and minima near 0: refine each on a 201-point
        # grid between its neighbours (one vectorised evaluation).
        mid, left, right = y[1:-1], y[:-2], y[2:]
        near = ((mid >= left) & (mid >= right) & (mid > bound - 0.1)) | (
            (mid <= left) & (mid <= right) & (mid < 0.05)
        )
        idx = np.flatnonzero(near) + 1
        allv = y
        if idx.size:
            xf = x[idx - 1, None] + (x[idx + 1] - x[idx - 1])[:, None] * t[None, :]
            allv = np.concatenate([y, apply_schedule(schedule[: k + 1], xf).ravel()])
        if not np.all(np.isfinite(allv)):
            return StabilityReport(
                False, float("inf"), lo, f"partial composition {k + 1} is not finite"
            )
        pk, mk = float(allv.max()), float(allv.min())
        if k == K - 1:
            peak, lo = max(peak, pk), min(lo, mk)
        if pk > bound:
            return StabilityReport(
                False,
                max(peak, pk),
                lo,
                f"composition of {k + 1} steps peaks at {pk:.4f} > {bound:.4g}",
            )
        if mk < 0:
            return StabilityReport(
                False, peak, min(lo, mk), f"composition of {k + 1} steps goes negative ({mk:.4g})"
            )
    return StabilityReport(True, peak, lo, "ok")
