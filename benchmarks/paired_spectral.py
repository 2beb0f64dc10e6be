"""Does the spectral evaluation of Newton–Schulz train like the plain iteration? A paired check.

The spectral form (docs/performance.md, section 5) computes the same K quintic steps as the
plain iteration and is the bfloat16 iteration's default on the CPU for wide shapes. Its
polar error is a proxy; this script measures the objective. For each cell of the committed
defaults study v1 (docs/study_results_v1.json: the settings this check ran with), it trains the study's bfloat16 ROOT arm
(``root-muon-bf16``) with its tuned setting and report seeds twice: once with the plain
iteration everywhere (``ns_gram="off"``) and once with the spectral form on every matrix
(``ns_gram="spectral"``, forced, because the study's models are narrower than the shapes
``auto`` sends to it). It then prints the final test loss of each and the paired difference
with its 95 % t interval over the seeds. The seeds are the study's report seeds; neither
form was chosen on them.

Usage: python benchmarks/paired_spectral.py --out DIR [--cells stdlib@150,kjv@150,digits@200]
[--workers 2] [--json FILE]. ``DIR`` keeps every run's result; a rerun reuses the finished ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from rootopt_analysis.bench.runner import RunSpec, run_many
from rootopt_analysis.bench.stats import mean_ci, paired_ci

STUDY = Path(__file__).resolve().parents[1] / "docs" / "study_results_v1.json"
ARM = "root-muon-bf16"
FORMS = ("off", "spectral")


def specs_for(study: dict[str, Any], cell: str) -> dict[str, list[RunSpec]]:
    """The arm's report runs of ``cell``, once per form, in seed order."""
    if cell not in study["cells"]:
        raise KeyError(f"cell {cell!r} is not in the study; it has {sorted(study['cells'])}")
    c = study["cells"][cell]
    setting = c["arms"][ARM]["setting"]
    options = dict(study["arms"][ARM]["options"])
    out: dict[str, list[RunSpec]] = {}
    for form in FORMS:
        opts = tuple(sorted({**options, "ns_gram": form}.items()))
        out[form] = [
            RunSpec(
                suite="spectral-paired",
                task=c["task"],
                optimizer=study["arms"][ARM]["optimizer"],
                lr=setting["lr"],
                seed=seed,
                steps=c["steps"],
                weight_decay=setting["weight_decay"],
                clip=1.0,
                options=opts,
                side_lr_mult=setting["side_lr_mult"],
            )
            for seed in study["protocol"]["report_seeds"]
        ]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="run directory (created, or resumed)")
    ap.add_argument("--cells", default="stdlib@150,kjv@150,digits@200")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", default="", help="also write the table as JSON here (a new file)")
    args = ap.parse_args()
    if args.json and os.path.lexists(args.json):
        ap.error(f"--json {args.json}: the file exists; name a new one")
    study = json.loads(STUDY.read_text())
    try:
        plan = {cell: specs_for(study, cell) for cell in args.cells.split(",")}
    except KeyError as exc:
        ap.error(str(exc.args[0]))
    rows: dict[str, Any] = {}
    for cell, by_form in plan.items():
        results = {
            form: run_many(specs, Path(args.out), workers=args.workers, label=f"{cell} {form}")
            for form, specs in by_form.items()
        }
        loss = {}
        for form, rs in results.items():
            if len(rs) != len(by_form[form]) or any(r is None or r["diverged"] for r in rs):
                print(f"{cell}: a {form} run did not finish or diverged", file=sys.stderr)
                return 1
            loss[form] = [float(r["final_test_loss"]) for r in rs if r is not None]
        d = paired_ci(loss["spectral"], loss["off"])
        # The plain form is the study's own arm: its losses must be the committed ones
        # (the study's runs reproduce bit for bit on this code), which checks the setup.
        committed = study["cells"][cell]["arms"][ARM]["test_loss"]
        if len(committed) != len(loss["off"]):
            print(
                f"{cell}: {len(committed)} committed seeds, {len(loss['off'])} run", file=sys.stderr
            )
            return 1
        rows[cell] = {
            "plain": dataclasses.asdict(mean_ci(loss["off"])),
            "spectral": dataclasses.asdict(mean_ci(loss["spectral"])),
            "spectral_minus_plain": dataclasses.asdict(d),
            "plain_reproduces_study": max(
                abs(a - b) for a, b in zip(loss["off"], committed, strict=True)
            ),
            "plain_losses": loss["off"],
            "spectral_losses": loss["spectral"],
        }
    print("\n| cell | plain bf16 | spectral bf16 | spectral − plain, 95 % CI | plain vs study |")
    print("|---|---|---|---|---|")
    for cell, r in rows.items():
        p, s, d = r["plain"], r["spectral"], r["spectral_minus_plain"]
        print(
            f"| {cell} | {p['mean']:.4f} | {s['mean']:.4f} |"
            f" {d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}] |"
            f" {r['plain_reproduces_study']:.1e} |"
        )
    if args.json:
        with open(args.json, "x") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
