"""The measurements behind docs/adanewton.md, rerun from the commands its results page names.

Runs, as a user would and one after the other, ``rootopt coeffs families`` (float32 and
bfloat16 iterations), ``rootopt coeffs bench`` (the shipped table's shapes, with the real
iteration checked on three shapes, and its plot) and ``rootopt coeffs heldout`` (matrices
recorded from short training runs, in a fresh directory), and collects their JSON with the
commit, the package versions and the machine into one file. docs/results/adanewton.md is
rendered from that file by ``benchmarks/results_pages.py``.

    python benchmarks/adanewton_results.py --json docs/results/adanewton.json \\
        --plot docs/img/adanewton_bench.png            # ~5-8 min on 2 cores
"""

from __future__ import annotations

import argparse
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

from rootopt_analysis.provenance import cpu_name, git_state

REPO = Path(__file__).resolve().parents[1]
OUT, PLOT, RECORDINGS = "OUT", "PLOT", "RECORDINGS"  # replaced per run
COMMANDS: dict[str, list[str]] = {
    "families-float32": ["coeffs", "families", "--json", OUT],
    "families-bfloat16": ["coeffs", "families", "--dtype", "bfloat16", "--json", OUT],
    "bench": [
        "coeffs",
        "bench",
        "--matrix-check",
        "64x256,128x128,96x384",
        "--json",
        OUT,
        "--plot",
        PLOT,
    ],
    "heldout": ["coeffs", "heldout", "--out", RECORDINGS, "--json", OUT],
}


def run_all(plot: str) -> dict[str, Any]:
    rootopt = shutil.which("rootopt", path=str(Path(sys.executable).parent)) or "rootopt"
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="adanewton-") as tmp:
        for name, argv in COMMANDS.items():
            raw = Path(tmp) / f"{name}.json"
            subs = {OUT: str(raw), PLOT: plot, RECORDINGS: str(Path(tmp) / "recordings")}
            t0 = time.perf_counter()
            done = subprocess.run(
                [rootopt, *(subs.get(a, a) for a in argv)],
                capture_output=True,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1", "ROOTOPT_CACHE_DIR": tmp},
                cwd=tmp,
            )
            wall = time.perf_counter() - t0
            if done.returncode != 0:
                raise SystemExit(f"adanewton_results: {name} failed:\n{done.stderr[-3000:]}")
            shown = {OUT: f"{name}.json", PLOT: "docs/img/adanewton_bench.png", RECORDINGS: "DIR"}
            # the tools record their argv: name the scratch directory as the command shows it
            text = raw.read_text().replace(subs[RECORDINGS], "DIR").replace(str(raw), shown[OUT])
            runs[name] = {
                "command": " ".join(["rootopt", *(shown.get(a, a) for a in argv)]),
                "wall_s": round(wall, 1),
                "result": json.loads(text.replace(tmp, "TMP")),
            }
            print(f"{name}: {wall:.0f} s", flush=True)
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", required=True, help="write the results to this new file")
    ap.add_argument("--plot", required=True, help="write the bench's plot to this new file")
    args = ap.parse_args()
    for path in (args.json, args.plot):
        if os.path.lexists(path):
            ap.error(f"{path}: the file exists; name a new one")  # before running anything
    import torch

    result = {
        "benchmark": "benchmarks/adanewton_results.py",
        **git_state(REPO, "src"),
        "date (UTC)": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": f"{cpu_name()}, {os.cpu_count()} CPUs (shared with other jobs)",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": 1,
        "runs": run_all(str(Path(args.plot).resolve())),
    }
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
