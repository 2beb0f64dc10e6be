"""The README's CPU runs, measured: what the default run's checkpoints cost, and what the
deployment example gives on one CPU.

Each arm is the command a user types (the installed ``rootopt``), in a fresh working
directory, one after the other and interleaved over ``--repeats``:

- ``default``: ``rootopt train`` (300 steps, a checkpoint every 100 steps);
- ``every1000``: ``rootopt train checkpoint.every=1000``, the earlier default (only the final
  checkpoint in a 300-step run);
- ``deployment``: ``rootopt train --config configs/deployment_example.yaml --log_dir runs/a``;
- ``deployment_bf16`` / ``deployment_fp32``: the same for 20 steps, with
  ``mixed_precision.enabled=true`` (bf16 autocast on the CPU, as the example shipped before) /
  ``false``, for their step times only;
- ``*_avx2``: those two with torch's CPU kernels and oneDNN limited to AVX2
  (``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``):
  a CPU without bfloat16 instructions, where bf16 is emulated.

Read back from each run: ``summary.json`` (wall time, losses), ``events.jsonl`` (each
checkpoint's write time, ``seconds``) and ``metrics.jsonl`` (``step_time_s`` per record).
Printed and written (``--json``, a new file): every run, and per arm the medians over the
repeats; for ``default``, the periodic checkpoints' write time as a fraction of the run's
wall time. The git commit of the source tree is recorded.

Usage: python benchmarks/bench_readme_runs.py [--repeats 2] [--json docs/results/readme_runs.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rootopt_analysis.provenance import git_state

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = ["--config", "configs/deployment_example.yaml", "--log_dir", "runs/a"]
BF16 = [*EXAMPLE, "mixed_precision.enabled=true", "run.max_steps=20"]
FP32 = [*EXAMPLE, "mixed_precision.enabled=false", "run.max_steps=20"]
AVX2 = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
# arm -> (arguments after `rootopt train`, environment added)
ARMS: dict[str, tuple[list[str], dict[str, str]]] = {
    "default": ([], {}),
    "every1000": (["checkpoint.every=1000"], {}),
    "deployment": (EXAMPLE, {}),
    "deployment_bf16": (BF16, {}),
    "deployment_fp32": (FP32, {}),
    "deployment_bf16_avx2": (BF16, AVX2),
    "deployment_fp32_avx2": (FP32, AVX2),
}


def _rootopt() -> str:
    here = Path(sys.executable).parent / "rootopt"
    found = str(here) if here.is_file() else shutil.which("rootopt")
    if not found:
        raise SystemExit("bench_readme_runs: the rootopt command is not installed")
    return found


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def run_arm(name: str, rootopt: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"readme-{name}-") as tmp:
        cwd = Path(tmp)
        (cwd / "configs").mkdir()
        shutil.copy(REPO / "configs" / "deployment_example.yaml", cwd / "configs")
        args, extra = ARMS[name]
        t0 = time.perf_counter()
        done = subprocess.run(
            [rootopt, "train", *args],
            cwd=cwd,
            env={**os.environ, **extra},
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        command_s = time.perf_counter() - t0
        if done.returncode != 0:
            raise SystemExit(f"bench_readme_runs: arm {name} failed:\n{done.stdout[-2000:]}")
        (run,) = (cwd / "runs").iterdir()
        summary = json.loads((run / "summary.json").read_text())
        events = _jsonl(run / "events.jsonl")
        steps = [r["step_time_s"] for r in _jsonl(run / "metrics.jsonl") if "step_time_s" in r]
        writes = [e for e in events if e["event"] == "checkpoint"]
        return {
            "arm": name,
            "load_average_1min": round(os.getloadavg()[0], 2),  # other jobs on the machine
            "command": " ".join(
                [*(f"{k}={v}" for k, v in extra.items()), "rootopt", "train", *args]
            ),
            "command_s": round(command_s, 2),
            "wall_s": round(summary["wall_s"], 2),
            "steps": summary["steps"],
            "final_loss": summary["final_loss"],
            "val_loss": summary["val_loss"],
            "median_step_s": statistics.median(steps),
            "precision": next(e["precision"] for e in events if e["event"] == "start"),
            "checkpoints": [
                {"step": e["step"], "reason": e["reason"], "seconds": e["seconds"]} for e in writes
            ],
        }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ARMS:
        rs = [r for r in runs if r["arm"] == name]
        periodic = [
            sum(c["seconds"] for c in r["checkpoints"] if c["reason"] == "periodic") for r in rs
        ]
        one = [c["seconds"] for r in rs for c in r["checkpoints"]]
        out[name] = {
            "runs": len(rs),
            "wall_s": statistics.median(r["wall_s"] for r in rs),
            "wall_s_range": [min(r["wall_s"] for r in rs), max(r["wall_s"] for r in rs)],
            "command_s": statistics.median(r["command_s"] for r in rs),
            "median_step_s": statistics.median(r["median_step_s"] for r in rs),
            "final_loss": statistics.median(r["final_loss"] for r in rs),
            "val_loss": statistics.median(r["val_loss"] for r in rs),
            "checkpoint_count": statistics.median(len(r["checkpoints"]) for r in rs),
            "periodic_checkpoints": statistics.median(
                sum(c["reason"] == "periodic" for c in r["checkpoints"]) for r in rs
            ),
            "checkpoint_write_s": statistics.median(one) if one else None,
            "periodic_write_s": statistics.median(periodic),
            "periodic_fraction_of_wall": statistics.median(
                p / r["wall_s"] for p, r in zip(periodic, rs, strict=True)
            ),
        }
    for cpu in ("", "_avx2"):
        bf16, fp32 = out[f"deployment_bf16{cpu}"], out[f"deployment_fp32{cpu}"]
        out[f"bf16_over_fp32_step_time{cpu}"] = bf16["median_step_s"] / fp32["median_step_s"]
    return out


def _cpu() -> dict[str, Any]:
    """What decides bf16's speed on this CPU: its model, bfloat16 instructions, torch's level."""
    import torch

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    flags = set(" ".join(ln for ln in info.splitlines() if ln.startswith("flags")).split())
    model = next(
        (ln.split(":", 1)[1].strip() for ln in info.splitlines() if "model name" in ln), ""
    )
    return {
        "model": model or platform.processor(),
        "bf16_instructions": sorted(flags & {"avx512_bf16", "amx_bf16"}),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def sentences(result: dict[str, Any]) -> dict[str, str]:
    """The statement README.md makes from ``result`` (a test checks that the README holds it
    verbatim); docs/results/training.md is rendered from the same file by
    ``benchmarks/results_pages.py``."""
    dep = result["summary"]["deployment"]
    minutes = dep["command_s"] / 60
    return {
        "readme-deployment": (
            "# the deployment guide's config for 8 GPUs, here one CPU process in fp32 "
            f"({minutes:.0f} min, val loss {dep['val_loss']:.2f})"
        ),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset")
    ap.add_argument("--json", default="", help="write the results to this new file")
    args = ap.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad or args.repeats < 1:
        ap.error(f"unknown arm(s) {bad} (choose from {', '.join(ARMS)}) or --repeats < 1")
    if args.json and os.path.lexists(args.json):
        ap.error(f"--json {args.json}: the file exists; name a new one")  # before measuring
    rootopt = _rootopt()
    import torch

    provenance = git_state(REPO)  # the tree that runs (the page may change while it runs)
    runs = []
    for rep in range(args.repeats):
        for name in arms:
            r = run_arm(name, rootopt)
            runs.append(r)
            print(
                f"[{rep + 1}/{args.repeats}] {name}: {r['steps']} steps, wall {r['wall_s']:.1f} s, "
                f"step {1e3 * r['median_step_s']:.0f} ms, loss {r['final_loss']:.3f}, "
                f"val {r['val_loss']:.3f}, checkpoints "
                + ", ".join(f"{c['step']} ({c['seconds']:.3f} s)" for c in r["checkpoints"]),
                flush=True,
            )
    result = {
        "benchmark": "benchmarks/bench_readme_runs.py",
        **provenance,
        "date (UTC)": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared with other jobs)",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": _cpu(),
        "runs": runs,
        "summary": summarize(runs) if set(arms) == set(ARMS) else None,
    }
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
