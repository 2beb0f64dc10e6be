"""The measured tables of docs/outlook.md, regenerated from the commands and seeds it states.

Runs every command of the page (``rootopt anneal head ... --json``, ``rootopt rl train``,
``rootopt rl eval ... --json``) as a user would, one after the other, collects their raw rows
with the commit, the package versions and the machine into one JSON file, and renders the
page's tables from that file. The page holds each table between ``<!-- outlook:NAME -->``
and ``<!-- /outlook:NAME -->``; ``tests/test_first_hour.py`` checks that they equal what
:func:`render` makes of the committed ``docs/results/outlook.json``.

    python benchmarks/outlook_tables.py --json docs/results/outlook.json   # ~30 min on 2 cores
    python benchmarks/outlook_tables.py --render docs/results/outlook.json --write docs/outlook.md
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from rootopt_analysis.provenance import git_state

REPO = Path(__file__).resolve().parents[1]
POLICY = "POLICY"  # replaced by the policy directory of this run
ANNEAL = ["anneal", "head", "--steps", "100", "--seeds", "0,1,2"]
COMMANDS: dict[str, list[str]] = {
    "anneal-bbc-0.02": [*ANNEAL, "--task", "bbc", "--s", "0.02"],
    "anneal-bbc-0.05": [
        *ANNEAL,
        "--task",
        "bbc",
        "--s",
        "0.05",
        "--methods",
        "qubo,sign,rounded-root",
    ],
    "anneal-bbc-0.1": [
        *ANNEAL,
        "--task",
        "bbc",
        "--s",
        "0.1",
        "--methods",
        "qubo,sign,rounded-root",
    ],
    "anneal-bbc-0.05-tabu": [
        *ANNEAL,
        "--task",
        "bbc",
        "--s",
        "0.05",
        "--methods",
        "qubo",
        "--sampler",
        "tabu",
    ],
    "anneal-digits-0.02": [*ANNEAL, "--task", "digits", "--hidden", "1", "--s", "0.02"],
    "rl-train": ["rl", "train", "--out", POLICY, "--timesteps", "6000", "--seed", "0"],
    "rl-heldout": ["rl", "eval", POLICY, "--seeds", "0,1,2"],
    "rl-training": [
        "rl",
        "eval",
        POLICY,
        "--tasks",
        "stdlib-d32,digits-w8,bbc-h32",
        "--seeds",
        "0,1,2",
    ],
    "rl-constant": ["rl", "eval", POLICY, "--seeds", "0,1,2", "--base-lr", "0.1125"],
}
PACKAGES = (
    "torch",
    "numpy",
    "dimod",
    "dwave-samplers",
    "stable-baselines3",
    "sb3-contrib",
    "gymnasium",
    "scikit-learn",
)


def _versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def run_all(names: list[str]) -> dict[str, Any]:
    rootopt = shutil.which("rootopt", path=str(Path(sys.executable).parent)) or "rootopt"
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="outlook-") as tmp:
        policy = str(Path(tmp) / "policy")
        for name in names:
            argv = [policy if a == POLICY else a for a in COMMANDS[name]]
            raw = Path(tmp) / f"{name}.json"
            extra = [] if name == "rl-train" else ["--json", str(raw)]
            t0 = time.perf_counter()
            done = subprocess.run(
                [rootopt, *argv, *extra],
                capture_output=True,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            wall = time.perf_counter() - t0
            if done.returncode != 0:
                raise SystemExit(f"outlook_tables: {name} failed:\n{done.stderr[-3000:]}")
            entry: dict[str, Any] = {
                "command": " ".join(["rootopt", *COMMANDS[name]]).replace(POLICY, "policy6k"),
                "wall_s": round(wall, 1),
            }
            if name == "rl-train":
                prov = json.loads((Path(policy) / "provenance.json").read_text())
                entry["episode_returns"] = prov["episode_returns"]
                entry["train_seconds"] = prov["train_seconds"]
                entry["stdout"] = done.stdout.strip().replace(policy, "policy6k")
            else:
                entry["rows"] = json.loads(raw.read_text())
            results[name] = entry
            print(f"{name}: {wall:.0f} s", flush=True)
    return results


# --------------------------------------------------------------------------- render


def _pm(values: list[float]) -> str:
    v = np.array(values, dtype=float)
    return f"{v.mean():.4f} ± {v.std():.4f}"


def _anneal_table(groups: list[tuple[str, list[dict[str, Any]]]]) -> str:
    """One row per (s, method[, sampler]) of the page's condensed table."""
    lines = [
        "| s | method | val loss | val acc | solver s/step | moved | model value QUBO δ / sign δ |",
        "|---|---|---|---|---|---|---|",
    ]
    for s, rows in groups:
        keys = list(
            dict.fromkeys(
                (r["method"], r["sampler"] if r["method"] == "qubo" else "") for r in rows
            )
        )
        methods = list(dict.fromkeys(m for m, _ in keys))
        keys.sort(key=lambda k: methods.index(k[0]))  # a method's samplers side by side
        for method, smp in keys:
            rs = [r for r in rows if r["method"] == method and (not smp or r["sampler"] == smp)]
            label = f"{method} ({smp})" if smp else method
            model = (
                f"{np.mean([r['model_qubo'] for r in rs]):.4g} / "
                f"{np.mean([r['model_sign'] for r in rs]):.4g}"
                if rs[0].get("model_qubo") is not None
                else "—"
            )
            lines.append(
                f"| {s} | {label} | {_pm([r['final_val_loss'] for r in rs])} | "
                f"{_pm([r['final_val_acc'] for r in rs])} | "
                f"{np.mean([r['solver_s_per_step'] for r in rs]):.3f} | "
                f"{np.mean([r['moved_fraction'] for r in rs]):.2f} | {model} |"
            )
    return "\n".join(lines)


def _constant_table(heldout: list[dict[str, Any]], constant: list[dict[str, Any]]) -> str:
    lines = [
        "| task | ROOT lr 0.03 | ROOT lr 0.1125 (constant ×3.75) | ROOT + controller (base 0.03) |",
        "|---|---|---|---|",
    ]
    for task in dict.fromkeys(r["task"] for r in heldout):
        base = [r["final_val_loss"] for r in heldout if r["task"] == task and not r["controller"]]
        ctl = [r["final_val_loss"] for r in heldout if r["task"] == task and r["controller"]]
        high = [r["final_val_loss"] for r in constant if r["task"] == task and not r["controller"]]
        lines.append(f"| {task} | {_pm(base)} | {_pm(high)} | {_pm(ctl)} |")
    return "\n".join(lines)


def render(results: dict[str, Any]) -> dict[str, str]:
    """The page's tables, by marker name, from the raw results."""
    from rootopt.rl.train import table as rl_table

    r = results["runs"]
    bbc = [
        ("0.02", r["anneal-bbc-0.02"]["rows"]),
        ("0.05", r["anneal-bbc-0.05"]["rows"] + r["anneal-bbc-0.05-tabu"]["rows"]),
        ("0.1", r["anneal-bbc-0.1"]["rows"]),
    ]
    return {
        "rl-heldout": rl_table(r["rl-heldout"]["rows"]),
        "rl-training": rl_table(r["rl-training"]["rows"]),
        "rl-constant": _constant_table(r["rl-heldout"]["rows"], r["rl-constant"]["rows"]),
        "anneal-bbc": _anneal_table(bbc),
        "anneal-digits": _anneal_table([("0.02", r["anneal-digits-0.02"]["rows"])]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--json", required=True, help="run every command; write the results to this new file"
    )
    args = ap.parse_args()
    if os.path.lexists(args.json):
        ap.error(f"--json {args.json}: the file exists; name a new one")  # before running
    import torch

    result = {
        "benchmark": "benchmarks/outlook_tables.py",
        **git_state(REPO),
        "date (UTC)": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared with other jobs)",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "versions": _versions(),
        "runs": run_all(list(COMMANDS)),
    }
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print("\n\n".join(f"{k}:\n{v}" for k, v in render(result).items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
