"""benchmarks/device_check.sh, the GPU check: its dry mode (what CI runs on machines without
a GPU: it parses, plans and skips every part, exit 0), its refusal of an existing output,
and how it reads the results of a real run (pytest's JUnit XML, a run's metrics.jsonl)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT_DIR = Path(__file__).resolve().parents[1]
SCRIPT = ROOT_DIR / "benchmarks" / "device_check.sh"


def _module() -> Any:
    sys.path.insert(0, str(ROOT_DIR / "benchmarks"))
    try:
        import device_check
    finally:
        sys.path.pop(0)
    return device_check


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT_DIR,
        env={**os.environ, "PYTHON": sys.executable},
    )


def test_dry_mode_plans_every_part_and_skips_it(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    proc = _run(str(out), "--dry")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    rec = json.loads(out.read_text())
    assert rec["kind"] == "device_check" and rec["mode"] == "dry"
    assert rec["budget_s"] <= 480
    parts = rec["parts"]
    assert sorted(parts) == ["step", "tests", "train"]
    assert sum(p["limit_s"] for p in parts.values()) <= rec["budget_s"]
    for name, part in parts.items():
        assert part["status"] == "skipped" and part["reason"] == "--dry", name
        assert part["plan"] == "ok", (name, part["plan"])  # collected, parsed, validated
        assert part["command"][0] == "python"
        # no machine paths in what the docs are generated from
        assert not any(str(ROOT_DIR) in c or c.startswith("/tmp") for c in part["command"])
    assert "-m" in parts["tests"]["command"] and "cuda" in parts["tests"]["command"]
    assert "rootopt.train" in parts["train"]["command"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real check")
def test_without_cuda_it_skips_with_the_reason(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    proc = _run(str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rec = json.loads(out.read_text())
    assert rec["mode"] == "dry"
    assert {p["reason"] for p in rec["parts"].values()} == {"no CUDA device"}
    assert "no CUDA device: planned tests, step, train; nothing run" in proc.stdout


def test_an_existing_output_is_refused_and_kept(tmp_path: Path) -> None:
    out = tmp_path / "mine.json"
    out.write_text("mine")
    proc = _run(str(out), "--dry")
    assert proc.returncode == 2
    assert "the file exists; name a new one" in proc.stderr and "Traceback" not in proc.stderr
    assert out.read_text() == "mine"
    proc = _run(str(tmp_path / "no" / "such.json"), "--dry")
    assert proc.returncode == 2 and "no such directory" in proc.stderr


def test_results_of_a_run_are_read_from_pytest_and_metrics(tmp_path: Path) -> None:
    """In-process: the parsers of a real run's outputs."""
    dc = _module()
    xml = tmp_path / "t.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_cuda" name="test_a"/>'
        '<testcase classname="tests.test_cuda" name="test_b"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_dist" name="test_c"><skipped message="y"/></testcase>'
        "</testsuite></testsuites>"
    )
    got = dc._tests_result(xml)
    assert (got["passed"], got["failed"], got["skipped"]) == (1, 1, 1)
    assert got["cases"]["tests.test_cuda::test_b"] == "failed"
    run = tmp_path / "train"
    run.mkdir()
    rows = [
        {"step": s, "loss": 5.0 - s / 10, "steps_per_s": 10.0 + s, "tokens_per_s": 100.0 * s}
        for s in range(1, 21)
    ]
    rows[-1]["mfu"] = 0.25
    rows.insert(3, {"step": 3, "val_loss": 4.0})  # not a training record
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = dc._train_result(run)
    assert t["steps"] == 20
    assert t["tokens_per_s"] == pytest.approx(100.0 * 15.5)  # median of steps 11-20
    assert t["steps_per_s"] == pytest.approx(25.5)
    assert t["mfu"] == 0.25 and t["final_loss"] == pytest.approx(3.0)
    assert dc._shown([sys.executable, "/x/WORKDIR/a"], "/x/WORKDIR") == ["python", "WORK/a"]
