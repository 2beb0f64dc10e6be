"""``rootopt coeffs bench``: precision of Newton–Schulz coefficient schemes vs shape.

For every shape (default: the shipped table's) and every spectrum family it measures the
relative Frobenius error ``||X_K − U Vᵀ||_F / ||U Vᵀ||_F`` of classic cubic and quintic
Newton–Schulz, Muon, You, Polar Express, CANS, the paper's table (official code: Muon's
tuple where the table has no entry) and AdaNewton, all at the same K, plus the
worst-case amplification ``max_{σ∈[0,1]} p_K(σ)`` (refined grid).

Spectra are drawn with a seed the table was never fitted with (default 1000), and the
real momentum spectra come from recorded models held out of every fit
(:data:`rootopt_analysis.coeffs.spectra.HOLDOUT_MODELS`): ``momentum`` carries all of them to
each table shape by quantiles, ``recorded`` judges them on their own (native) shapes.

Errors are computed on the singular values (exact for Newton–Schulz in exact
arithmetic); ``--matrix-check`` also runs the real iteration (:func:`rootopt.ortho.newton_schulz`)
on matrices built with those spectra, in float32 and bfloat16, and reports how far the
measured errors are from the scalar ones.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rootopt.coeffs import CANS, CUBIC, MUON, PAPER_TABLE, POLAR_EXPRESS, QUINTIC, YOU, Schedule
from rootopt.coeffs.adanewton import lookup
from rootopt.coeffs.stability import apply_schedule, verify_schedule
from rootopt_analysis.coeffs import new_file
from rootopt_analysis.coeffs.shapes import family_of, table_shapes
from rootopt_analysis.coeffs.spectra import (
    SpectrumSample,
    load_recorded,
    recorded_for_shape,
    sample_spectra,
)

METHODS: tuple[str, ...] = (
    "cubic",
    "quintic",
    "muon",
    "you",
    "polar_express",
    "cans",
    "paper",
    "adanewton",
)
# The target compares AdaNewton with the best of these (classic NS is far behind).
BASELINES: tuple[str, ...] = ("muon", "you", "polar_express", "cans", "paper")
FAMILIES: tuple[str, ...] = ("gaussian", "lowrank", "heavytail", "momentum")
TARGET = 0.9


def schedules_for(rows: int, cols: int, steps: int) -> dict[str, Schedule]:
    m, n = min(rows, cols), max(rows, cols)
    paper = PAPER_TABLE.get((m, n), MUON.tuples[0])
    return {
        "cubic": CUBIC.schedule(steps),
        "quintic": QUINTIC.schedule(steps),
        "muon": MUON.schedule(steps),
        "you": YOU.schedule(steps),
        "polar_express": POLAR_EXPRESS.schedule(steps),
        "cans": CANS.schedule(steps),
        "paper": (paper,) * steps,
        "adanewton": lookup(m, n, steps).schedule,
    }


def rel_error(schedule: Schedule, sigma: np.ndarray) -> float:
    y = apply_schedule(schedule, sigma)
    return float(np.sqrt(np.mean((y - 1.0) ** 2)))


def peak(schedule: Schedule) -> float:
    return verify_schedule(schedule, delta=1e9).peak


def _family_errors(
    scheds: dict[str, Schedule], samples: Sequence[SpectrumSample]
) -> dict[str, float]:
    return {k: float(np.mean([rel_error(s, x.sigma) for x in samples])) for k, s in scheds.items()}


def bench_shapes(
    shapes: Sequence[tuple[int, int]], *, steps: int, seed: int, per_family: int, max_dim: int
) -> list[dict[str, Any]]:
    holdout = load_recorded(split="holdout")
    rows_out = []
    for m, n in shapes:
        scheds = schedules_for(m, n, steps)
        samples = sample_spectra(
            m,
            n,
            seed=seed,
            per_family=per_family,
            max_dim=max_dim,
            families=("gaussian", "lowrank", "heavytail"),
        )
        # every held-out recorded spectrum, carried to the shape
        samples["momentum"] = recorded_for_shape(m, n, holdout) if m > 1 else []
        errs = {f: _family_errors(scheds, samples[f]) for f in FAMILIES if samples.get(f)}
        rows_out.append(
            {
                "shape": [m, n],
                "shape_family": family_of((m, n)),
                "errors": errs,
                "peak": {k: peak(s) for k, s in scheds.items()},
                "paper_entry": (m, n) in PAPER_TABLE,
            }
        )
    return rows_out


def bench_recorded(*, steps: int) -> list[dict[str, Any]]:
    """Held-out recorded spectra on their native shapes, grouped by shape."""
    rec = load_recorded(split="holdout")
    by_shape: dict[tuple[int, int], list[SpectrumSample]] = {}
    for r in rec.spectra:
        key = (min(r.rows, r.cols), max(r.rows, r.cols))
        # Stored spectra are quantile-compressed; each value stands for m/len values.
        sig = r.sigma * math.sqrt(r.sigma.size / key[0])
        by_shape.setdefault(key, []).append(SpectrumSample("recorded", sig, r.name))
    out = []
    for (m, n), samples in sorted(by_shape.items()):
        scheds = schedules_for(m, n, steps)
        out.append(
            {
                "shape": [m, n],
                "count": len(samples),
                "errors": {"recorded": _family_errors(scheds, samples)},
                "peak": {k: peak(s) for k, s in scheds.items()},
            }
        )
    return out


def matrix_check(
    shapes: Sequence[tuple[int, int]], *, steps: int, seed: int
) -> list[dict[str, Any]]:
    """Real Newton–Schulz on matrices with sampled spectra vs the scalar prediction."""
    import torch

    from rootopt.ortho import newton_schulz

    out = []
    g = torch.Generator().manual_seed(seed)
    for m, n in shapes:
        scheds = schedules_for(m, n, steps)
        samples = sample_spectra(
            m, n, seed=seed, per_family=1, max_dim=max(m, 1), families=("gaussian", "lowrank")
        )
        for fam, lst in samples.items():
            sig = torch.from_numpy(lst[0].sigma.copy())
            r = sig.numel()
            U, _ = torch.linalg.qr(torch.randn(m, r, generator=g, dtype=torch.float64))
            V, _ = torch.linalg.qr(torch.randn(n, r, generator=g, dtype=torch.float64))
            G = (U * sig) @ V.T
            target = U @ V.T
            for meth, s in scheds.items():
                pred = rel_error(s, lst[0].sigma)
                row = {"shape": [m, n], "family": fam, "method": meth, "scalar": pred}
                for dt_name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
                    X = newton_schulz(G, s, dtype=dt).double()
                    row[dt_name] = float((X - target).norm() / target.norm())
                out.append(row)
    return out


def _ratio(errs: dict[str, float]) -> tuple[float, str]:
    best = min((b for b in BASELINES if b in errs), key=lambda b: errs[b])
    return errs["adanewton"] / max(errs[best], 1e-30), best


def _summary(rows: list[dict[str, Any]], fams: Sequence[str]) -> list[str]:
    lines = [
        "| shape | family | AdaNewton | best baseline | ratio | amp (Ada) | target |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m, n = r["shape"]
        for f in fams:
            e = r["errors"].get(f)
            if not e:
                continue
            ratio, best = _ratio(e)
            ok = "ok" if ratio <= TARGET and r["peak"]["adanewton"] <= 1.25 + 1e-9 else "MISS"
            lines.append(
                f"| {m}x{n} | {f} | {e['adanewton']:.4f} | {best} {e[best]:.4f} | {ratio:.3f} | "
                f"{r['peak']['adanewton']:.3f} | {ok} |"
            )
    return lines


def _by_shape_family(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| shape family | spectrum | shapes | ratio median | ratio worst | worst shape | met |",
        "|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str], list[tuple[float, str]]] = {}
    for r in rows:
        for f, e in r["errors"].items():
            ratio, _ = _ratio(e)
            groups.setdefault((r["shape_family"], f), []).append(
                (ratio, f"{r['shape'][0]}x{r['shape'][1]}")
            )
    for (sf, f), v in sorted(groups.items()):
        rs = sorted(v)
        met = sum(1 for x, _ in rs if x <= TARGET)
        lines.append(
            f"| {sf} | {f} | {len(rs)} | {rs[len(rs) // 2][0]:.3f} | {rs[-1][0]:.3f} | {rs[-1][1]} | {met}/{len(rs)} |"
        )
    return lines


def _methods_table(rows: list[dict[str, Any]], fams: Sequence[str]) -> list[str]:
    lines = [
        "| method | " + " | ".join(f"{f} (mean)" for f in fams) + " | worst-case amplification |",
        "|---|" + "---|" * (len(fams) + 1),
    ]
    for meth in METHODS:
        cells = []
        for f in fams:
            v = [r["errors"][f][meth] for r in rows if f in r["errors"]]
            cells.append(f"{np.mean(v):.4f}" if v else "-")
        amp = max(r["peak"][meth] for r in rows)
        lines.append(f"| {meth} | " + " | ".join(cells) + f" | {amp:.3f} |")
    return lines


def plot(rows: list[dict[str, Any]], recorded: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = sorted(
        range(len(rows)),
        key=lambda i: (rows[i]["shape"][1] / rows[i]["shape"][0], rows[i]["shape"][0]),
    )
    labels = [f"{rows[i]['shape'][0]}x{rows[i]['shape'][1]}" for i in order]
    fams = [f for f in FAMILIES if any(f in r["errors"] for r in rows)]
    fig, axes = plt.subplots(len(fams) + 1, 1, figsize=(13, 2.6 * (len(fams) + 1)), sharex=True)
    style = {
        "cubic": ("#bbbbbb", ":"),
        "quintic": ("#888888", ":"),
        "muon": ("#1f77b4", "-"),
        "you": ("#2ca02c", "-"),
        "polar_express": ("#9467bd", "-"),
        "cans": ("#8c564b", "-"),
        "paper": ("#ff7f0e", "--"),
        "adanewton": ("#d62728", "-"),
    }
    x = np.arange(len(order))
    for ax, f in zip(axes, fams):
        for meth in METHODS:
            y = [rows[i]["errors"].get(f, {}).get(meth, np.nan) for i in order]
            c, ls = style[meth]
            ax.plot(
                x,
                y,
                ls,
                color=c,
                lw=2.2 if meth == "adanewton" else 1.2,
                label=meth,
                marker="." if meth == "adanewton" else None,
            )
        ax.set_yscale("log")
        ax.set_ylabel(f"rel. error\n{f}")
        ax.grid(alpha=0.3)
    axes[0].legend(ncol=8, fontsize=7, loc="lower left")
    ax = axes[-1]
    for meth in METHODS:
        y = [rows[i]["peak"][meth] for i in order]
        c, ls = style[meth]
        ax.plot(x, y, ls, color=c, lw=2.2 if meth == "adanewton" else 1.2)
    ax.axhline(1.25, color="k", lw=0.8, ls="--")
    ax.set_ylim(0.9, 1.6)
    ax.set_ylabel("worst-case\namplification")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, rotation=90, fontsize=6)
    ax.set_xlabel(
        "shape (sorted by aspect ratio, then min dim); paper 2048x2048 peaks at 3.31 (off scale)"
    )
    fig.suptitle(
        "Newton–Schulz K=5: relative error ||X_K - UV^T||_F/||UV^T||_F by shape and spectrum family"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=60)
    plt.close(fig)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="rootopt coeffs bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--shapes", default="table", help="'table', 'paper' or a comma list like 2048x8192,768x768"
    )
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--seed", type=int, default=1000, help="spectra seed (the table is fitted with 0)"
    )
    ap.add_argument("--samples", type=int, default=8, help="spectra per family and shape")
    ap.add_argument("--max-dim", type=int, default=256)
    ap.add_argument(
        "--plot", type=new_file, default=None, help="write the PNG plot here (a new file)"
    )
    ap.add_argument(
        "--json", type=new_file, default=None, help="write all numbers here (a new file)"
    )
    ap.add_argument(
        "--matrix-check", default="", help="comma list of shapes for real NS, e.g. 128x512,256x256"
    )
    a = ap.parse_args(argv)
    if a.shapes == "table":
        shapes = list(table_shapes())
    elif a.shapes == "paper":
        shapes = list(PAPER_TABLE)
    else:
        shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",") if s]  # type: ignore[misc]
    shapes = [(min(s), max(s)) for s in shapes]
    t0 = time.perf_counter()
    rows = bench_shapes(shapes, steps=a.steps, seed=a.seed, per_family=a.samples, max_dim=a.max_dim)
    recorded = bench_recorded(steps=a.steps)
    fams = [f for f in FAMILIES if any(f in r["errors"] for r in rows)]
    print(
        f"# AdaNewton bench: K={a.steps}, spectra seed {a.seed}, {a.samples} per family, {len(shapes)} shapes\n"
    )
    print("## Mean relative error over all shapes, and worst-case amplification\n")
    print("\n".join(_methods_table(rows, fams)))
    print(
        f"\n## AdaNewton / best of {{{', '.join(BASELINES)}}}, by shape family (target <= {TARGET})\n"
    )
    print("\n".join(_by_shape_family(rows)))
    print("\n## Per shape\n")
    print("\n".join(_summary(rows, fams)))
    if recorded:
        print("\n## Held-out recorded momentum spectra, native shapes\n")
        print("\n".join(_summary(recorded, ["recorded"])))
    checks: list[dict[str, Any]] = []
    if a.matrix_check:
        mshapes = [tuple(int(v) for v in s.split("x")) for s in a.matrix_check.split(",") if s]
        checks = matrix_check([(min(s), max(s)) for s in mshapes], steps=a.steps, seed=a.seed)  # type: ignore[misc]
        print("\n## Real Newton–Schulz vs scalar prediction\n")
        print("| shape | family | method | scalar | float32 | bfloat16 |")
        print("|---|---|---|---|---|---|")
        for c in checks:
            print(
                f"| {c['shape'][0]}x{c['shape'][1]} | {c['family']} | {c['method']} | {c['scalar']:.4f} | {c['float32']:.4f} | {c['bfloat16']:.4f} |"
            )
        dev = max(abs(c["float32"] - c["scalar"]) for c in checks)
        print(f"\nmax |float32 - scalar| = {dev:.2e}")
    print(f"\n({time.perf_counter() - t0:.0f}s)")
    if a.json:
        record = {
            "shapes": rows,
            "recorded": recorded,
            "matrix_check": checks,
            "steps": a.steps,
            "seed": a.seed,
        }
        with open(a.json, "x", encoding="utf-8") as fh:  # never replaces a file
            fh.write(json.dumps(record, indent=1))
    if a.plot:
        plot(rows, recorded, a.plot)
        print(f"plot: {a.plot}")
    return 0
