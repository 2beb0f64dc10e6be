"""The README's commands, run exactly as a new user types them (issue 18, "Done when").

    rootopt train
    torchrun --standalone --nproc_per_node=2 -m rootopt.train
    torchrun --standalone --nproc_per_node=2 --max-restarts=1 -m rootopt.train
    rootopt train --config configs/deployment_example.yaml --log_dir runs/a

Each runs in a fresh working directory (``runs/`` is relative to it), through the
installed ``rootopt`` and ``torchrun`` commands, under a timeout that fails loudly. The
only additions are ``run.max_steps=N``-style overrides, each with its reason; the test of
the embedded default with nothing switched off is marked slow (it trains the full 300
steps twice: about 4 minutes on a 2-core CPU).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from _faultkit import console_script, env, kill_session, run_session, start_session, wait_for
from rootopt.monitor import read_jsonl

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not Path("/proc/self/task").is_dir(),
    reason="needs torch.distributed and /proc",
)
ROOT = Path(__file__).resolve().parents[1]


def _run(
    argv: list[str], cwd: Path, timeout: float = 420, **extra: str
) -> subprocess.CompletedProcess[str]:
    return run_session(argv, env=env(**extra), timeout=timeout, cwd=cwd)


def _the_run(cwd: Path) -> Path:
    (run,) = (cwd / "runs").iterdir()
    return run


def _model(run: Path) -> dict[str, torch.Tensor]:
    """The newest checkpoint's model tensors, whatever its format."""
    ck = run / "checkpoints"
    found = [*ck.glob("ckpt-*.pt"), *ck.glob("dcp-*")]
    newest = max(found, key=lambda p: int(p.name.split("-")[1].split(".")[0]))
    if newest.is_file():
        state = torch.load(newest, weights_only=True)["model"]
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        flat = run.parent / f"{run.name}-{newest.name}.pt"
        dcp_to_torch_save(newest, flat)
        state = torch.load(flat, weights_only=False)["model"]
    assert isinstance(state, dict) and len(state) > 10
    return state


def _records(run: Path) -> list[tuple[int, Any, Any]]:
    rows = read_jsonl(run / "metrics.jsonl")
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in rows]


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], exact: bool) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:  # the same world size: the same reductions, equal to float noise
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7, msg=k)


# --------------------------------------------------------------------------- rootopt train


def _ctrl_c_and_rerun(tmp_path: Path, extra: list[str]) -> None:
    rootopt = console_script("rootopt")
    whole = tmp_path / "whole"
    whole.mkdir()
    user = tmp_path / "user"
    user.mkdir()
    # the uninterrupted run and the one Ctrl-C stops are independent: they run side by side
    # (each one thread, OMP_NUM_THREADS=1)
    uninterrupted = start_session([rootopt, "train", *extra], env=env(), cwd=whole)
    proc = start_session([rootopt, "train", *extra], env=env(), cwd=user)
    try:
        # Ctrl-C once the first record is logged: the loop checkpoints after the current
        # step and stops; whichever step that is, the rerun must end identical.
        wait_for(
            lambda: (
                any((user / "runs").glob("*/metrics.jsonl"))
                and (_the_run(user) / "metrics.jsonl").stat().st_size > 0
            ),
            400,
            "the first metrics record",
            proc,
        )
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        out, err = proc.communicate(timeout=300)
        _, whole_err = uninterrupted.communicate(timeout=420)
    finally:
        kill_session(proc)
        kill_session(uninterrupted)
    assert uninterrupted.returncode == 0, whole_err[-3000:]
    assert proc.returncode == 130, err[-3000:]
    assert "stopped by signal after a checkpoint; run the same command to resume" in out
    assert "Traceback" not in err
    again = _run([rootopt, "train", *extra], user)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from ckpt-" in again.stdout
    assert _the_run(user).name == _the_run(whole).name  # the same command, the same run
    _close(_model(_the_run(whole)), _model(_the_run(user)), exact=True)
    assert _records(_the_run(whole)) == _records(_the_run(user))


def test_rootopt_train_ctrl_c_and_rerun_resumes(tmp_path: Path) -> None:
    """`rootopt train`, Ctrl-C mid-run, the same command again: it resumes and ends
    identical to an uninterrupted run. run.max_steps=16 keeps CI time (the full default
    runs in the slow test below); run.log_every=2 gives an early record to time the Ctrl-C."""
    _ctrl_c_and_rerun(tmp_path, ["run.max_steps=16", "run.log_every=2"])


@pytest.mark.slow
def test_rootopt_train_default_ctrl_c_and_rerun_resumes(tmp_path: Path) -> None:
    """The same with nothing switched off: the embedded default, 300 steps (slow)."""
    _ctrl_c_and_rerun(tmp_path, [])


def test_deployment_example_command(tmp_path: Path) -> None:
    """`rootopt train --config configs/deployment_example.yaml --log_dir runs/a` on one
    CPU process: its world_size 8 is for a launcher, said in one note. run.max_steps=4
    keeps CI time."""
    (tmp_path / "configs").mkdir()
    shutil.copy(ROOT / "configs" / "deployment_example.yaml", tmp_path / "configs")
    cmd = [console_script("rootopt"), "train", "--config", "configs/deployment_example.yaml"]
    done = _run([*cmd, "--log_dir", "runs/a", "run.max_steps=4"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "distributed.world_size=8 is the size to launch with" in done.stdout
    summary = json.loads((tmp_path / "runs" / "a" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 4


# --------------------------------------------------------------------------- torchrun

# run.max_steps / checkpoint.every keep CI time; the launches below share them, so they
# all train the same run (the same default directory name in each working directory)
TORCHRUN_OVER = ["run.max_steps=16", "checkpoint.every=4"]
SITE = """
import os, time
if os.environ.get("RANK") == "1" and os.environ.get("ROOTOPT_TEST_RANK1_DELAY"):
    time.sleep(float(os.environ["ROOTOPT_TEST_RANK1_DELAY"]))
"""


def _delayed_env(tmp_path: Path) -> dict[str, str]:
    """Rank 1 starts 1.5 s after rank 0 (a sitecustomize module on its PYTHONPATH), so
    the ranks start in different seconds: a per-rank timestamp directory would differ."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITE)
    return {
        "PYTHONPATH": os.pathsep.join([str(site), env()["PYTHONPATH"]]),
        "ROOTOPT_TEST_RANK1_DELAY": "1.5",
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`torchrun --standalone --nproc_per_node=2 -m rootopt.train`, twice in a row in the
    same directory, rank 1 starting later each time: the first trains, the second finds
    the same run complete. Both succeed (before, 1 launch in 2 failed)."""
    tmp = tmp_path_factory.mktemp("torchrun")
    cwd = tmp / "ref"
    cwd.mkdir()
    torchrun = console_script("torchrun")
    cmd = [torchrun, "--standalone", "--nproc_per_node=2", "-m", "rootopt.train", *TORCHRUN_OVER]
    first = _run(cmd, cwd, **_delayed_env(tmp))
    assert first.returncode == 0, first.stdout[-1500:] + first.stderr[-3000:]
    assert "2 processes (ddp, gloo)" in first.stdout
    second = _run(cmd, cwd, **_delayed_env(tmp))
    assert second.returncode == 0, second.stdout[-1500:] + second.stderr[-3000:]
    assert "already complete: step 16 of 16" in second.stdout
    run = _the_run(cwd)
    assert json.loads((run / "summary.json").read_text())["steps"] == 16
    return run


def test_torchrun_line_twice_with_ranks_starting_apart(reference: Path) -> None:
    assert [p.name for p in (reference / "checkpoints").glob("dcp-*")]
    stray = [p for p in reference.parent.iterdir() if p != reference]
    assert stray == []  # one run directory, shared by both ranks


def test_torchrun_max_restarts_after_a_killed_rank(reference: Path, tmp_path: Path) -> None:
    """`torchrun --standalone --nproc_per_node=2 --max-restarts=1 -m rootopt.train` with
    no --log_dir: rank 1 SIGKILLed after the first checkpoint; the restarted workers find
    the same run directory, resume, and finish where an uninterrupted run does."""
    torchrun = console_script("torchrun")
    cmd = [
        torchrun,
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=1",
        "-m",
        "rootopt.train",
        *TORCHRUN_OVER,
    ]
    proc = start_session(cmd, env=env(), cwd=tmp_path)
    try:
        wait_for(
            lambda: any((tmp_path / "runs").glob("*/checkpoints/dcp-00000004")),
            400,
            "the first checkpoint",
            proc,
        )
        os.kill(_worker(proc.pid, 1), signal.SIGKILL)
        out, err = proc.communicate(timeout=400)
    finally:
        kill_session(proc)
    assert proc.returncode == 0, out[-1500:] + err[-3000:]
    assert "resumed from dcp-" in out, out[-2000:]
    run = _the_run(tmp_path)
    assert run.name == reference.name
    _close(_model(reference), _model(run), exact=False)
    ref, got = _records(reference), _records(run)
    assert [r[0] for r in ref] == [r[0] for r in got]
    for (_, a, va), (_, b, vb) in zip(ref, got, strict=True):
        for x, y in ((a, b), (va, vb)):
            assert (x is None) == (y is None) and (x is None or abs(x - y) <= 1e-5 * abs(x))


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


# --------------------------------------------------------------------------- one line per failure


ARGV_SITE = """
import os, sys
extra = os.environ.get("ROOTOPT_TEST_RANK1_ARGV")
if extra and os.environ.get("RANK") == "1":
    sys.argv.extend(extra.split())
"""


def _rootopt_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("rootopt train")]


def test_torchrun_failures_are_one_line_from_rank_0(tmp_path: Path) -> None:
    """Under torchrun a failure is printed once: a config error (every rank sees it; it
    used to be printed by each), a run directory held by a live process (rank 1 used to
    print a traceback), and ranks started with different configs (rank 0 compares them).
    torchrun itself exits 1 (it re-raises its ChildFailedError); its report lists each
    worker's status 2 and, from the worker's error file, the line itself."""
    from rootopt.checkpoint import DirLock

    torchrun = console_script("torchrun")
    base = [torchrun, "--standalone", "--nproc_per_node=2", "-m", "rootopt.train"]
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(ARGV_SITE)
    held = tmp_path / "held"
    held.mkdir()
    (held / "run.json").write_text(json.dumps({"run_id": "0" * 32}))
    lock = DirLock(held)
    lock.acquire()
    cases = {
        "config error": ([*base, "model.heads=4"], {}, "config error: model.heads: unknown key"),
        "live directory": (
            [*base, "--log_dir", str(held)],
            {},
            "is in use by another training process",
        ),
        "different configs": (
            [*base, "run.max_steps=3"],
            {
                "PYTHONPATH": os.pathsep.join([str(site), env()["PYTHONPATH"]]),
                "ROOTOPT_TEST_RANK1_ARGV": "run.seed=7",
            },
            "rank 1/2 was started for run directory",
        ),
    }
    try:
        for name, (cmd, extra, want) in cases.items():
            cwd = tmp_path / name.replace(" ", "-")
            cwd.mkdir()
            got = _run(cmd, cwd, timeout=300, **extra)
            assert got.returncode == 1, (name, got.stderr[-3000:])
            lines = _rootopt_lines(got.stderr)
            assert len(lines) == 1 and want in lines[0], (name, lines)
            assert "(rank" not in lines[0], (name, lines)  # rank 0 speaks for the job
            # the only traceback is torchrun's own report, which names status 2 and the line
            assert got.stderr.count("Traceback") == 1 and "ChildFailedError" in got.stderr, name
            assert "exitcode  : 2" in got.stderr and f"traceback : {lines[0]}" in got.stderr, name
            assert not (cwd / "runs").exists(), name
    finally:
        lock.release()
    assert (held / ".lock").read_text().startswith(f"pid {os.getpid()} ")
