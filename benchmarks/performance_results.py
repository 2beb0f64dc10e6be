"""The measurements behind docs/performance.md, rerun from the commands its results page names.

Runs ``benchmarks/bench_step.py`` (operation counts, step times, per-shape Newton–Schulz
against the matmul peak; a process group named by ``$ROOTOPT_BENCH_PAUSE_PGID``, such as a
background study, is paused while it times), ``benchmarks/bench_gram.py`` (accuracy of the Gram and plain iterations) and
``benchmarks/bench_memory.py`` (peak memory per path), one after the other, and collects their
JSON with the commit and the machine into one file. docs/results/performance.md is rendered
from that file by ``benchmarks/results_pages.py``.

    python benchmarks/performance_results.py --json docs/results/performance.json   # ~10 min
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rootopt_analysis.provenance import cpu_name, git_state, others_paused

REPO = Path(__file__).resolve().parents[1]
OUT = "OUT"
COMMANDS: dict[str, list[str]] = {
    "step": ["benchmarks/bench_step.py", "--threads", "1", "--rounds", "9", "--json", OUT],
    "gram": [
        "benchmarks/bench_gram.py",
        "--shapes",
        "128x448,256x1024,192x768",
        "--draws",
        "6",
        "--json",
        OUT,
    ],
    "memory": ["benchmarks/bench_memory.py", "--count", "32", "--shape", "512x2048", "--json", OUT],
}
TIMED = {"step"}  # runs with the background study paused


def run_all() -> dict[str, Any]:
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="performance-") as tmp:
        for name, argv in COMMANDS.items():
            raw = Path(tmp) / f"{name}.json"
            args = [str(raw) if a == OUT else a for a in argv]
            t0 = time.perf_counter()
            with others_paused(name in TIMED):
                load = os.getloadavg()[0]
                done = subprocess.run(
                    [sys.executable, *args],
                    capture_output=True,
                    text=True,
                    cwd=REPO,
                    env={**os.environ, "OMP_NUM_THREADS": "1"},
                )
            wall = time.perf_counter() - t0
            if done.returncode != 0:
                raise SystemExit(f"performance_results: {name} failed:\n{done.stderr[-3000:]}")
            runs[name] = {
                "command": "python " + " ".join(f"{name}.json" if a == OUT else a for a in argv),
                "wall_s": round(wall, 1),
                "load_average_at_start": round(load, 2),
                "result": json.loads(raw.read_text()),
            }
            print(f"{name}: {wall:.0f} s", flush=True)
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", required=True, help="write the results to this new file")
    args = ap.parse_args()
    if os.path.lexists(args.json):
        ap.error(f"{args.json}: the file exists; name a new one")  # before running anything
    import torch

    result = {
        "benchmark": "benchmarks/performance_results.py",
        **git_state(REPO, "src"),
        "date (UTC)": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": f"{cpu_name()}, {os.cpu_count()} CPUs (shared with other jobs)",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "runs": run_all(),
    }
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
