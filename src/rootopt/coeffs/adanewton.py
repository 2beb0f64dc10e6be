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
record (what, where from, certificate peak, the per-matrix selector) that reports show.

Per-matrix selection (:class:`GramSelector`): the first Newton–Schulz step computes
``A₀ = X₀X₀ᵀ`` of the Frobenius-normalised ``X₀`` anyway; ``s = ||A₀||_F² = Σσᵢ⁴``
bounds the largest singular value, ``σ_max ≤ s^{1/4} ≤ 1``. Dividing ``X₀`` by
``t = s^{1/4}`` lifts every singular value by ``1/t`` (×2–×6 on real matrices) while
keeping them in ``[0, 1]``, where the schedule is certified; it costs nothing because the
division folds into the first step's coefficients, ``(a/t, b/t³, c/t⁵)``. ``m·s`` (``m``
the short side) is ``≈ 1 + m/n`` for a Gaussian matrix and grows as ``m/r`` for a rank
``r`` signal. But ``s`` (like every positive moment ``Σσ²ᵏ``) is carried by the largest
singular values and cannot see how high the noise floor under a low-rank signal sits,
which decides between the two schedules. For float32/float64 iterations the selector
therefore counts the small singular values softly: with ``x = σ/t``,
``c = mean δ/(x² + δ) = (δ/m)·tr((A₀/t² + δI)⁻¹)`` (one Cholesky factorisation and one
triangular inverse of the ``m x m`` matrix, about ``⅔m³`` flops) is the fraction of
singular values below ``√δ``; above ``c_tau`` the "spiky" schedule (steep first slope)
is used, else the table's. Low-precision Gram matrices are too coarse for ``δ = 1e-6``,
so bfloat16/float16 keep the rule ``m·s > tau``. No host synchronisation: all of it is
``torch.where`` on ``(batch,)`` tensors. See ``docs/adanewton.md``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rootopt.coeffs.presets import MUON, POLAR_EXPRESS, YOU, Coeff, Schedule
from rootopt.coeffs.stability import DEFAULT_DELTA, UNIT_ROUNDOFF, StabilityReport, certify

log = logging.getLogger("rootopt.coeffs")

TABLE_FILE = "adanewton_table.json"
TABLE_FORMAT = "rootopt.adanewton_table/1"
SELECTOR_FILE = "adanewton_selector.json"
SELECTOR_FORMAT = "rootopt.adanewton_selector/1"
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


# ------------------------------------------------------------------------------ selector


@dataclass(frozen=True)
class SelectorData:
    """The shipped low-rank schedules (per iteration dtype) and the switch threshold."""

    spiky: dict[str, Schedule]
    tau: float  # switch when m * s > tau (dtypes without the soft count)
    steps: int
    provenance: dict[str, Any]
    soft_delta: float | None = None  # the soft count's δ; None: no soft count
    soft_tau: float = math.inf  # switch when c > soft_tau
    soft_dtypes: tuple[str, ...] = ()  # iteration dtypes that use the soft count


@lru_cache(maxsize=1)
def load_selector_data() -> SelectorData | None:
    """``data/adanewton_selector.json``, or None when it is absent (no per-matrix selection)."""
    try:
        text = resources.files("rootopt.coeffs").joinpath("data").joinpath(SELECTOR_FILE)
        raw = json.loads(text.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:
        raise CoefficientError(
            f"AdaNewton selector file {SELECTOR_FILE} is corrupt: {exc}"
        ) from None
    return parse_selector_data(raw)


def parse_selector_data(raw: Any) -> SelectorData:
    """The selector file's content, checked; :class:`CoefficientError` naming the file and
    the first problem when it is malformed."""
    try:
        if raw.get("format") != SELECTOR_FORMAT:
            raise ValueError(f"unknown format {raw.get('format')!r}")
        steps = int(raw["steps"])
        spiky = {str(dt): _parse_schedule(v, steps) for dt, v in dict(raw["spiky"]).items()}
        tau = float(raw["tau"])
        if not tau > 0:
            raise ValueError("tau must be positive")
        soft = raw.get("soft_count")
        delta: float | None = None
        c_tau = math.inf
        soft_dtypes: tuple[str, ...] = ()
        if soft is not None:
            delta, c_tau = float(soft["delta"]), float(soft["tau"])
            soft_dtypes = tuple(str(d) for d in soft["dtypes"])
            if not (0 < delta < 1 and 0 < c_tau < 1):
                raise ValueError("soft_count needs 0 < delta < 1 and 0 < tau < 1")
            unknown = [d for d in soft_dtypes if d not in UNIT_ROUNDOFF]
            if unknown:
                raise ValueError(f"soft_count names unknown dtypes {unknown}")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CoefficientError(
            f"AdaNewton selector file {SELECTOR_FILE} is corrupt: {exc}"
        ) from None
    return SelectorData(
        spiky, tau, steps, dict(raw.get("provenance", {})), delta, c_tau, soft_dtypes
    )


@dataclass(frozen=True)
class GramSelector:
    """Per-matrix coefficients from the first Gram matrix ``A₀ = X₀X₀ᵀ`` (``X₀``
    Frobenius-normalised, ``m x m`` with ``m`` the short side).

    ``selector(A)`` with ``A`` of shape ``(batch, m, m)`` returns a float32 tensor of
    shape ``(K, batch, 3)``: row ``k`` holds the ``(a, b, c)`` of step ``k`` for every
    matrix. Step 1 is meant for ``X₀`` and ``A₀``: ``X₁ = a X₀ + (b A₀ + c A₀²) X₀``.
    :meth:`statistics` reads ``s = ||A₀||_F² = Σσ⁴`` and, when ``soft_delta`` is set,
    the soft count ``c = mean δ/(x² + δ)`` of the singular values ``x = σ/√(√s)``
    below ``√δ``; :meth:`coefficients` maps them to the rows. A matrix gets ``spiky``
    when ``c > soft_tau`` (with the soft count) or ``short · s > tau`` (without), else
    ``flat``; either way the first tuple is rescaled by ``t = s^{1/4}·(1+margin)``
    (``(a/t, b/t³, c/t⁵)``), which equals running the schedule on ``X₀ / t`` whose
    singular values stay in ``[0, 1]`` because ``σ_max⁴ ≤ Σσ⁴ = s``. Both schedules are
    certified on ``[0, 1]`` for the iteration dtype, so the amplification bound holds
    whichever is picked. ``t`` is floored at ``t_min`` (a zero matrix gives ``s = 0``).
    """

    short: int
    flat: Schedule
    spiky: Schedule
    tau: float
    margin: float
    t_min: float = 1e-4
    soft_delta: float | None = None
    soft_tau: float = math.inf
    soft_probes: int = 64  # Hutchinson probes for the trace; 0: the exact trace
    _cache: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor]] = field(
        default_factory=dict, compare=False, repr=False
    )
    _probes: dict[tuple[int, torch.device, torch.dtype], Tensor] = field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def steps(self) -> int:
        return len(self.flat)

    def _tables(self, device: torch.device) -> tuple[Tensor, Tensor]:
        key = (device, torch.float32)
        hit = self._cache.get(key)
        if hit is None:
            hit = (
                torch.tensor(self.flat, dtype=torch.float32, device=device),
                torch.tensor(self.spiky, dtype=torch.float32, device=device),
            )
            self._cache[key] = hit
        return hit

    def statistics(self, A: Tensor) -> tuple[Tensor, Tensor | None]:
        """``(s, c)`` of a batch of Gram matrices ``A`` (``(batch, m, m)`` or ``(m, m)``);
        ``c`` is None without the soft count. A Gram matrix whose shifted form does not
        factor (it is numerically singular below ``-δ``) counts as ``c = inf``."""
        acc = torch.float64 if A.dtype == torch.float64 else torch.float32
        A = A.detach().to(acc)
        if A.ndim == 2:
            A = A[None]
        s = A.square().sum(dim=(-2, -1))
        if self.soft_delta is None:
            return s, None
        m = A.size(-1)
        t2 = s.clamp_min(0.0).sqrt().clamp_min(self.t_min**2)[:, None, None]
        B = A / t2  # a new tensor: the shift below does not touch the caller's A
        B.diagonal(dim1=-2, dim2=-1).add_(self.soft_delta)
        L, info = torch.linalg.cholesky_ex(B)
        if 0 < self.soft_probes < m:
            # tr(B⁻¹) = E ||L⁻¹ z||² over Rademacher z: k triangular solves instead of
            # the m³/3 of a full inverse. Fixed probes keep it deterministic and equal on
            # every rank; relative spread ≈ √(2/k) / √(number of small singular values).
            Z = self._probe_matrix(m, A.device, acc)
            W = torch.linalg.solve_triangular(L, Z.expand(L.size(0), -1, -1), upper=False)
            tr = W.square().sum(dim=(-2, -1)) / Z.size(-1)
        else:
            eye = torch.eye(m, dtype=acc, device=A.device).expand_as(L)
            tr = torch.linalg.solve_triangular(L, eye, upper=False).square().sum(dim=(-2, -1))
        c = tr * (self.soft_delta / m)
        return s, torch.where(info > 0, torch.full_like(c, math.inf), c)

    def _probe_matrix(self, m: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        key = (m, device, dtype)
        Z = self._probes.get(key)
        if Z is None:
            g = torch.Generator().manual_seed(20251125 + m)
            Z = torch.randint(0, 2, (m, self.soft_probes), generator=g).mul_(2).sub_(1)
            Z = Z.to(device=device, dtype=dtype)
            self._probes[key] = Z
        return Z

    def decide(self, s: Tensor, c: Tensor | None = None) -> Tensor:
        """The decision, per matrix (``(batch,)`` bool): the spiky schedule when the soft
        count ``c`` exceeds ``soft_tau`` (float32/float64), or ``m·s`` exceeds ``tau``
        (low precision). The one place a different (e.g. continuous) rule would go."""
        if self.soft_delta is not None:
            if c is None:
                raise ValueError("this selector needs the soft count c as well as s")
            return c.detach().to(torch.float32).reshape(-1) > self.soft_tau
        return s.detach().to(torch.float32).reshape(-1) * self.short > self.tau

    def coefficients(self, s: Tensor, c: Tensor | None = None) -> Tensor:
        """The ``(K, batch, 3)`` rows for statistics ``s`` (and ``c``), see the class."""
        s32 = s.detach().to(torch.float32).reshape(-1)
        flat, spiky = self._tables(s32.device)
        use_spiky = self.decide(s, c)[None, :, None]  # (1, batch, 1)
        coeffs = torch.where(use_spiky, spiky[:, None, :], flat[:, None, :])  # (K, batch, 3)
        t = s32.clamp_min(0.0).pow(0.25).mul(1.0 + self.margin).clamp_min(self.t_min)
        first = coeffs[0] * torch.stack((t.reciprocal(), t.pow(-3), t.pow(-5)), dim=-1)
        return torch.cat((first[None], coeffs[1:]), dim=0)

    def __call__(self, A: Tensor) -> Tensor:
        return self.coefficients(*self.statistics(A))

    def describe(self) -> str:
        if self.soft_delta is not None:
            return (
                f"gram-rescaled, spiky schedule when the soft count of singular values "
                f"below {math.sqrt(self.soft_delta):g}·s^(1/4) exceeds {self.soft_tau:g}"
            )
        return f"gram-rescaled, spiky schedule when {self.short}·s > {self.tau:g}"


def selector_margin(dtype: str) -> float:
    """Safety factor on ``t``: ``s`` is computed in the iteration dtype (float32 sums)."""
    return max(4.0 * UNIT_ROUNDOFF.get(dtype, 2.0**-8), 1e-4)


# ----------------------------------------------------------------------------- lookup


@dataclass(frozen=True)
class Resolution:
    """A resolved schedule for one ``(min dim, max dim, K, dtype)`` and where it came from."""

    key: Key
    schedule: Schedule
    source: str  # table | generalised | nearest | preset | fitted | user | <preset name>
    detail: str = ""
    peak: float = float("nan")  # certificate: max of the K-fold map on [0, 1]
    selector: GramSelector | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.key[0], self.key[1]

    def describe(self) -> str:
        m, n, k, dt = self.key
        sel = f"; per-matrix: {self.selector.describe()}" if self.selector is not None else ""
        det = f" ({self.detail})" if self.detail else ""
        return f"{m}x{n} K={k} {dt}: {self.source}{det}, peak {self.peak:.3f}{sel}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "steps": self.key[2],
            "dtype": self.key[3],
            "source": self.source,
            "detail": self.detail,
            "peak": self.peak,
            "schedule": [list(t) for t in self.schedule],
            "selector": None if self.selector is None else self.selector.describe(),
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
    res = _resolve(m, n, steps, dtype)
    sel = load_selector_data()
    spiky = None if sel is None or sel.steps != steps else sel.spiky.get(dtype)
    if sel is not None and spiky is not None:
        rep = _certificate(spiky, dtype)
        if not rep.stable:
            raise CoefficientError(
                f"AdaNewton selector schedule for {dtype} fails the certificate: {rep.reason}"
            )
        soft = dtype in sel.soft_dtypes
        selector = GramSelector(
            m,
            res.schedule,
            spiky,
            sel.tau,
            selector_margin(dtype),
            soft_delta=sel.soft_delta if soft else None,
            soft_tau=sel.soft_tau if soft else math.inf,
        )
        res = Resolution(res.key, res.schedule, res.source, res.detail, res.peak, selector)
    return res


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


def nearest_entry(rows: int, cols: int, steps: int, dtype: str = "float32") -> TableEntry | None:
    """The table entry closest in ``(log min dim, log aspect)`` with the same steps/dtype."""
    m, n = min(rows, cols), max(rows, cols)
    _, entries = load_table()
    cands = _candidates(entries, steps, dtype)
    if not cands:
        return None
    return min(cands, key=lambda e: _distance((m, n), (e.rows, e.cols)))


def clear_memory_caches() -> None:
    """Forget in-process lookups (the table is re-read, the log-once set emptied)."""
    _lookup_cached.cache_clear()
    _load_table.cache_clear()
    load_selector_data.cache_clear()
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
