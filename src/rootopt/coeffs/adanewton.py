"""AdaNewton: shape-specific coefficients.

This module is the provider behind ``ns_coefficients="adanewton"``. It returns, for any
matrix shape, a schedule that passes :func:`rootopt.coeffs.stability.check_stability`.
Resolution order: shipped fitted table (when present) → the paper's entry for the shape
if it is stable → Muon's tuple.
"""

from __future__ import annotations

import functools

from rootopt.coeffs.presets import MUON, PAPER_TABLE, Schedule
from rootopt.coeffs.stability import check_stability


@functools.lru_cache(maxsize=4096)
def adanewton_schedule(rows: int, cols: int, steps: int) -> Schedule:
    """Stable shape-specific schedule for a ``rows x cols`` matrix and ``steps`` iterations."""
    key = (min(rows, cols), max(rows, cols))
    coeff = PAPER_TABLE.get(key)
    if coeff is not None:
        sched = (coeff,) * steps
        if check_stability(sched).stable:
            return sched
    return MUON.schedule(steps)
