"""Stability of Newton–Schulz schedules, judged on the scalar map of singular values.

After Frobenius normalisation every singular value ``x`` of the iterate lies in
``[0, 1]``; each step maps it through ``p(x) = a x + b x³ + c x⁵``. A schedule is stable
when its K-fold composition stays inside ``[0, 1 + delta]`` on a dense grid of
``[0, 1]`` and — for a repeated tuple — no local maximum of ``p`` lies above ``p``'s
largest fixed point (otherwise more iterations diverge: the paper's 2048x2048 entry).
All arithmetic is float64 so the verdict does not depend on the iteration dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

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


@lru_cache(maxsize=4)
def _grid(points: int) -> np.ndarray:
    g = np.unique(np.concatenate([np.linspace(0.0, 1.0, points), np.geomspace(1e-8, 1.0, points)]))
    g.setflags(write=False)
    return g


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
    x = _grid(grid)
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


# Unit roundoff of the iteration dtypes (float32's is far below any error that matters).
UNIT_ROUNDOFF: dict[str, float] = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
}


def certify(
    schedule: Sequence[Coeff],
    *,
    dtype: str = "float32",
    delta: float = DEFAULT_DELTA,
    prefix_bound: float | None = 2.0,
    grid: int = 4001,
) -> StabilityReport:
    """The runtime certificate of a schedule for an iteration ``dtype``.

    :func:`verify_schedule` in exact arithmetic, then the same bounds under the rounding
    of ``dtype``: every step's input is perturbed by a relative ``±u`` (``u`` the unit
    roundoff, 2⁻⁸ for bfloat16) and the envelope of the two perturbed images is carried
    to the next step; the final envelope must stay in ``[0, 1 + delta]`` (intermediate
    iterates were bounded in exact arithmetic; a rounding excess there is harmless in any
    floating format, an excess of the final map is not). To first order in ``u`` this bounds what the
    low-precision iteration can do to any singular value in ``[0, 1]``. The grid is
    coarser than the offline checker's (4001 linear + 4001 geometric points) because
    every grid-local maximum near a bound is refined on a 201-point local grid; tested
    to agree with ``verify_schedule(grid=20001)`` on every shipped entry.
    """
    if dtype not in UNIT_ROUNDOFF:
        return StabilityReport(False, float("nan"), float("nan"), f"unknown dtype {dtype!r}")
    if len(schedule) == 0:
        return StabilityReport(False, float("nan"), float("nan"), "empty schedule")
    flat = [v for t in schedule for v in t]
    if not all(np.isfinite(flat)):
        return StabilityReport(False, float("nan"), float("nan"), "non-finite coefficient")
    base = verify_schedule(schedule, delta=delta, prefix_bound=prefix_bound, grid=grid)
    u = UNIT_ROUNDOFF[dtype]
    if not base.stable or u < 2.0**-20:
        return base
    x = _grid(grid)
    lo, hi = x.copy(), x.copy()
    for t in schedule:
        cands = [apply_schedule([t], v * f) for v in (lo, hi) for f in (1 - u, 1 + u)]
        lo, hi = np.minimum.reduce(cands), np.maximum.reduce(cands)
    peak, low = float(hi.max()), float(lo.min())
    if not (math.isfinite(peak) and math.isfinite(low)):
        return StabilityReport(False, float("inf"), low, f"with {dtype} rounding, not finite")
    if peak > 1 + delta:
        return StabilityReport(
            False,
            peak,
            low,
            f"with {dtype} rounding, the composition reaches {peak:.4f} > {1 + delta}",
        )
    if low < 0:
        return StabilityReport(
            False, peak, low, f"with {dtype} rounding, the composition goes negative ({low:.3g})"
        )
    return StabilityReport(True, max(base.peak, peak), base.minimum, "ok")
