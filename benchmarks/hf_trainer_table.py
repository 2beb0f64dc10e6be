"""The table of examples/hf_trainer.py on docs/results/integrations.md, rerun from its command.

Runs ``OMP_NUM_THREADS=1 python examples/hf_trainer.py --optimizer O --seed S`` for the
three optimizers and seeds 0, 1, 2, reads the losses the example prints, and writes them with
the commit and the versions (torch, transformers) to a new JSON file. :func:`render` makes the
table; ``benchmarks/results_pages.py`` renders the page from the committed
``docs/results/hf_trainer.json``.

    python benchmarks/hf_trainer_table.py --json docs/results/hf_trainer.json   # ~5 min
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rootopt_analysis.provenance import git_state

REPO = Path(__file__).resolve().parents[1]
OPTIMIZERS = {
    "root": "`--optimizer root` (the one-liner)",
    "root-bare": "`--optimizer root-bare` (`(ROOT, {...})`)",
    "adamw": "`--optimizer adamw` (Trainer default AdamW, same lr)",
}
SEEDS = (0, 1, 2)
FINAL = re.compile(r"final train loss \(last 5 steps\) ([0-9.]+)\s+eval loss ([0-9.]+)")


def run_all() -> list[dict[str, Any]]:
    rows = []
    for seed in SEEDS:  # seeds outermost: the optimizers of one seed run back to back
        for opt in OPTIMIZERS:
            argv = [sys.executable, str(REPO / "examples" / "hf_trainer.py")]
            argv += ["--optimizer", opt, "--seed", str(seed)]
            done = subprocess.run(
                argv, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
            )
            found = FINAL.search(done.stdout)
            if done.returncode != 0 or found is None:
                raise SystemExit(
                    f"hf_trainer_table: {opt} seed {seed} failed:\n{done.stderr[-3000:]}"
                )
            rows.append(
                {
                    "optimizer": opt,
                    "seed": seed,
                    "train_loss_last5": float(found.group(1)),
                    "eval_loss": float(found.group(2)),
                    "stdout": done.stdout.strip(),
                }
            )
            print(f"{opt} seed {seed}: {found.group(0)}", flush=True)
    return rows


def render(results: dict[str, Any]) -> str:
    rows = results["rows"]
    lines = [
        "| optimizer (examples/hf_trainer.py) | train loss, steps 26–30 (seeds 0, 1, 2) | "
        "eval loss (seeds 0, 1, 2) | eval mean |",
        "|---|---|---|---|",
    ]
    means = {}
    for opt in OPTIMIZERS:
        rs = sorted((r for r in rows if r["optimizer"] == opt), key=lambda r: r["seed"])
        means[opt] = sum(r["eval_loss"] for r in rs) / len(rs)
    best = min(means, key=lambda o: means[o])
    for opt, label in OPTIMIZERS.items():
        rs = sorted((r for r in rows if r["optimizer"] == opt), key=lambda r: r["seed"])
        mean = f"{means[opt]:.3f}"
        train = ", ".join(f"{r['train_loss_last5']:.3f}" for r in rs)
        evals = ", ".join(f"{r['eval_loss']:.3f}" for r in rs)
        lines.append(f"| {label} | {train} | {evals} | {f'**{mean}**' if opt == best else mean} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--json", required=True, help="run the example; write the results to this new file"
    )
    args = ap.parse_args()
    if os.path.lexists(args.json):
        ap.error(f"--json {args.json}: the file exists; name a new one")  # before running
    result = {
        "benchmark": "benchmarks/hf_trainer_table.py",
        **git_state(REPO),
        "date (UTC)": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared with other jobs)",
        "python": platform.python_version(),
        "versions": {
            n: importlib.metadata.version(n) for n in ("torch", "transformers", "accelerate")
        },
        "command": "OMP_NUM_THREADS=1 python examples/hf_trainer.py --optimizer O --seed S",
        "rows": run_all(),
    }
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
