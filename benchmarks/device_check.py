"""The GPU check of distributed ROOT, on a machine with one CUDA device, in under 8 minutes
(``benchmarks/device_check.sh`` runs it). Three parts, each under its own time limit:

1. ``tests``: the CUDA tests (``-m cuda``: tests/test_cuda.py, and NCCL at world size 1
   through DistributedROOT's sharded path, tests/test_dist.py);
2. ``step``: the optimizer step table against ``torch.optim.Muon``, each at its CUDA
   default (benchmarks/bench_step_device.py: ROOT float32 and bfloat16 iteration, its Muon
   mode, torch's Muon in bfloat16);
3. ``train``: ``rootopt train`` on the embedded default model on the GPU: tokens/s, steps/s
   and, where the run logs it, MFU (median over the steps after the first ``WARMUP``).

It writes one JSON (``OUT``, a new file): the machine, the commit, and per part its
command, status (``passed``, ``failed``, ``timed out``, ``skipped``), seconds and results;
``benchmarks/render_dist_results.py`` turns it into the GPU tables of
docs/results/distributed.md.

``--dry`` (and any machine without CUDA): parse and plan only: every command is built,
the test ids are collected, the benchmark's and the training command's arguments are
checked, the config is validated, and each part is recorded ``skipped`` with the reason;
exit 0. CI runs this (tests/test_dist_device.py).

Usage: python benchmarks/device_check.py OUT.json [--dry]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT_DIR = HERE.parent
BUDGET_S = 480  # the whole check, on one GPU
# each part's limit (their sum stays within BUDGET_S with room for start-up)
LIMITS = {"tests": 170.0, "step": 150.0, "train": 130.0}
TESTS = [
    "tests/test_cuda.py",
    "tests/test_dist.py::test_nccl_one_gpu_sharded_path_matches_single_process",
]
TRAIN_STEPS = 60
WARMUP = 10  # steps left out of the throughput medians (compilation, allocator warm-up)
TRAIN_SET = [
    f"run.max_steps={TRAIN_STEPS}",
    "run.log_every=1",
    "run.eval_every=0",
    f"checkpoint.every={TRAIN_STEPS}",
    "monitoring.progress_bar=false",
    "monitoring.tensorboard=false",
    "monitoring.plot=false",
    "monitoring.histogram_every=0",
    "run.device=cuda",
]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # rootopt and rootopt-analysis (the step table's operation counter) of this checkout
    paths = [str(ROOT_DIR / d) for d in ("src", "analysis")]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    return env


def _run(cmd: list[str], limit: float) -> tuple[str, float, str]:
    """(status, seconds, the output's tail) of one command under ``limit`` seconds."""
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT_DIR, env=_env(), capture_output=True, text=True, timeout=limit
        )
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return "timed out", time.monotonic() - start, out[-3000:]
    status = "passed" if proc.returncode == 0 else "failed"
    return status, time.monotonic() - start, (proc.stdout + proc.stderr)[-3000:]


def commands(work: Path) -> dict[str, list[str]]:
    py = sys.executable
    return {
        "tests": [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda",
                  f"--junitxml={work / 'tests.xml'}", *TESTS],
        "step": [py, "benchmarks/bench_step_device.py", "--device", "cuda", "--reps", "5",
                 "--json", str(work / "step.json")],
        "train": [py, "-m", "rootopt.train", "--log_dir", str(work / "train"), *TRAIN_SET],
    }  # fmt: skip


def _shown(cmd: list[str], work: str) -> list[str]:
    """A command as the JSON records it: the interpreter as ``python``, the scratch
    directory as ``WORK`` (no machine paths in what the docs are generated from)."""
    return ["python" if c == sys.executable else c.replace(work, "WORK") for c in cmd]


def _machine() -> dict[str, Any]:
    import torch

    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT_DIR), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        commit = ""
    cuda = torch.cuda.is_available()
    return {
        "commit": commit,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
    }


def _tests_result(xml: Path) -> dict[str, Any]:
    """Per test id: passed / failed / skipped, from pytest's JUnit XML."""
    import xml.etree.ElementTree as ET

    out: dict[str, str] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        tid = f"{case.get('classname')}::{case.get('name')}"
        kind = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                kind = "failed"
            elif child.tag == "skipped":
                kind = "skipped"
        out[tid] = kind
    return {"cases": out, "passed": sum(v == "passed" for v in out.values()),
            "failed": sum(v == "failed" for v in out.values()),
            "skipped": sum(v == "skipped" for v in out.values())}  # fmt: skip


def _train_result(run: Path) -> dict[str, Any]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    steps = [r for r in recs if r.get("loss") is not None and "steps_per_s" in r]
    later = [r for r in steps if r["step"] > WARMUP] or steps

    def med(key: str) -> float | None:
        vals = [r[key] for r in later if isinstance(r.get(key), (int, float))]
        return statistics.median(vals) if vals else None

    return {
        "steps": len(steps),
        "tokens_per_s": med("tokens_per_s"),
        "steps_per_s": med("steps_per_s"),
        "mfu": med("mfu"),
        "first_loss": steps[0]["loss"] if steps else None,
        "final_loss": steps[-1]["loss"] if steps else None,
    }


def dry_checks(cmds: dict[str, list[str]]) -> dict[str, str]:
    """What can be checked without a GPU: the test ids collect, the benchmark parses its
    arguments, the training command's config is valid. A problem is a line per part."""
    problems: dict[str, str] = {}
    collect = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
               "-m", "cuda", *TESTS]  # fmt: skip
    status, _, out = _run(collect, 120)
    if status != "passed" or "test_nccl_one_gpu_sharded_path_matches_single_process" not in out:
        problems["tests"] = "the CUDA test ids did not collect: " + out.strip()[-300:]
    status, _, out = _run([*cmds["step"][:2], "--help"], 60)
    if status != "passed" or "--device" not in out:
        problems["step"] = "bench_step_device.py --help failed: " + out.strip()[-300:]
    from rootopt.config import ConfigError, load_config

    try:
        load_config(None, TRAIN_SET)
    except ConfigError as exc:
        problems["train"] = f"the training overrides are refused: {exc}"
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the JSON to write (a new file)")
    ap.add_argument("--dry", action="store_true", help="parse and plan only (no GPU needed)")
    a = ap.parse_args()
    out = Path(a.out)
    if os.path.lexists(out):
        ap.error(f"{a.out}: the file exists; name a new one")
    if not out.parent.is_dir():
        ap.error(f"{a.out}: no such directory {str(out.parent)!r}")
    import torch

    cuda = torch.cuda.is_available()
    dry = a.dry or not cuda
    reason = "--dry" if a.dry else ("no CUDA device" if not cuda else "")
    start = time.monotonic()
    report: dict[str, Any] = {
        "kind": "device_check",
        "mode": "dry" if dry else "run",
        "machine": _machine(),
        "budget_s": BUDGET_S,
        "parts": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cmds = commands(work)
        if dry:
            problems = dry_checks(cmds)
            for part, cmd in cmds.items():
                report["parts"][part] = {
                    "command": _shown(cmd, tmp),
                    "limit_s": LIMITS[part],
                    "status": "skipped",
                    "reason": reason,
                    "plan": problems.get(part, "ok"),
                }
            print(f"device check: {reason}: planned {', '.join(cmds)}; nothing run")
            for part, line in problems.items():
                print(f"  {part}: {line}")
        else:
            for part, cmd in cmds.items():
                left = BUDGET_S - (time.monotonic() - start)
                status, secs, tail = _run(cmd, min(LIMITS[part], max(left, 1.0)))
                rec: dict[str, Any] = {"command": _shown(cmd, tmp), "limit_s": LIMITS[part],
                                       "status": status, "seconds": round(secs, 1)}  # fmt: skip
                try:
                    if part == "tests" and (work / "tests.xml").is_file():
                        rec["result"] = _tests_result(work / "tests.xml")
                    elif part == "step" and (work / "step.json").is_file():
                        rec["result"] = json.loads((work / "step.json").read_text())
                    elif part == "train" and (work / "train" / "metrics.jsonl").is_file():
                        rec["result"] = _train_result(work / "train")
                except (OSError, ValueError) as exc:
                    rec["result_error"] = f"{type(exc).__name__}: {exc}"
                if status != "passed":
                    rec["output"] = tail.replace(tmp, "WORK")
                report["parts"][part] = rec
                print(f"device check: {part}: {status} in {secs:.0f} s", flush=True)
        report["seconds"] = round(time.monotonic() - start, 1)
        with open(out, "x") as fh:
            json.dump(report, fh, indent=1)
    if dry:
        return 1 if any(p["plan"] != "ok" for p in report["parts"].values()) else 0
    return 0 if all(p["status"] == "passed" for p in report["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
