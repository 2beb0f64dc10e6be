"""AdaNewton: shape-specific Newton–Schulz coefficients for any matrix shape, never fitted
at run time.

This module is the runtime behind ``ns_coefficients="adanewton"``. It reads the shipped
table (``data/adanewton_table.json``, fitted offline by ``rootopt coeffs build-table``;
every entry carries its provenance), certifies what it hands out
(:func:`rootopt.coeffs.stability.certify`) and never fits, never reads a user cache and
never writes a file. A resolution is a pure function of ``(min dim, max dim, K, dtype)``
and the table, so every rank of a distributed job resolves the same schedule. Shapes are
keyed by ``(min dim, max dim)``: the iteration runs on the wide orientation, so a tall
matrix and its transpose share an entry.

Resolution order for ``(m, n, K, dtype)``:

1. ``table``: an entry for exactly that key (certified for ``dtype``).
2. ``generalised``: the entries of the same ``K`` (and dtype, else float32) nearest in
   ``(log m, log n/m)`` — the ``NEIGHBOURS`` closest — blended coefficient-wise with
   inverse-distance weights when they are close to each other (same warm-start
   family: every coefficient within ``BLEND_SPREAD`` relative), certified for ``dtype``.
3. ``nearest``: when the blend is not possible or fails the certificate, the nearest
   entry that passes it.
4. ``K`` without entries: more steps than the table's ``K`` append classic quintic
   steps (15/8, −10/8, 3/8; they converge on ``[0, 1 + δ]``) to the generalised ``K``
   schedule; fewer steps use Muon's tuple (stable for any ``K``). Either way certified.

Every resolution is logged once per key on ``logging.getLogger("rootopt.coeffs")``: at
INFO when tabled, at WARNING otherwise. :func:`lookup` returns a :class:`Resolution`
record (what, where from, certificate peak) that reports show. Every matrix of a shape
gets the same schedule: the per-matrix selector that once switched schedules on
statistics of ``X₀X₀ᵀ`` was removed (it helped on no task of the defaults study; see
``docs/adanewton.md``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from rootopt.coeffs.presets import MUON, POLAR_EXPRESS, YOU, Coeff, Schedule
from rootopt.coeffs.stability import DEFAULT_DELTA, UNIT_ROUNDOFF, StabilityReport, certify

log = logging.getLogger("rootopt.coeffs")

TABLE_FILE = "adanewton_table.json"
TABLE_FORMAT = "rootopt.adanewton_table/1"
# A user table (built with ``rootopt coeffs build-table --out FILE``) replaces the shipped
# one when this variable names it; read at construction, like the shipped table.
TABLE_ENV = "ROOTOPT_ADANEWTON_TABLE"

# Intermediate iterates are bounded by this (the fitter's prefix bound).
PREFIX_BOUND = 2.0
NEIGHBOURS = 3
BLEND_SPREAD = 0.35
# Classic quintic Newton–Schulz: converges to 1 on (0, sqrt(7/3)); used to extend a
# schedule beyond the table's K.
QUINTIC_TAIL: Coeff = (15 / 8, -10 / 8, 3 / 8)

Key = tuple[int, int, int, str]


class CoefficientError(ValueError):
    """Coefficients cannot be resolved or fail the certificate (raised at construction)."""


# ------------------------------------------------------------------------------ table


@dataclass(frozen=True)
class TableEntry:
    rows: int  # min dim
    cols: int  # max dim
    steps: int
    dtype: str
    schedule: Schedule
    kind: str
    raw: dict[str, Any]


def _parse_schedule(raw: object, steps: int) -> Schedule:
    if not isinstance(raw, list) or len(raw) != steps:
        raise ValueError(f"schedule must list {steps} tuples")
    out: list[Coeff] = []
    for t in raw:
        if not isinstance(t, list) or len(t) != 3:
            raise ValueError("each tuple must be [a, b, c]")
        a, b, c = (float(v) for v in t)
        if not all(math.isfinite(v) for v in (a, b, c)):
            raise ValueError("non-finite coefficient")
        out.append((a, b, c))
    return tuple(out)


def table_source() -> str:
    """Where the table is read from: ``$ROOTOPT_ADANEWTON_TABLE`` or the shipped file."""
    return os.environ.get(TABLE_ENV) or f"rootopt/coeffs/data/{TABLE_FILE}"


def _read_table_text() -> str:
    env = os.environ.get(TABLE_ENV)
    if env:
        return Path(env).read_text(encoding="utf-8")
    return resources.files("rootopt.coeffs").joinpath("data").joinpath(TABLE_FILE).read_text()


@lru_cache(maxsize=4)
def _load_table(source: str) -> tuple[dict[str, Any], dict[Key, TableEntry]]:
    where = source
    try:
        raw = json.loads(_read_table_text())
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        if raw.get("format") != TABLE_FORMAT:
            raise ValueError(f"unknown format {raw.get('format')!r} (expected {TABLE_FORMAT!r})")
        entries: dict[Key, TableEntry] = {}
        for i, e in enumerate(raw["entries"]):
            try:
                m, n = int(e["shape"][0]), int(e["shape"][1])
                k, dt = int(e["steps"]), str(e["dtype"])
                if not 1 <= m <= n or k < 1 or dt not in UNIT_ROUNDOFF:
                    raise ValueError(f"bad key {m}x{n} K={k} {dt}")
                entries[(m, n, k, dt)] = TableEntry(
                    m, n, k, dt, _parse_schedule(e["schedule"], k), str(e.get("kind", "")), e
                )
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                raise ValueError(f"entry {i}: {exc}") from None
    except FileNotFoundError as exc:
        raise CoefficientError(f"AdaNewton table {where}: file not found ({exc})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CoefficientError(f"AdaNewton table {where} is corrupt: {exc}") from None
    except ValueError as exc:
        raise CoefficientError(f"AdaNewton table {where} is corrupt: {exc}") from None
    header = {k: v for k, v in raw.items() if k != "entries"}
    return header, entries


def load_table() -> tuple[dict[str, Any], dict[Key, TableEntry]]:
    """The table: ``(header, entries by (min, max, steps, dtype))``.

    Raises :class:`CoefficientError` naming the file and the reason when it is corrupt.
    """
    return _load_table(table_source())


# ----------------------------------------------------------------------------- lookup


@dataclass(frozen=True)
class Resolution:
    """A resolved schedule for one ``(min dim, max dim, K, dtype)`` and where it came from."""

    key: Key
    schedule: Schedule
    source: str  # table | generalised | nearest | preset | fitted | user | <preset name>
    detail: str = ""
    peak: float = float("nan")  # certificate: max of the K-fold map on [0, 1]

    @property
    def shape(self) -> tuple[int, int]:
        return self.key[0], self.key[1]

    def describe(self) -> str:
        m, n, k, dt = self.key
        det = f" ({self.detail})" if self.detail else ""
        return f"{m}x{n} K={k} {dt}: {self.source}{det}, peak {self.peak:.3f}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "steps": self.key[2],
            "dtype": self.key[3],
            "source": self.source,
            "detail": self.detail,
            "peak": self.peak,
            "schedule": [list(t) for t in self.schedule],
        }


_lock = threading.Lock()
_logged: set[tuple[Key, str]] = set()


def log_once(res: Resolution) -> None:
    """Log a resolution once per key and source (WARNING unless it came from the table)."""
    tag = (res.key, res.source)
    with _lock:
        if tag in _logged:
            return
        _logged.add(tag)
    level = logging.INFO if res.source in ("table", "fitted", "cache") else logging.WARNING
    log.log(level, "adanewton %s", res.describe())


@lru_cache(maxsize=8192)
def _certificate(schedule: Schedule, dtype: str) -> StabilityReport:
    return certify(schedule, dtype=dtype, delta=DEFAULT_DELTA, prefix_bound=PREFIX_BOUND)


def _distance(a: tuple[int, int], b: tuple[int, int]) -> float:
    return math.hypot(math.log(a[0] / b[0]), math.log((a[1] / a[0]) / (b[1] / b[0])))


def _candidates(entries: dict[Key, TableEntry], steps: int, dtype: str) -> list[TableEntry]:
    same = [e for (m, n, k, dt), e in sorted(entries.items()) if k == steps and dt == dtype]
    if same:
        return same
    return [e for (m, n, k, dt), e in sorted(entries.items()) if k == steps and dt == "float32"]


def _blend(near: list[tuple[float, TableEntry]]) -> Schedule | None:
    """Inverse-distance blend of neighbouring schedules, or None when they differ too much."""
    scheds = [e.schedule for _, e in near]
    K = len(scheds[0])
    for k in range(K):
        for j in range(3):
            vals = [s[k][j] for s in scheds]
            scale = max(abs(v) for v in vals)
            if scale > 0 and (max(vals) - min(vals)) / scale > BLEND_SPREAD:
                return None
    w = [1.0 / max(d, 1e-12) for d, _ in near]
    tot = sum(w)
    out: list[Coeff] = []
    for k in range(K):
        a, b, c = (
            float(f"{sum(wi * s[k][j] for wi, s in zip(w, scheds)) / tot:.10g}") for j in range(3)
        )
        out.append((a, b, c))
    return tuple(out)


def _generalise(m: int, n: int, steps: int, dtype: str) -> tuple[Schedule, str, str, float]:
    """(schedule, source, detail, peak) for a key the table does not hold."""
    _, entries = load_table()
    cands = _candidates(entries, steps, dtype)
    if not cands:
        raise LookupError
    ranked = sorted(((_distance((m, n), (e.rows, e.cols)), e) for e in cands), key=lambda t: t[0])
    near = ranked[:NEIGHBOURS]
    from_dt = near[0][1].dtype
    via = "" if from_dt == dtype else f"; {from_dt} entries certified for {dtype}"
    if near[0][0] < 1e-12:  # same shape, other dtype
        e = near[0][1]
        rep = _certificate(e.schedule, dtype)
        if rep.stable:
            return e.schedule, "generalised", f"table entry {e.rows}x{e.cols}{via}", rep.peak
    blended = _blend(near)
    if blended is not None:
        rep = _certificate(blended, dtype)
        if rep.stable:
            names = ", ".join(f"{e.rows}x{e.cols}" for _, e in near)
            return blended, "generalised", f"blend of {names}{via}", rep.peak
    for _, e in ranked:
        rep = _certificate(e.schedule, dtype)
        if rep.stable:
            return e.schedule, "nearest", f"table entry {e.rows}x{e.cols}{via}", rep.peak
    raise LookupError


def _resolve(m: int, n: int, steps: int, dtype: str) -> Resolution:
    key = (m, n, steps, dtype)
    _, entries = load_table()
    entry = entries.get(key)
    if entry is not None:
        rep = _certificate(entry.schedule, dtype)
        if not rep.stable:
            raise CoefficientError(
                f"AdaNewton table entry {m}x{n} K={steps} {dtype} fails the certificate: "
                f"{rep.reason}"
            )
        return Resolution(key, entry.schedule, "table", entry.kind, rep.peak)
    try:
        sched, source, detail, peak = _generalise(m, n, steps, dtype)
        return Resolution(key, sched, source, detail, peak)
    except LookupError:
        pass
    if any(k == steps for (_, _, k, _) in entries):
        # Entries for this K exist but none passes the certificate for this dtype (the
        # float32 fits whose first step maps 1 near the prefix bound do not survive
        # bfloat16 rounding): the published schedules that do, best first.
        for preset in (YOU, POLAR_EXPRESS, MUON):
            sched = preset.schedule(steps)
            rep = _certificate(sched, dtype)
            if rep.stable:
                detail = f"{preset.name}: no table entry passes the {dtype} certificate"
                return Resolution(key, sched, "preset", detail, rep.peak)
    ks = sorted({k for (_, _, k, _) in entries})
    longer = [k for k in ks if k < steps]
    if longer:
        k0 = max(longer)
        base = _resolve(m, n, k0, dtype)
        sched = base.schedule + (QUINTIC_TAIL,) * (steps - k0)
        rep = _certificate(sched, dtype)
        if rep.stable:
            detail = f"K={k0} {base.source} schedule + {steps - k0} quintic steps"
            return Resolution(key, sched, "generalised", detail, rep.peak)
    sched = MUON.schedule(steps)
    rep = _certificate(sched, dtype)
    if not rep.stable:  # pragma: no cover - Muon's tuple is stable for any K
        raise CoefficientError(f"no certified schedule for {m}x{n} K={steps} {dtype}")
    return Resolution(key, sched, "preset", f"muon: the table has no K={steps} entries", rep.peak)


@lru_cache(maxsize=8192)
def _lookup_cached(m: int, n: int, steps: int, dtype: str, source: str) -> Resolution:
    return _resolve(m, n, steps, dtype)


def lookup(rows: int, cols: int, steps: int = 5, *, dtype: str = "float32") -> Resolution:
    """Resolve the AdaNewton schedule for a ``rows x cols`` matrix (see the module doc).

    Pure: never fits, never writes, same answer on every process for the same table.
    Raises :class:`CoefficientError` naming the shape and the reason when nothing
    certified can be given (a corrupt table, an unknown dtype).
    """
    if isinstance(rows, bool) or isinstance(cols, bool) or rows < 1 or cols < 1:
        raise CoefficientError(f"adanewton: matrix shape must be positive, got {rows}x{cols}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise CoefficientError(
            f"adanewton {rows}x{cols}: steps must be an integer >= 1, got {steps!r}"
        )
    if dtype not in UNIT_ROUNDOFF:
        raise CoefficientError(
            f"adanewton {rows}x{cols}: unknown iteration dtype {dtype!r} "
            f"(choose one of {sorted(UNIT_ROUNDOFF)})"
        )
    m, n = min(rows, cols), max(rows, cols)
    res = _lookup_cached(m, n, steps, dtype, table_source())
    log_once(res)
    return res


def adanewton_schedule(rows: int, cols: int, steps: int, dtype: str = "float32") -> Schedule:
    """Certified shape-specific schedule for a ``rows x cols`` matrix and ``steps`` iterations."""
    return lookup(rows, cols, steps, dtype=dtype).schedule


def clear_memory_caches() -> None:
    """Forget in-process lookups (the table is re-read, the log-once set emptied)."""
    _lookup_cached.cache_clear()
    _load_table.cache_clear()
    with _lock:
        _logged.clear()


def certify_user_schedule(
    schedule: Sequence[Coeff], rows: int, cols: int, dtype: str, what: str
) -> StabilityReport:
    """Certify a schedule the user gave; raise :class:`CoefficientError` naming the shape."""
    rep = _certificate(tuple(tuple(float(v) for v in t) for t in schedule), dtype)  # type: ignore[arg-type]
    if not rep.stable:
        m, n = min(rows, cols), max(rows, cols)
        raise CoefficientError(
            f"ns_coefficients={what} for a {rows}x{cols} matrix (K={len(schedule)}, {dtype}) "
            f"fails the stability certificate: {rep.reason}"
            + (" (it is unstable for this shape)" if m == n else "")
        )
    return rep
