"""AdaNewton: shape-specific Newton–Schulz coefficients for any matrix shape.

This module is the provider behind ``ns_coefficients="adanewton"``. For a
``rows x cols`` matrix and ``steps`` iterations it returns a schedule (one ``(a, b, c)``
per iteration) that passes :func:`rootopt.coeffs.stability.verify_schedule`. Shapes are
keyed by ``(min dim, max dim)``: the iteration runs on the wide orientation, so a tall
matrix and its transpose share an entry. Resolution order:

1. the shipped table (``data/adanewton_table.json``, fitted offline by
   ``rootopt coeffs build-table``; every entry carries its provenance);
2. if fitting at run time is allowed (the default): the on-disk cache entry for the
   shape, else a fit (:mod:`rootopt.coeffs.fit`, a few seconds) written atomically to
   the cache. A cache entry that does not parse, does not match its key or fails the
   stability check is refitted, never trusted;
3. with fitting disabled (``ROOTOPT_ADANEWTON_FIT=0`` or :data:`FIT_AT_RUNTIME` =
   ``False``): the nearest table entry with the same ``steps`` and dtype by
   ``(log min dim, log aspect ratio)``; Muon's tuple when the table has none.

Which source served a shape is logged once per shape on ``logging.getLogger("rootopt.coeffs")``.
Importing this module is cheap (json + the table); the fitter is imported only to fit.

Cache directory: ``$ROOTOPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/rootopt``, else
``~/.cache/rootopt``; entries live under ``adanewton/v<fitter version>/``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from rootopt._atomic import atomic_write
from rootopt.coeffs.presets import MUON, Coeff, Schedule
from rootopt.coeffs.stability import DEFAULT_DELTA, verify_schedule

log = logging.getLogger("rootopt.coeffs")

TABLE_FILE = "adanewton_table.json"
TABLE_FORMAT = "rootopt.adanewton_table/1"
CACHE_FORMAT = "rootopt.adanewton_cache/1"

# Module-level switch for run-time fitting (the environment variable wins when set).
FIT_AT_RUNTIME = True
# Intermediate iterates are bounded by this (see FitConfig.prefix_bound).
PREFIX_BOUND = 2.0

# Budget of a run-time fit: seconds, not minutes (the shipped table uses a larger one).
RUNTIME_FIT: dict[str, Any] = {"per_family": 6, "max_dim": 128, "max_iter": 60}

_lock = threading.Lock()
_logged: set[tuple[int, int, int, str]] = set()


@dataclass(frozen=True)
class Lookup:
    """A resolved schedule and where it came from."""

    schedule: Schedule
    source: str  # "table" | "cache" | "fit" | "nearest" | "muon"
    key: tuple[int, int, int, str]
    detail: str = ""


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


@lru_cache(maxsize=1)
def load_table() -> tuple[dict[str, Any], dict[tuple[int, int, int, str], TableEntry]]:
    """The shipped table: ``(header, entries by (min, max, steps, dtype))``; empty if absent."""
    try:
        text = resources.files("rootopt.coeffs").joinpath("data", TABLE_FILE).read_text()
    except (FileNotFoundError, OSError):
        return {}, {}
    raw = json.loads(text)
    if raw.get("format") != TABLE_FORMAT:
        raise ValueError(f"{TABLE_FILE}: unknown format {raw.get('format')!r}")
    entries: dict[tuple[int, int, int, str], TableEntry] = {}
    for e in raw["entries"]:
        m, n = int(e["shape"][0]), int(e["shape"][1])
        k, dt = int(e["steps"]), str(e["dtype"])
        entries[(m, n, k, dt)] = TableEntry(
            m, n, k, dt, _parse_schedule(e["schedule"], k), str(e["kind"]), e
        )
    header = {k: v for k, v in raw.items() if k != "entries"}
    return header, entries


# ------------------------------------------------------------------------------ cache


def cache_dir() -> Path:
    """``$ROOTOPT_CACHE_DIR`` or ``$XDG_CACHE_HOME/rootopt`` or ``~/.cache/rootopt``."""
    env = os.environ.get("ROOTOPT_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg) / "rootopt"
    return Path.home() / ".cache" / "rootopt"


def _fitter_version() -> str:
    # Kept in sync with rootopt.coeffs.fit.FITTER_VERSION (tested); not imported here so
    # that the lookup never imports the fitter (torch) unless it has to fit.
    return "2"


def cache_path(rows: int, cols: int, steps: int, dtype: str, delta: float = DEFAULT_DELTA) -> Path:
    m, n = min(rows, cols), max(rows, cols)
    return (
        cache_dir()
        / "adanewton"
        / f"v{_fitter_version()}"
        / f"{m}x{n}_k{steps}_{dtype}_d{delta:g}.json"
    )


def read_cache(
    path: Path, key: tuple[int, int, int, str], delta: float = DEFAULT_DELTA
) -> Schedule | None:
    """The cached schedule, or None when the entry is missing, corrupt or not stable."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if raw.get("format") != CACHE_FORMAT:
            raise ValueError("format")
        m, n, k, dt = key
        if [int(v) for v in raw["shape"]] != [m, n] or int(raw["steps"]) != k or raw["dtype"] != dt:
            raise ValueError("key mismatch")
        sched = _parse_schedule(raw["schedule"], k)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("adanewton: cache entry %s is unreadable (%s); refitting", path.name, exc)
        return None
    rep = verify_schedule(sched, delta=delta, prefix_bound=PREFIX_BOUND)
    if not rep.stable:
        log.warning(
            "adanewton: cache entry %s fails the stability check (%s); refitting",
            path.name,
            rep.reason,
        )
        return None
    return sched


def write_cache(path: Path, payload: dict[str, Any]) -> bool:
    """Atomic write (temp file in the same directory, then rename); False on failure."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(payload, indent=1).encode("utf-8"))
    except OSError as exc:
        log.warning("adanewton: cannot write cache entry %s (%s)", path, exc)
        return False
    return True


# ----------------------------------------------------------------------------- lookup


def fit_enabled() -> bool:
    env = os.environ.get("ROOTOPT_ADANEWTON_FIT")
    if env is not None and env.strip() != "":
        return env.strip().lower() not in ("0", "false", "no", "off")
    return FIT_AT_RUNTIME


def nearest_entry(rows: int, cols: int, steps: int, dtype: str = "float32") -> TableEntry | None:
    """The table entry closest in ``(log min dim, log aspect)`` with the same steps/dtype."""
    m, n = min(rows, cols), max(rows, cols)
    _, entries = load_table()
    best: tuple[float, TableEntry] | None = None
    for (em, en, k, dt), e in sorted(entries.items()):
        if k != steps or dt != dtype:
            continue
        d = math.hypot(math.log(em / m), math.log((en / em) / (n / m)))
        if best is None or d < best[0]:
            best = (d, e)
    return None if best is None else best[1]


def _fit_and_cache(key: tuple[int, int, int, str], delta: float) -> tuple[Schedule, str]:
    from rootopt.coeffs.fit import FitConfig, fit_coefficients

    m, n, k, dt = key
    cfg = FitConfig(steps=k, dtype=dt, delta=delta, **RUNTIME_FIT)
    res = fit_coefficients(m, n, cfg)
    payload = {"format": CACHE_FORMAT, **res.payload()}
    ok = write_cache(cache_path(m, n, k, dt, delta), payload)
    return res.schedule, f"fitted in {res.seconds:.1f}s ({res.kind})" + (
        "" if ok else ", not cached"
    )


def lookup(
    rows: int,
    cols: int,
    steps: int = 5,
    *,
    dtype: str = "float32",
    fit: bool | None = None,
    delta: float = DEFAULT_DELTA,
) -> Lookup:
    """Resolve the AdaNewton schedule for a ``rows x cols`` matrix (see the module doc)."""
    if rows < 1 or cols < 1:
        raise ValueError(f"adanewton: matrix shape must be positive, got {rows}x{cols}")
    if steps < 1:
        raise ValueError(f"adanewton: steps must be >= 1, got {steps}")
    m, n = min(rows, cols), max(rows, cols)
    key = (m, n, steps, dtype)
    _, entries = load_table()
    entry = entries.get(key)
    if entry is not None and delta == DEFAULT_DELTA:
        res = Lookup(entry.schedule, "table", key, entry.kind)
    elif fit_enabled() if fit is None else fit:
        with _lock:  # one fit per shape even when several threads ask
            cached = read_cache(cache_path(m, n, steps, dtype, delta), key, delta)
            if cached is not None:
                res = Lookup(cached, "cache", key)
            else:
                sched, detail = _fit_and_cache(key, delta)
                res = Lookup(sched, "fit", key, detail)
    else:
        near = nearest_entry(m, n, steps, dtype)
        if near is not None:
            res = Lookup(near.schedule, "nearest", key, f"table entry {near.rows}x{near.cols}")
        else:
            res = Lookup(MUON.schedule(steps), "muon", key, "no table entry for these steps/dtype")
    if key not in _logged:
        _logged.add(key)
        log.info(
            "adanewton %dx%d K=%d %s: %s%s",
            m,
            n,
            steps,
            dtype,
            res.source,
            f" ({res.detail})" if res.detail else "",
        )
    return res


@lru_cache(maxsize=4096)
def adanewton_schedule(rows: int, cols: int, steps: int) -> Schedule:
    """Stable shape-specific schedule for a ``rows x cols`` matrix and ``steps`` iterations."""
    return lookup(rows, cols, steps).schedule


def clear_memory_caches() -> None:
    """Forget in-process lookups (the table is re-read, the log-once set emptied)."""
    adanewton_schedule.cache_clear()
    load_table.cache_clear()
    _logged.clear()
