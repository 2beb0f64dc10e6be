"""A new user's first hour: the README's and the docs' first commands behave as written.

Output piped into a reader that leaves (``rootopt report RUN | head -1``) ends quietly;
``rootopt bench --finished-only`` runs and writes nothing where nothing finished;
``rootopt bench --help`` without an extra names it; what docs/adanewton.md shows works after a
bare ``import rootopt``; a warmup longer than the run is warned about; the deployment example
autocasts on CUDA only; the default run checkpoints often enough that a restarted rank
resumes (README: "a rank that dies is restarted, and the job resumes from the last
checkpoint").
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from _faultkit import console_script, env, kill_session, start_session, tree_state, wait_for
from _train_fixtures import FAST, prepare_tiny
from rootopt import cli
from rootopt.config import Config, load_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "configs" / "deployment_example.yaml"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny run (in-process, about a second)."""
    from rootopt.train.main import main as train_main

    tmp = tmp_path_factory.mktemp("first-hour")
    shards = prepare_tiny(tmp / "shards")
    run = tmp / "run"
    over = [o for o in FAST if not o.startswith("run.max_steps")]
    rc = train_main(["--data_path", str(shards), "--log_dir", str(run), *over, "run.max_steps=10"])
    assert rc == 0
    return run


# --------------------------------------------------------------------------- closed pipes


def _into_closed_pipe(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``rootopt ARGV`` with stdout a pipe whose reader is already gone (what `| head`
    leaves once it has its lines): every write to it fails."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [console_script("rootopt"), *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=env(),
            timeout=120,
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--version"],
        ["report", "RUN"],
        ["report", "RUN", "--json"],
        ["coeffs", "--help"],
        ["data", "verify", "SHARDS"],
    ],
    ids=["help", "version", "report", "report-json", "coeffs-help", "data-verify"],
)
def test_output_into_a_closed_pipe_ends_quietly(argv: list[str], run_dir: Path) -> None:
    subst = {"RUN": str(run_dir), "SHARDS": str(run_dir.parent / "shards")}
    got = _into_closed_pipe([subst.get(a, a) for a in argv])
    # the status a shell shows for `seq 1 100000 | head -1`, and not a word on stderr
    assert got.returncode == 128 + signal.SIGPIPE, got.stderr[-2000:]
    assert got.stderr == ""


def test_a_training_run_into_a_closed_pipe_still_completes(run_dir: Path, tmp_path: Path) -> None:
    """`rootopt train | head`: the run goes on to its end with its output discarded (it is
    in the run directory), then ends with the pipe's status, saying nothing."""
    over = [o for o in FAST if not o.startswith("run.max_steps")]
    run = tmp_path / "run"
    shards = str(run_dir.parent / "shards")
    got = _into_closed_pipe(
        ["train", "--data_path", shards, "--log_dir", str(run), *over, "run.max_steps=3"]
    )
    assert got.returncode == 128 + signal.SIGPIPE, got.stderr[-2000:]
    assert got.stderr == ""
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3


def test_report_into_head_through_a_shell(run_dir: Path) -> None:
    """`rootopt report RUN | head -1`, typed into bash: the first line, nothing else."""
    script = f'{console_script("rootopt")} report "$1" | head -1; echo "status ${{PIPESTATUS[0]}}"'
    got = subprocess.run(
        ["bash", "-c", script, "bash", str(run_dir)],
        capture_output=True,
        text=True,
        env=env(),
        timeout=120,
    )
    first, status = got.stdout.splitlines()
    assert first == f"run: {run_dir}"
    assert status in ("status 0", "status 141")  # 141 when head left before the last write
    assert got.stderr == ""


def test_a_broken_pipe_that_is_not_stdout_keeps_its_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only a reader that left stdout is quiet; any other broken pipe is a failure."""

    def main(argv: list[str]) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setitem(cli.COMMANDS, "fake", "a command whose socket breaks")
    monkeypatch.setitem(sys.modules, "rootopt.commands.fake", types.SimpleNamespace(main=main))
    with pytest.raises(BrokenPipeError):
        cli.main(["fake"])


# --------------------------------------------------------------------------- missing extras


def test_bench_help_without_the_train_extra_names_it() -> None:
    code = (
        "import sys; sys.modules['yaml'] = None  # as if PyYAML were not installed\n"
        "from rootopt.cli import main; sys.exit(main(['bench', '--help']))"
    )
    got = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env(), timeout=120
    )
    assert got.returncode == 2
    assert got.stdout == ""
    assert got.stderr == (
        "rootopt bench: needs the 'yaml' package; install with: pip install 'rootopt[train]'\n"
    )


# (scipy, which comes with the analysis package: tests/test_analysis_apart.py)
@pytest.mark.parametrize(("missing", "extra"), [("pytorch_optimizer.optimizer", "bench")])
def test_a_missing_package_while_a_command_runs_names_its_extra(
    missing: str, extra: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def main(argv: list[str]) -> int:
        raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)

    monkeypatch.setitem(cli.COMMANDS, "fake", "needs an extra when it runs")
    monkeypatch.setitem(sys.modules, "rootopt.commands.fake", types.SimpleNamespace(main=main))
    assert cli.main(["fake"]) == 2
    assert capsys.readouterr().err == (
        f"rootopt fake: needs the {missing!r} package; install with: "
        f"pip install 'rootopt[{extra}]'\n"
    )


def test_a_missing_rootopt_module_is_a_bug_with_its_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def main(argv: list[str]) -> int:
        raise ModuleNotFoundError("No module named 'rootopt.nope'", name="rootopt.nope")

    monkeypatch.setitem(cli.COMMANDS, "fake", "imports a module that does not exist")
    monkeypatch.setitem(sys.modules, "rootopt.commands.fake", types.SimpleNamespace(main=main))
    with pytest.raises(ModuleNotFoundError):
        cli.main(["fake"])


# --------------------------------------------------------------------------- bench --finished-only


def test_bench_finished_only_with_nothing_finished_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rootopt_analysis.commands.bench import MANIFEST
    from rootopt_analysis.commands.bench import main as bench_main

    missing = tmp_path / "missing"
    empty = tmp_path / "empty"
    empty.mkdir()
    started = tmp_path / "started"  # a suite that was started, and no run has finished
    (started / "runs").mkdir(parents=True)
    (started / MANIFEST).write_text(json.dumps({"tool": "rootopt bench", "format": 1}))
    for out in (missing, empty, started):
        before = tree_state(tmp_path)
        assert bench_main(["all", "--finished-only", "--out", str(out)]) == 1
        err = capsys.readouterr().err
        assert err == (
            f"rootopt bench: no finished runs in {str(out)!r} to report; nothing was written "
            "(run without --finished-only to compute them)\n"
        )
        assert tree_state(tmp_path) == before, out
    assert not missing.exists()

    foreign = tmp_path / "foreign"  # not a bench directory: refused as before, untouched
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    before = tree_state(tmp_path)
    assert bench_main(["all", "--finished-only", "--out", str(foreign)]) == 2
    assert "not written by rootopt bench" in capsys.readouterr().err
    assert tree_state(tmp_path) == before


def test_bench_finished_only_reports_a_partial_suite_and_runs_nothing(tmp_path: Path) -> None:
    """One finished convergence run: `all --finished-only` reports it, starts no run and no
    overhead measurement, and leaves the finished run files as they were."""
    out = tmp_path / "bench"
    flags = ["--quick", "--tasks", "digits", "--optimizers", "adamw", "--seeds", "1"]
    rootopt = console_script("rootopt")
    first = subprocess.run(
        [rootopt, "bench", "convergence", *flags, "--workers", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env(),
        timeout=300,
    )
    assert first.returncode == 0, first.stderr[-2000:]
    (out / "results.json").unlink()
    (out / "report.md").unlink()
    runs = tree_state(out / "runs")
    got = subprocess.run(
        [rootopt, "bench", "all", *flags, "--finished-only", "--no-progress", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env(),
        timeout=300,
    )
    assert got.returncode == 0, got.stderr[-2000:]
    assert tree_state(out / "runs") == runs
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"convergence", "lr_robustness", "meta"}  # no empty sections
    assert list(results["convergence"]["tasks"]) == ["digits"]
    assert list(results["convergence"]["tasks"]["digits"]["optimizers"]) == ["adamw"]
    report = (out / "report.md").read_text()
    assert "## Convergence" in report and "## Robustness" not in report
    assert "## Overhead" not in report


# --------------------------------------------------------------------------- import rootopt


def test_the_adanewton_snippet_runs_after_a_bare_import() -> None:
    """docs/adanewton.md's first code block, as written, in a fresh interpreter."""
    text = (ROOT / "docs" / "adanewton.md").read_text(encoding="utf-8")
    snippet = re.search(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert snippet is not None
    code = snippet.group(1)
    assert code.startswith("import rootopt\n")
    setup = (
        "import torch\n"
        "model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))\n"
        "import rootopt\n"
        "groups, _ = rootopt.param_groups(model, lr=1e-3)\n"
    )
    last = code.rstrip().splitlines()[-1]
    program = setup + code + f"print({last})\n"
    got = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, env=env(), timeout=120
    )
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.strip().splitlines()[-1].startswith("4096x14336 K=5 bfloat16: table")


def test_subpackages_are_attributes_of_the_package() -> None:
    import rootopt

    assert {"coeffs", "optim", "ortho", "distributed", "train"} <= set(dir(rootopt))
    # the deprecated alias stays an explicit import (dir() lists it once any test imported it)
    assert "dist" not in rootopt._SUBMODULES
    assert rootopt.coeffs.resolve_record("muon", 64, 128, 5).source == "muon"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = rootopt.nope  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- config


def test_warmup_that_outlasts_the_run_is_warned_about() -> None:
    from rootopt.config import config_warnings

    (line,) = config_warnings(
        load_config(None, ["run.max_steps=300", "optimization.warmup_steps=1000"])
    )
    assert line.startswith("optimization.warmup_steps=1000 >= run.max_steps=300:")
    assert "optimization.warmup_steps=30" in line
    assert len(config_warnings(load_config(None, ["optimization.warmup_steps=300"]))) == 1
    assert config_warnings(Config()) == []
    assert config_warnings(load_config(EXAMPLE)) == []


def test_a_run_prints_the_warning_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rootopt.train.main import main as train_main

    shards = prepare_tiny(tmp_path / "shards")
    over = [o for o in FAST if not o.startswith(("run.max_steps", "optimization.warmup_steps"))]
    args = ["--data_path", str(shards), "--log_dir", str(tmp_path / "run"), *over]
    assert train_main([*args, "run.max_steps=3", "optimization.warmup_steps=3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "warning: optimization.warmup_steps=3 >= run.max_steps=3: the learning rate never "
        "leaves its warmup and never reaches base_lr=0.006; a warmup of about 10 % of the run "
        "is usual (optimization.warmup_steps=1)"
    )
    assert out[1] == f"run dir: {tmp_path / 'run'}"


def test_mixed_precision_auto_autocasts_on_cuda_only() -> None:
    from rootopt.train.build import Precision

    cfg = load_config(EXAMPLE)
    assert cfg.mixed_precision.enabled == "auto" and cfg.mixed_precision.loss_scale == "8192"
    cpu = Precision(cfg, torch.device("cpu"))
    assert (cpu.enabled, cpu.name, cpu.static_scale, cpu.scaler) == (False, "fp32", None, None)
    assert cpu.description == (
        "precision: fp32 (mixed_precision.enabled=auto: autocast on CUDA only)"
    )
    # on CUDA: the deployment guide's fp16 with its static loss scale (no kernel runs here)
    gpu = Precision(cfg, torch.device("cuda"))
    assert (gpu.enabled, gpu.name, gpu.static_scale) == (True, "fp16", 8192.0)
    assert gpu.description == "precision: fp16 autocast on cuda; static loss scale 8192"
    for word, want in (("AUTO", "auto"), ("true", True), ("false", False)):
        got = load_config(None, [f"mixed_precision.enabled={word}"]).mixed_precision.enabled
        assert got == want and type(got) is type(want)


def test_the_deployment_example_ships_a_warmup_within_its_run() -> None:
    cfg = load_config(EXAMPLE)
    assert cfg.run.max_steps == 300 and cfg.optimization.warmup_steps == 30
    assert cfg.optimization.warmup_steps <= cfg.run.max_steps // 10


# --------------------------------------------------------------------------- checkpoint.every


def test_the_default_run_checkpoints_before_its_end() -> None:
    """With 300 steps and a checkpoint every 100, a rank killed after step 100 costs at most
    100 steps (at 1000, every restart of the default run began at step 0)."""
    c = Config()
    assert c.checkpoint.every == 100 and c.run.max_steps == 300
    assert c.run.max_steps // c.checkpoint.every == 3


def test_a_checkpoint_event_records_its_write_time(run_dir: Path) -> None:
    events = [json.loads(ln) for ln in (run_dir / "events.jsonl").read_text().splitlines()]
    ckpts = [e for e in events if e["event"] == "checkpoint"]
    assert [e["step"] for e in ckpts] == [10]  # FAST: every 10 steps; 10 = the final one
    # a part of the run's own time, not a clock window
    wall = json.loads((run_dir / "summary.json").read_text())["wall_s"]
    assert all(isinstance(e["seconds"], float) and 0 < e["seconds"] <= wall for e in ckpts)


@pytest.mark.slow
def test_a_killed_rank_resumes_from_a_default_checkpoint(tmp_path: Path) -> None:
    """`torchrun --standalone --nproc_per_node=2 --max-restarts=1 -m rootopt.train` with the
    default checkpoint interval: rank 1 SIGKILLed after the checkpoint at step 100, and the
    restarted workers resume from it, not from step 0. run.max_steps=120 keeps it short."""
    cmd = [
        console_script("torchrun"),
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=1",
        "-m",
        "rootopt.train",
        "run.max_steps=120",
        "monitoring.progress_bar=false",
    ]
    proc = start_session(cmd, env=env(), cwd=tmp_path)
    try:
        wait_for(
            lambda: any((tmp_path / "runs").glob("*/checkpoints/dcp-00000100")),
            600,
            "the checkpoint at step 100",
            proc,
        )
        rank1 = _worker(proc.pid, 1)
        os.kill(rank1, signal.SIGKILL)
        out, err = proc.communicate(timeout=600)
    finally:
        kill_session(proc)
    assert proc.returncode == 0, out[-1500:] + err[-3000:]
    assert "resumed from dcp-00000100 at step 100" in out, out[-2000:]
    (run,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 120


def test_ctrl_c_under_torchrun_is_torchrun_s_traceback_and_the_run_resumes(
    tmp_path: Path,
) -> None:
    """What docs/training.md ("Ctrl-C under torchrun") says a user sees: rank 0's line,
    then torchrun's own report of the SIGINT it received (status 1, a SignalException
    traceback, the only one); the same command resumes from the checkpoint the workers
    wrote. run.max_steps=40 and run.log_every=2 keep it short and give an early record."""
    cmd = [
        console_script("torchrun"),
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "rootopt.train",
        "run.max_steps=40",
        "run.log_every=2",
        "monitoring.progress_bar=false",
    ]
    proc = start_session(cmd, env=env(), cwd=tmp_path)
    try:
        wait_for(
            lambda: any(p.stat().st_size > 0 for p in (tmp_path / "runs").glob("*/metrics.jsonl")),
            400,
            "the first metrics record",
            proc,
        )
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        out, err = proc.communicate(timeout=300)
    finally:
        kill_session(proc)
    assert proc.returncode == 1, err[-3000:]
    assert "stopped by signal after a checkpoint; run the same command to resume" in out
    assert "Received 2 death signal, shutting down workers" in err
    assert err.count("Traceback") == 1, err[-3000:]
    assert re.search(r"SignalException: Process \d+ got signal: 2\n*$", err), err[-1000:]
    (run,) = (tmp_path / "runs").iterdir()
    stopped = json.loads((run / "summary.json").read_text())
    assert stopped["status"] == "interrupted" and stopped["steps"] < 40
    again = subprocess.run(
        cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=400
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from dcp-{stopped['steps']:08d} at step {stopped['steps']}" in again.stdout
    assert json.loads((run / "summary.json").read_text())["steps"] == 40


def _worker(agent: int, rank: int) -> int:
    """pid of the torchrun worker with ``RANK=rank`` (a child of the agent process)."""
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for child in Path(f"/proc/{agent}/task/{agent}/children").read_text().split():
            try:
                environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ:
                return int(child)
        time.sleep(0.1)
    raise AssertionError(f"no worker with RANK={rank}")


# --------------------------------------------------------------------------- numbers in docs


def _benchmark(name: str) -> types.ModuleType:
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _committed(name: str) -> dict[str, object]:
    result = json.loads((ROOT / "docs" / "results" / name).read_text())
    assert isinstance(result, dict)
    assert isinstance(result["commit"], str) and len(result["commit"]) == 40
    assert result["dirty"] is False  # measured on a committed tree
    return result


def test_readme_numbers_are_the_committed_measurement() -> None:
    result = _committed("readme_runs.json")
    said = _benchmark("bench_readme_runs").sentences(result)
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    at = readme.index("rootopt train --config configs/deployment_example.yaml --log_dir runs/a")
    assert readme[at - 1] == said["readme-deployment"]


def test_outlook_tables_are_the_committed_results() -> None:
    bench = _benchmark("outlook_tables")
    result = _committed("outlook.json")
    page = (ROOT / "docs" / "results" / "outlook.md").read_text(encoding="utf-8")
    tables = bench.render(result)
    assert len(tables) == 5
    for name, table in tables.items():
        assert table in page, name


def test_hf_trainer_table_is_the_committed_results() -> None:
    bench = _benchmark("hf_trainer_table")
    result = _committed("hf_trainer.json")
    assert [(r["optimizer"], r["seed"]) for r in result["rows"]] == [
        (o, s) for s in (0, 1, 2) for o in ("root", "root-bare", "adamw")
    ]
    page = (ROOT / "docs" / "results" / "integrations.md").read_text(encoding="utf-8")
    assert bench.render(result) in page
