"""``rootopt coeffs``: show Newton–Schulz coefficients; fit and benchmark them (AdaNewton).

Subcommands::

    rootopt coeffs show [SHAPE] [--steps 5] [--dtype float32]
    rootopt coeffs fit --shape 2048x8192 [--steps 5] [--schedule|--single] [--dtype float32] [--cache]
    rootopt coeffs bench [--shapes table|paper|2048x8192,...] [--plot FILE] [--json FILE]
    rootopt coeffs families [--steps 5] [--json FILE]
    rootopt coeffs build-table [--shape 2048x8192 ...]
    rootopt coeffs record [--steps 300]
    rootopt coeffs heldout [--out DIR] [--seed 9001] [--json FILE]

``show`` prints exactly what the optimizer would resolve for a shape, from the shipped
table; it is part of the runtime. Every other subcommand is offline analysis (fitting is
explicit: ``fit``, ``build-table``) and lives in the separate ``rootopt_analysis`` package
(:mod:`rootopt_analysis.commands.coeffs`), which says how to install it when it is missing.
``heldout`` records matrices from short ROOT training runs and measures every schedule's
polar error on them through the optimizer's own Newton–Schulz path (docs/adanewton.md).
"""

from __future__ import annotations

import argparse
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


def steps_arg(text: str) -> int:
    """``--steps``: Newton–Schulz iterations, an integer >= 1 (argparse: one usage line)."""
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if k < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return k


def format_schedule(s: Sequence[Sequence[float]]) -> str:
    return "\n".join(f"  ({a:+.6f}, {b:+.6f}, {c:+.6f})" for a, b, c in s)


def cmd_show(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="rootopt coeffs show", description="Show the table or one shape's coefficients."
    )
    ap.add_argument("shape", nargs="?", type=parse_shape)
    ap.add_argument("--steps", type=steps_arg, default=5)
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
    print(format_schedule(res.schedule))
    print(f"certified: peak {res.peak:.4f}")
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv[0] == "show":
        return cmd_show(argv[1:])
    # Everything else is analysis; a missing package is reported by the CLI in one line.
    from rootopt_analysis.commands.coeffs import main as analysis_main

    return analysis_main(argv)
