"""Paired statistics for benchmark claims: mean difference and its 95 % confidence interval.

Every optimizer in a comparison trains on the same seeds (same initialisation and batches), so
the per-seed differences are paired; the interval is Student's t on those differences.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def t_quantile(df: int, level: float = 0.95) -> float:
    """Two-sided Student-t critical value for ``df`` degrees of freedom."""
    from scipy.stats import t

    return float(t.ppf(0.5 + level / 2, df))


@dataclass(frozen=True)
class Interval:
    """``mean`` with a ``level`` confidence interval ``[lo, hi]`` over ``n`` values."""

    mean: float
    lo: float
    hi: float
    n: int
    sd: float

    @property
    def excludes_zero(self) -> bool:
        return self.lo > 0 or self.hi < 0

    def as_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "lo": self.lo, "hi": self.hi, "n": self.n, "sd": self.sd}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Interval:
        return Interval(d["mean"], d["lo"], d["hi"], d["n"], d["sd"])


def mean_ci(xs: Sequence[float], level: float = 0.95) -> Interval:
    """Mean and t-interval of ``xs``; every value must be finite and there must be ≥ 2."""
    if len(xs) < 2:
        raise ValueError(f"an interval needs at least 2 values; got {len(xs)}")
    if not all(math.isfinite(x) for x in xs):
        raise ValueError(f"non-finite value among {list(xs)}")
    m = statistics.fmean(xs)
    sd = statistics.stdev(xs)
    half = t_quantile(len(xs) - 1, level) * sd / math.sqrt(len(xs))
    return Interval(m, m - half, m + half, len(xs), sd)


def paired_ci(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Interval:
    """Interval of the mean of ``a[i] - b[i]`` (the same seed ``i`` on both sides)."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    return mean_ci([x - y for x, y in zip(a, b, strict=True)], level)


def paired_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided p-value of the paired t test of ``a`` against ``b`` (mean difference 0)."""
    from scipy.stats import ttest_rel

    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    d = [x - y for x, y in zip(a, b, strict=True)]
    if len(d) < 2 or not all(math.isfinite(x) for x in d):
        raise ValueError(f"a paired test needs at least 2 finite differences; got {d}")
    if statistics.pstdev(d) == 0.0:  # no spread: p is 0 unless the difference is 0
        return 1.0 if d[0] == 0 else 0.0
    return float(ttest_rel(a, b).pvalue)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (Holm 1979, Scand. J. Statist. 6:65-70), in the
    order given: sorted ascending, the i-th smallest (from 0) is multiplied by ``m - i``, made
    non-decreasing, capped at 1. A hypothesis is rejected at level a when its adjusted p <= a;
    this controls the family-wise error rate at a for any dependence between the tests."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted
