"""Build the shipped AdaNewton table: ``python -m rootopt_analysis.coeffs.build`` (or
``rootopt coeffs build-table``).

Fits every shape of :func:`rootopt_analysis.coeffs.shapes.table_shapes` (float64, CPU, seeded;
see :mod:`rootopt_analysis.coeffs.fit`) and writes ``data/adanewton_table.json`` with the
provenance of the whole build (objective, spectra mix, δ, K, dtype, seed, fitter and
package version, the recorded-spectra file's provenance) and, per entry, the models
using the shape, the fit objective, the per-family training error and the peak of the
composition. Offline tool: the optimizer only reads the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import rootopt.coeffs
from rootopt.coeffs.adanewton import TABLE_FILE, TABLE_FORMAT
from rootopt_analysis.coeffs.fit import FITTER_VERSION, OBJECTIVE, FitConfig, fit_coefficients
from rootopt_analysis.coeffs.shapes import table_shapes
from rootopt_analysis.coeffs.spectra import load_recorded

# The table shipped inside the rootopt package (the runtime reads it); never written here
# unless named with --out, and refused then too (_is_shipped).
DEFAULT_OUT = Path(rootopt.coeffs.__file__).resolve().parent / "data" / TABLE_FILE

# The budget of the shipped table (a run-time fit uses a smaller one).
TABLE_FIT: dict[str, Any] = {"per_family": 10, "max_dim": 256, "max_iter": 100}


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("rootopt")
    except Exception:
        return "0.1.0 (source tree)"


def build_table(
    *,
    steps: int = 5,
    dtype: str = "float32",
    seed: int = 0,
    delta: float = 0.25,
    shapes: Sequence[tuple[int, int]] | None = None,
    out: Path,
    code_version: str = "",
    verbose: bool = True,
) -> dict[str, Any]:
    old = _existing_table(out)  # refuses a file that is not an AdaNewton table, before fitting
    allshapes = table_shapes()
    todo = list(allshapes) if shapes is None else [(min(s), max(s)) for s in shapes]
    cfg = FitConfig(steps=steps, dtype=dtype, seed=seed, delta=delta, **TABLE_FIT)
    rec = load_recorded()
    t0 = time.perf_counter()
    entries: list[dict[str, Any]] = []
    for i, (m, n) in enumerate(todo):
        res = fit_coefficients(m, n, cfg, recorded=rec)
        entries.append(
            {
                "shape": [m, n],
                "steps": steps,
                "dtype": dtype,
                "kind": res.kind,
                "schedule": [list(t) for t in res.schedule],
                "objective": round(res.objective, 6),
                "family_error": {k: round(v, 6) for k, v in res.family_error.items()},
                "peak": round(res.peak, 6),
                "warm_start": res.warm_start,
                "models": allshapes.get((m, n), []),
                "seconds": round(res.seconds, 2),
            }
        )
        if verbose:
            print(
                f"[{i + 1}/{len(todo)}] {m}x{n}: {res.kind} obj {res.objective:.4f} "
                f"peak {res.peak:.3f} ({res.seconds:.1f}s)",
                flush=True,
            )
    provenance = {
        "objective": OBJECTIVE,
        "constraint": (
            f"K-fold composition in [0, 1 + delta] with delta = {delta}, partial "
            f"compositions in [0, {cfg.prefix_bound}], no local max above the upper "
            "fixed point for a repeated tuple; verified by rootopt.coeffs.stability.certify "
            f"for {dtype} (verify_schedule's uniform + geometric grid, refined, plus the "
            "rounding envelope of bfloat16/float16)"
        ),
        "fit_config": cfg.to_json(),
        "spectra": {
            "mix": dict(cfg.mix),
            "families": "see rootopt_analysis.coeffs.spectra (gaussian, lowrank, heavytail, momentum)",
            "recorded": rec.source,
            "recorded_count": len(rec.spectra),
        },
        "fitter_version": FITTER_VERSION,
        "package_version": _package_version(),
        "code_version": code_version,
        "torch_threads": _threads(),
        # The fit is an L-BFGS descent on a flat optimum: a one-ulp change in any input
        # (e.g. numpy's geomspace) moves coefficients by ~1% at equal objective, so the
        # versions that produced the table are part of its provenance.
        "versions": _versions(),
        "python": platform.python_version(),
        "build_seconds": round(time.perf_counter() - t0, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    # One table holds every (K, dtype): a build replaces its own (K, dtype) entries (all of
    # them, or only the shapes asked for) and its dtype's provenance block, and keeps the
    # rest of an existing table as it was.
    table: dict[str, Any] = dict(old) if old is not None else {"format": TABLE_FORMAT}
    table[provenance_key(dtype)] = provenance
    if old is not None:
        done = {(e["shape"][0], e["shape"][1]) for e in entries}
        keep = [
            e
            for e in old.get("entries", [])
            if (e["steps"], e["dtype"]) != (steps, dtype)
            or (shapes is not None and (e["shape"][0], e["shape"][1]) not in done)
        ]
        entries = keep + entries
    table["entries"] = sorted(entries, key=lambda e: (e["steps"], e["dtype"], e["shape"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=out.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(table, fh, indent=1)
        fh.write("\n")
    os.chmod(tmp, 0o644)  # mkstemp creates 0600; the table is package data
    os.replace(tmp, out)
    return table


def provenance_key(dtype: str) -> str:
    """The header key of a dtype's build provenance: ``provenance`` for float32 (the
    table's first and main build), ``provenance_<dtype>`` for the others."""
    return "provenance" if dtype == "float32" else f"provenance_{dtype}"


class TableFileError(ValueError):
    """``--out`` names a file that is not an AdaNewton table (it is never overwritten)."""


def _existing_table(out: Path) -> dict[str, Any] | None:
    if not out.exists():
        return None
    try:
        raw = json.loads(out.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TableFileError(f"{out} exists and is not an AdaNewton table ({exc})") from None
    if not isinstance(raw, dict) or raw.get("format") != TABLE_FORMAT:
        raise TableFileError(
            f"{out} exists and is not an AdaNewton table (no format {TABLE_FORMAT!r}); "
            "choose a new --out"
        )
    entries = raw.get("entries", [])
    if not isinstance(entries, list):
        raise TableFileError(f"{out} is a damaged AdaNewton table ('entries' is not a list)")
    for i, e in enumerate(entries):
        shape = e.get("shape") if isinstance(e, dict) else None
        ok = (
            isinstance(shape, list)
            and len(shape) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in shape)
            and isinstance(e.get("steps"), int)
            and isinstance(e.get("dtype"), str)
        )
        if not ok:
            raise TableFileError(
                f"{out} is a damaged AdaNewton table (entry {i} has no valid shape, steps "
                "and dtype); it is left as it is: choose a new --out"
            )
    return raw


def _versions() -> dict[str, str]:
    import numpy
    import torch

    return {"numpy": numpy.__version__, "torch": torch.__version__}


def _threads() -> int:
    import torch

    return int(torch.get_num_threads())


def _git_version() -> str:
    import subprocess

    try:
        r = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return r.stdout.strip()


def _is_shipped(out: Path) -> bool:
    """``out`` is the shipped table (the same file, through any path or link)."""
    try:
        return out.resolve() == DEFAULT_OUT.resolve() or (
            out.exists() and DEFAULT_OUT.exists() and out.samefile(DEFAULT_OUT)
        )
    except OSError:
        return False


def _shape(text: str) -> tuple[int, int]:
    """``2048x8192`` → (2048, 8192); argparse reports anything else as one usage line."""
    try:
        a, b = (int(v) for v in text.lower().replace("×", "x").split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a shape like 2048x8192, got {text!r}") from None
    if a < 1 or b < 1:
        raise argparse.ArgumentTypeError(f"shape dimensions must be >= 1, got {text!r}")
    return a, b


def _steps(text: str) -> int:
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 1 <= k <= 20:
        raise argparse.ArgumentTypeError(f"Newton–Schulz steps must be in 1..20, got {k}")
    return k


def main(argv: Sequence[str] | None = None) -> int:
    from rootopt_analysis.coeffs.fit import UNIT_ROUNDOFF

    ap = argparse.ArgumentParser(prog="rootopt coeffs build-table", description=__doc__)
    ap.add_argument("--steps", type=_steps, default=5)
    ap.add_argument("--dtype", default="float32", choices=sorted(UNIT_ROUNDOFF))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--delta", type=float, default=0.25)
    ap.add_argument(
        "--shape",
        action="append",
        type=_shape,
        default=None,
        help="only these shapes, e.g. 2048x8192",
    )
    ap.add_argument(
        "--out",
        type=Path,
        required=True,
        help="the table file to write (never the table shipped inside the package: build "
        "into a file, review it, use it with ROOTOPT_ADANEWTON_TABLE=FILE)",
    )
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    if _is_shipped(a.out):
        print(
            f"rootopt coeffs build-table: --out {str(a.out)!r} is the table shipped inside "
            "the package (an editable install would rewrite the source tree); write to "
            "another file, review it, and use it with ROOTOPT_ADANEWTON_TABLE=FILE",
            file=sys.stderr,
        )
        return 2
    shapes = list(a.shape) if a.shape else None
    try:
        FitConfig(steps=a.steps, dtype=a.dtype, seed=a.seed, delta=a.delta, **TABLE_FIT)
    except ValueError as exc:
        print(f"rootopt coeffs build-table: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    try:
        t = build_table(
            steps=a.steps,
            dtype=a.dtype,
            seed=a.seed,
            delta=a.delta,
            shapes=shapes,
            out=a.out,
            code_version=_git_version(),
        )
    except TableFileError as exc:
        print(f"rootopt coeffs build-table: {exc}", file=sys.stderr)
        return 2
    built = t[provenance_key(a.dtype)]
    n_built = len(shapes) if shapes is not None else len(table_shapes())
    print(
        f"wrote {n_built} {a.dtype} entries to {a.out.name} ({len(t['entries'])} in the table) "
        f"in {built['build_seconds']}s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
