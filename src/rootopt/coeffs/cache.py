"""Resolved coefficients per matrix shape, kept for the life of an optimizer.

:class:`rootopt.ROOT` and :class:`rootopt.distributed.DistributedROOT` resolve (and certify) the
schedule of every matrix shape when a parameter group is added, never in ``step()``; this is
where the results live. A resolution is a pure function of its key, so every rank of a
distributed job holds the same entries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rootopt.coeffs import CoefficientSpec, canonical, resolve_record
from rootopt.coeffs.adanewton import Resolution
from rootopt.coeffs.presets import Schedule

# (rows, cols, steps, dtype) -> Resolution: how an optimizer fits a shape the table lacks
# (``ns_fit=True``); ``None`` uses the table and its certified generalisation only.
Fitter = Callable[[int, int, int, str], Resolution]


class CoefficientCache:
    """``(spec, min dim, max dim, K, dtype, fitted) -> Resolution``.

    ``get`` resolves on a miss (pure lookup; with ``fitter``, that callable instead, for
    ``"adanewton"`` and its alias only) and remembers the answer; ``records()`` lists
    what was resolved.
    Callable specs are keyed by identity: the same function object, the same schedules.
    """

    def __init__(self) -> None:
        self._res: dict[tuple[Any, ...], Resolution] = {}

    @staticmethod
    def key(
        spec: CoefficientSpec, rows: int, cols: int, steps: int, dtype: str, fitted: bool
    ) -> tuple[Any, ...]:
        spec_key = id(spec) if callable(spec) else repr(spec)
        return (spec_key, min(rows, cols), max(rows, cols), steps, dtype, fitted)

    def get(
        self,
        spec: CoefficientSpec,
        rows: int,
        cols: int,
        steps: int,
        dtype: str,
        *,
        fitter: Fitter | None = None,
    ) -> Resolution:
        fitted = fitter is not None and canonical(spec) == "adanewton"
        key = self.key(spec, rows, cols, steps, dtype, fitted)
        res = self._res.get(key)
        if res is None:
            if fitted:
                assert fitter is not None
                res = fitter(rows, cols, steps, dtype)
            else:
                res = resolve_record(spec, rows, cols, steps, dtype=dtype)
            self._res[key] = res
        return res

    def schedule(
        self,
        spec: CoefficientSpec,
        rows: int,
        cols: int,
        steps: int,
        dtype: str,
        *,
        fitted: bool = False,
    ) -> Schedule:
        """The schedule for one shape, as resolved when the group was added. A key missing
        here (options changed after construction) gets the same pure lookup, which never
        fits or writes."""
        res = self._res.get(
            self.key(spec, rows, cols, steps, dtype, fitted and canonical(spec) == "adanewton")
        )
        if res is None:
            res = self.get(spec, rows, cols, steps, dtype)
        return res.schedule

    def records(self) -> list[Resolution]:
        return list(self._res.values())

    def __len__(self) -> int:
        return len(self._res)
