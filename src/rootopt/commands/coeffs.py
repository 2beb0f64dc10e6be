"""``rootopt coeffs``: fit, show and benchmark Newton–Schulz coefficients (AdaNewton).

Subcommands::

    rootopt coeffs fit --shape 2048x8192 [--steps 5] [--schedule|--single] [--dtype float32] [--cache]
    rootopt coeffs show [SHAPE] [--steps 5] [--dtype float32]
    rootopt coeffs bench [--shapes table|paper|2048x8192,...] [--plot FILE] [--json FILE]
    rootopt coeffs families [--steps 5] [--json FILE]
    rootopt coeffs build-table [--shape 2048x8192 ...]
    rootopt coeffs record [--steps 300]
    rootopt coeffs heldout [--out DIR] [--seed 9001] [--json FILE]

Fitting is offline and explicit (``fit``, ``build-table``; the tools live in
:mod:`rootopt.tools`). The optimizer itself only reads the shipped table and certifies
what it resolves; ``show`` prints exactly what it would resolve for a shape. ``heldout``
records matrices from short ROOT training runs and measures every schedule's polar error on
them through the optimizer's own Newton–Schulz path (docs/adanewton.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def parse_shape(text: str) -> tuple[int, int]:
    try:
        a, b = (int(v) for v in text.lower().replace("×", "x").split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must look like 2048x8192, got {text!r}") from None
    if a < 1 or b < 1:
        raise argparse.ArgumentTypeError(f"shape must be positive, got {text!r}")
    return a, b


def _steps(text: str) -> int:
    """``--steps``: Newton–Schulz iterations, an integer >= 1 (argparse: one usage line)."""
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if k < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return k


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


def _fmt(s: Sequence[Sequence[float]]) -> str:
    return "\n".join(f"  ({a:+.6f}, {b:+.6f}, {c:+.6f})" for a, b, c in s)


def cmd_fit(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="rootopt coeffs fit", description="Fit AdaNewton coefficients for one shape."
    )
    ap.add_argument("--shape", type=parse_shape, required=True)
    ap.add_argument("--steps", type=_steps, default=5)
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
    from rootopt.tools.fit import FitConfig, fit_coefficients

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
        from rootopt.tools.fitcache import CACHE_FORMAT, cache_path, file_lock, write_cache

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
    print(_fmt(res.schedule))
    print(f"objective (mix-weighted mean relative error): {res.objective:.4f}")
    print(
        "training error by family: "
        + ", ".join(f"{k} {v:.4f}" for k, v in res.family_error.items())
    )
    print(f"peak of the composition on [0, 1]: {res.peak:.4f} (bound {1 + a.delta})")
    print(f"warm start: {res.warm_start}; {res.seconds:.1f}s")
    return 0


def cmd_show(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="rootopt coeffs show", description="Show the table or one shape's coefficients."
    )
    ap.add_argument("shape", nargs="?", type=parse_shape)
    ap.add_argument("--steps", type=_steps, default=5)
    ap.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"]
    )
    a = ap.parse_args(argv)
    from rootopt.coeffs.adanewton import CoefficientError, load_table, lookup

    try:
        header, entries = load_table()
    except CoefficientError as exc:
        print(f"rootopt coeffs show: {exc}", file=sys.stderr)
        return 2
    if a.shape is None:
        prov = header.get("provenance", {})
        print(
            f"AdaNewton table: {len(entries)} entries; fitter v{prov.get('fitter_version')}, "
            f"code {prov.get('code_version') or '?'}, created {prov.get('created')}"
        )
        cfg = prov.get("fit_config", {})
        print(
            f"K={cfg.get('steps')} dtype={cfg.get('dtype')} delta={cfg.get('delta')} seed={cfg.get('seed')} "
            f"mix={cfg.get('mix')}"
        )
        print(f"{'shape':>12} {'kind':>9} {'objective':>9} {'peak':>6}  models")
        for (m, n, _k, _dt), e in sorted(entries.items()):
            models = e.raw.get("models", [])
            more = f" +{len(models) - 2}" if len(models) > 2 else ""
            print(
                f"{m:>5}x{n:<6} {e.kind:>9} {e.raw.get('objective', float('nan')):9.4f} "
                f"{e.raw.get('peak', float('nan')):6.3f}  {', '.join(models[:2])}{more}"
            )
        return 0
    m, n = a.shape
    try:
        res = lookup(m, n, a.steps, dtype=a.dtype)
    except CoefficientError as exc:
        print(f"rootopt coeffs show: {exc}", file=sys.stderr)
        return 2
    print(
        f"AdaNewton {m}x{n}, K={a.steps}, {a.dtype}: source {res.source}"
        + (f" ({res.detail})" if res.detail else "")
    )
    print(_fmt(res.schedule))
    print(f"certified: peak {res.peak:.4f}")
    return 0


def main(argv: list[str]) -> int:
    subs = {
        "fit": cmd_fit,
        "show": cmd_show,
    }
    usage = (
        "usage: rootopt coeffs {fit,show,bench,families,build-table,record,heldout} [options]"
        "  (-h on each)"
    )
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    sub, rest = argv[0], argv[1:]
    if sub in subs:
        return subs[sub](rest)
    tools = {
        "bench": "rootopt.tools.bench",
        "families": "rootopt.tools.families",
        "build-table": "rootopt.tools.build",
        "record": "rootopt.tools.record",
        "heldout": "rootopt.tools.heldout",
    }
    if sub in tools:
        import importlib

        result: int = importlib.import_module(tools[sub]).main(rest)
        return result
    print(f"rootopt coeffs: unknown subcommand {sub!r}\n{usage}", file=sys.stderr)
    return 2
