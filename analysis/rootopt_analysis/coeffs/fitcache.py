"""Opt-in fitting with a user cache and a file lock (``ROOT(..., ns_fit=True)``,
``rootopt coeffs fit --cache``).

A shape the shipped table lacks is read from the cache, or fitted (:mod:`rootopt_analysis.coeffs.fit`,
seconds per shape) and written atomically to the cache. The fit runs under an exclusive
``fcntl`` lock on ``<entry>.lock``: concurrent processes (the ranks of one job, two jobs on
one machine) wait for the first one and then read its entry, so a shape is fitted once.
A cache entry that does not parse, does not match its key or fails the certificate is
refitted, never trusted.

Cache directory: ``$ROOTOPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/rootopt``, else
``~/.cache/rootopt``; entries live under ``adanewton/v<fitter version>/``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rootopt._atomic import atomic_write
from rootopt.coeffs.adanewton import (
    PREFIX_BOUND,
    CoefficientError,
    Resolution,
    _parse_schedule,
    load_table,
    log_once,
)
from rootopt.coeffs.presets import Schedule
from rootopt.coeffs.stability import DEFAULT_DELTA, certify
from rootopt_analysis.coeffs.fit import FITTER_VERSION, FitConfig, fit_coefficients

log = logging.getLogger("rootopt.coeffs")

CACHE_FORMAT = "rootopt.adanewton_cache/1"
# Budget of a fit made for the cache: seconds, not minutes (the shipped table uses more).
RUNTIME_FIT: dict[str, Any] = {"per_family": 6, "max_dim": 128, "max_iter": 60}


def cache_dir() -> Path:
    """``$ROOTOPT_CACHE_DIR`` or ``$XDG_CACHE_HOME/rootopt`` or ``~/.cache/rootopt``."""
    env = os.environ.get("ROOTOPT_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg) / "rootopt"
    return Path.home() / ".cache" / "rootopt"


def cache_path(rows: int, cols: int, steps: int, dtype: str, delta: float = DEFAULT_DELTA) -> Path:
    m, n = min(rows, cols), max(rows, cols)
    return (
        cache_dir()
        / "adanewton"
        / f"v{FITTER_VERSION}"
        / f"{m}x{n}_k{steps}_{dtype}_d{delta:g}.json"
    )


def read_cache(
    path: Path, key: tuple[int, int, int, str], delta: float = DEFAULT_DELTA
) -> Schedule | None:
    """The cached schedule, or None when the entry is missing, corrupt or not certified."""
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
    rep = certify(sched, dtype=key[3], delta=delta, prefix_bound=PREFIX_BOUND)
    if not rep.stable:
        log.warning(
            "adanewton: cache entry %s fails the certificate (%s); refitting", path.name, rep.reason
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


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[bool]:
    """Exclusive lock on ``path`` + ``.lock`` (yields False when no lock could be taken)."""
    lock = path.with_name(path.name + ".lock")
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fh = open(lock, "a+")  # noqa: SIM115 - held for the duration of the block
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        yield True
    finally:
        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
        fh.close()


def fit_for_cache(
    rows: int, cols: int, steps: int, dtype: str, delta: float = DEFAULT_DELTA
) -> tuple[Schedule, str]:
    """Fit one shape with the cache budget and store it; returns (schedule, detail)."""
    m, n = min(rows, cols), max(rows, cols)
    cfg = FitConfig(steps=steps, dtype=dtype, delta=delta, **RUNTIME_FIT)
    res = fit_coefficients(m, n, cfg)
    ok = write_cache(
        cache_path(m, n, steps, dtype, delta), {"format": CACHE_FORMAT, **res.payload()}
    )
    return res.schedule, f"fitted in {res.seconds:.1f}s ({res.kind})" + (
        "" if ok else ", not cached"
    )


def fitted_resolution(
    rows: int, cols: int, steps: int, *, dtype: str = "float32", delta: float = DEFAULT_DELTA
) -> Resolution:
    """The table entry, else the cached fit, else a fit under the file lock (then cached)."""
    m, n = min(rows, cols), max(rows, cols)
    key = (m, n, steps, dtype)
    _, entries = load_table()
    entry = entries.get(key)
    if entry is not None and delta == DEFAULT_DELTA:
        rep = certify(entry.schedule, dtype=dtype, delta=delta, prefix_bound=PREFIX_BOUND)
        if rep.stable:
            res = Resolution(key, entry.schedule, "table", entry.kind, rep.peak)
            log_once(res)
            return res
    path = cache_path(m, n, steps, dtype, delta)
    with file_lock(path):
        cached = read_cache(path, key, delta)
        if cached is not None:
            sched, source, detail = cached, "cache", path.name
        else:
            sched, detail = fit_for_cache(m, n, steps, dtype, delta)
            source = "fitted"
    rep = certify(sched, dtype=dtype, delta=delta, prefix_bound=PREFIX_BOUND)
    if not rep.stable:
        raise CoefficientError(
            f"adanewton {m}x{n} K={steps} {dtype}: the fit fails the certificate ({rep.reason})"
        )
    res = Resolution(key, sched, source, detail, rep.peak)
    log_once(res)
    return res
