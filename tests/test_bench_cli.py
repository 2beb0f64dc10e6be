"""The step bench refuses an existing ``--json`` file before it times anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_step_refuses_an_existing_json_before_running(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    out.write_text("the user's earlier results\n")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_step.py"), "--json", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "the file exists" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""  # nothing was timed
    assert out.read_text() == "the user's earlier results\n"
