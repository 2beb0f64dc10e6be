"""``rootopt bench``: the --quick pipeline end to end, resume, ownership, and the pieces it uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rootopt.optim.registry import REGISTRY
from rootopt_analysis.bench.runner import Corruption, RunSpec, _corrupt, run_one
from rootopt_analysis.bench.suites import DEFAULT_TASKS as TASKS
from rootopt_analysis.bench.suites import smoothness, steps_to_target
from rootopt_analysis.commands.bench import main as bench_main

PATHS = os.pathsep.join(str(Path(__file__).resolve().parents[1] / d) for d in ("src", "analysis"))


def _bench(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": PATHS, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "rootopt.cli", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_quick_suite_runs_every_optimizer_on_every_task_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    p = _bench(["all", "--quick", "--out", str(out)], timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads((out / "results.json").read_text())
    assert set(res) == {"convergence", "lr_robustness", "robustness", "overhead", "meta"}
    conv = res["convergence"]["tasks"]
    assert sorted(conv) == sorted(TASKS)
    for task, tv in conv.items():
        assert sorted(tv["optimizers"]) == sorted(REGISTRY), task
        assert tv["target_val_loss"] == pytest.approx(
            tv["optimizers"]["adamw"]["final_val_loss"][0]
        )
    runs = [json.loads(f.read_text()) for f in sorted((out / "runs").glob("*.json"))]
    # 16 optimizers x 4 tasks x 1 lr (the seed stage reuses them) + robustness runs
    assert len(runs) == len(REGISTRY) * len(TASKS) + 5 * 2
    for r in runs:  # every run trained its steps, or stopped on a recorded divergence
        assert r["steps_done"] == r["spec"]["steps"] or r["diverged"], r["run_id"]
        assert r["error"] == "" or r["diverged"]
    assert len(res["overhead"]["models"]["lm-d64"]["optimizers"]) == len(REGISTRY)
    assert res["overhead"]["matmul"]["peak_gflops"] > 0
    for name in ("curves", "lr", "robustness", "overhead"):
        assert (out / f"bench_{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "report.md").read_text()
    for heading in ("## Convergence", "## lr robustness", "## Robustness", "## Overhead"):
        assert heading in md
    # Resume: nothing is recomputed, finished run files are untouched.
    stamps = {f.name: f.stat().st_mtime_ns for f in (out / "runs").glob("*.json")}
    p2 = _bench(["convergence", "--quick", "--out", str(out)], timeout=300)
    assert p2.returncode == 0, p2.stderr[-2000:]
    assert f"{len(REGISTRY) * len(TASKS)} finished runs reused, 0 to run" in p2.stderr
    assert stamps == {f.name: f.stat().st_mtime_ns for f in (out / "runs").glob("*.json")}


def test_refuses_a_directory_it_does_not_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mine = tmp_path / "notes.txt"
    mine.write_text("user data")
    assert bench_main(["overhead", "--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not written by rootopt bench" in err[0]
    assert mine.read_text() == "user data" and sorted(tmp_path.iterdir()) == [mine]


def test_bad_names_are_user_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        bench_main(["convergence", "--optimizers", "adamw,adamx", "--out", str(tmp_path / "o")])
        == 2
    )
    err = capsys.readouterr().err
    assert "unknown optimizer 'adamx'" in err and "Traceback" not in err
    assert bench_main(["convergence", "--tasks", "mnist", "--out", str(tmp_path / "o")]) == 2
    assert "unknown task 'mnist'" in capsys.readouterr().err


def test_outlier_corruption_hits_the_requested_fraction() -> None:
    p = torch.nn.Parameter(torch.zeros(200, 500))
    p.grad = torch.ones(200, 500)
    _corrupt([p], Corruption("outliers", scale=100.0, rate=0.01), torch.Generator().manual_seed(0))
    hit = (p.grad - 1).abs() > 1
    assert hit.float().mean().item() == pytest.approx(0.01, rel=0.1)
    assert set((p.grad[hit] - 1).abs().unique().tolist()) == {100.0}  # ± scale · rms (rms = 1)


def test_student_t_corruption_is_heavy_tailed_and_repeatable() -> None:
    def noise(seed: int) -> torch.Tensor:
        p = torch.nn.Parameter(torch.zeros(100, 1000))
        p.grad = torch.ones(100, 1000)
        _corrupt([p], Corruption("student_t", scale=1.0, df=2), torch.Generator().manual_seed(seed))
        return p.grad - 1

    a, b = noise(0), noise(0)
    assert torch.equal(a, b)
    # t(2): P(|t| > 10) = 1 - 10/sqrt(102) ≈ 0.0099; a Gaussian would give ~1e-23.
    assert (a.abs() > 10).float().mean().item() == pytest.approx(0.0099, rel=0.15)


def test_steps_to_target_and_smoothness() -> None:
    r = {
        "diverged": False,
        "evals": [
            {"step": 0, "val_loss": 5.0, "train_s": 0.0},
            {"step": 10, "val_loss": 3.0, "train_s": 1.0},
            {"step": 20, "val_loss": 2.0, "train_s": 2.5},
        ],
    }
    assert steps_to_target(r, 2.5) == (20, 2.5)
    assert steps_to_target(r, 1.0) == (None, None)
    assert steps_to_target({**r, "diverged": True}, 4.0) == (None, None)
    assert smoothness([1.0] * 50) == pytest.approx(0.0, abs=1e-12)
    line = smoothness([1.0 - 0.01 * i for i in range(50)], beta=0.0)
    zigzag = smoothness([1.0 + 0.1 * (-1) ** i for i in range(50)], beta=0.0)
    assert line == pytest.approx(0.0, abs=1e-12) and zigzag == pytest.approx(0.4)


def test_a_blown_up_run_is_recorded_as_diverged(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    spec = RunSpec("t", "digits", "sgd", lr=1e4, seed=0, steps=20, weight_decay=0.0, clip=None)
    r = run_one(spec, str(tmp_path))
    assert r["diverged"] and r["error"]
    assert json.loads((tmp_path / "runs" / f"{spec.run_id}.json").read_text())["diverged"]
    ok = run_one(RunSpec("t", "digits", "adamw", 3e-3, 0, 20, 0.1), str(tmp_path))
    assert not ok["diverged"] and ok["final_val_loss"] < ok["initial_val_loss"]


def test_an_in_process_run_leaves_the_thread_count_as_it_was(tmp_path: Path) -> None:
    """A run trains on one thread but must not change the caller's process-wide setting
    (an in-process call used to leave torch on one thread, so a later fresh process with
    the default count computed different reductions)."""
    (tmp_path / "runs").mkdir()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run_one(RunSpec("t", "digits", "adamw", 3e-3, 0, 2, 0.1), str(tmp_path))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
