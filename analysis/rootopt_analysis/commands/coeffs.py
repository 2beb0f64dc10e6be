"""``rootopt coeffs fit|bench|families|build-table|record|heldout``: the offline
coefficient tools (``rootopt coeffs show`` is the runtime's: :mod:`rootopt.commands.coeffs`,
which hands every other subcommand to :func:`main` here).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from rootopt.commands.coeffs import format_schedule, parse_shape, steps_arg

# The largest matrix a fit may draw its spectra from (entries): a fit samples matrices of
# the shape's aspect ratio with the small side cut to FitConfig.max_dim; 64x262144 (this
# many entries) took 30 s on 2 CPU cores, and the time grows with it.
FIT_ENTRIES_LIMIT = 1 << 24


def fit_size_problem(m: int, n: int, max_dim: int) -> str:
    """'' when a fit of ``m x n`` samples at most :data:`FIT_ENTRIES_LIMIT` entries,
    else the reason (the sampled size and the longest side that fits)."""
    small, large = min(m, n), max(m, n)
    m2 = min(small, max_dim)
    n2 = max(m2, round(large * m2 / small))
    if m2 * n2 <= FIT_ENTRIES_LIMIT:
        return ""
    longest = (FIT_ENTRIES_LIMIT // m2) * small // m2
    return (
        f"shape {m}x{n} would sample {m2}x{n2} matrices ({m2 * n2:.3g} entries; the limit "
        f"is {FIT_ENTRIES_LIMIT}; the time grows with it): with a short side of {small}, "
        f"fit a long side of at most {longest}"
    )


def cmd_fit(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="rootopt coeffs fit", description="Fit AdaNewton coefficients for one shape."
    )
    ap.add_argument("--shape", type=parse_shape, required=True)
    ap.add_argument("--steps", type=steps_arg, default=5)
    g = ap.add_mutually_exclusive_group()
    g.add_argument(
        "--schedule", dest="mode", action="store_const", const="schedule", help="one tuple per step"
    )
    g.add_argument(
        "--single", dest="mode", action="store_const", const="single", help="one repeated tuple"
    )
    ap.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"]
    )
    ap.add_argument("--delta", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-family", type=int, default=12)
    ap.add_argument("--cache", action="store_true", help="also store the result in the user cache")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    a = ap.parse_args(argv)
    from rootopt_analysis.coeffs.fit import FitConfig, fit_coefficients

    try:
        cfg = FitConfig(
            steps=a.steps,
            mode=a.mode or "auto",
            dtype=a.dtype,
            delta=a.delta,
            seed=a.seed,
            per_family=a.per_family,
        )
    except ValueError as exc:
        print(f"rootopt coeffs fit: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    m, n = a.shape
    too_big = fit_size_problem(m, n, cfg.max_dim)
    if too_big:
        print(f"rootopt coeffs fit: {too_big}", file=sys.stderr)
        return 2
    if a.cache:
        from rootopt_analysis.coeffs.fitcache import (
            CACHE_FORMAT,
            cache_path,
            file_lock,
            write_cache,
        )

        path = cache_path(m, n, a.steps, a.dtype, a.delta)
        with file_lock(path):  # a concurrent ns_fit=True waits, then reads this entry
            res = fit_coefficients(m, n, cfg)
            write_cache(path, {"format": CACHE_FORMAT, **res.payload()})
    else:
        res = fit_coefficients(m, n, cfg)
    payload = res.payload()
    if a.json:
        print(json.dumps(payload, indent=1))
        return 0
    print(f"AdaNewton {min(m, n)}x{max(m, n)}, K={a.steps}, {a.dtype}, delta={a.delta}: {res.kind}")
    print(format_schedule(res.schedule))
    print(f"objective (mix-weighted mean relative error): {res.objective:.4f}")
    print(
        "training error by family: "
        + ", ".join(f"{k} {v:.4f}" for k, v in res.family_error.items())
    )
    print(f"peak of the composition on [0, 1]: {res.peak:.4f} (bound {1 + a.delta})")
    print(f"warm start: {res.warm_start}; {res.seconds:.1f}s")
    return 0


USAGE = (
    "usage: rootopt coeffs {fit,show,bench,families,build-table,record,heldout} [options]"
    "  (-h on each)"
)
# subcommand -> the module whose main(argv) runs it
TOOLS = {
    "bench": "rootopt_analysis.coeffs.bench",
    "families": "rootopt_analysis.coeffs.families",
    "build-table": "rootopt_analysis.coeffs.build",
    "record": "rootopt_analysis.coeffs.record",
    "heldout": "rootopt_analysis.coeffs.heldout",
}


def main(argv: list[str]) -> int:
    sub, rest = argv[0], argv[1:]
    if sub == "fit":
        return cmd_fit(rest)
    if sub in TOOLS:
        result: int = importlib.import_module(TOOLS[sub]).main(rest)
        return result
    print(f"rootopt coeffs: unknown subcommand {sub!r}\n{USAGE}", file=sys.stderr)
    return 2
