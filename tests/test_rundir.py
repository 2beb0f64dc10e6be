"""The run directory is the run's identity: the same command finds the same directory,
a refused launch touches nothing, and nothing that is not the run's is written.

Each test names the defect of issue 18 it pins down (D1, D2, D13, the lock, ``--log_dir ""``,
a directory that is not a run's, the default directory that did not resume).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from _faultkit import env, kill_session, start_session, tree_state, victim, wait_for
from _train_fixtures import FAST, TINY, final_params, prepare_tiny
from _train_fixtures import quiet as _quiet
from rootopt.config import load_config
from rootopt.train import train
from rootopt.train.main import main as train_main


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_tiny(tmp_path_factory.mktemp("shards"))


def _err_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "Traceback" not in err[0] and len(err[0]) < 600
    return err[0]


def _same_model(a: Path, b: Path) -> None:
    ma, mb = final_params(a)["model"], final_params(b)["model"]
    assert isinstance(ma, dict) and isinstance(mb, dict)
    assert sorted(ma) == sorted(mb) and len(ma) > 5
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k


# --------------------------------------------------------------------------- the default directory


def test_default_directory_is_the_same_for_the_same_command(tmp_path: Path) -> None:
    from rootopt.train.run.directory import default_run_dir, identity_key

    cfg = load_config(None, FAST)
    key = identity_key(cfg, str(tmp_path))
    assert len(key) == 8 and int(key, 16) >= 0
    assert identity_key(load_config(None, FAST), str(tmp_path)) == key
    # a setting that changes what is computed names another run ...
    assert (
        identity_key(load_config(None, [*FAST, "optimization.base_lr=1e-3"]), str(tmp_path)) != key
    )
    assert identity_key(cfg, str(tmp_path / "other")) != key
    assert identity_key(cfg, None) != key
    # ... one that only steers a session does not: `checkpoint.resume=restart` acts on this run
    for session in (
        "checkpoint.resume=restart",
        "run.max_time=60",
        "distributed.timeout_s=5",
    ):
        assert identity_key(load_config(None, [*FAST, session]), str(tmp_path)) == key, session
    assert default_run_dir(cfg, None, None).parts[:1] == ("runs",)
    assert default_run_dir(cfg, None, None).name.startswith("default-")
    assert default_run_dir(cfg, None, "configs/deployment_example.yaml").name.startswith(
        "deployment_example-"
    )
    named = load_config(None, [*FAST, "run.name=my exp/1"])
    assert default_run_dir(named, None, "x.yaml").name.startswith("my-exp-1-")


@pytest.mark.parametrize("native", [True, False], ids=["bf16-units", "no-bf16-units"])
def test_the_iteration_dtype_names_a_run_by_what_it_computes(
    native: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ns_dtype: auto`` and the dtype it resolves to on this machine compute the same, so
    they name one run; a default run directory named while the default was an explicit
    "bfloat16" (2026-12-05, CHANGELOG.md) is found again only where "auto" resolves to it."""
    import hashlib
    import json

    from rootopt.optim import _options
    from rootopt.train.run.directory import RUN_FILE, default_run_dir, identity, identity_key

    monkeypatch.setattr(_options, "_x86", lambda: True)
    monkeypatch.setattr(_options, "cpu_emulates_bf16", lambda: not native)
    monkeypatch.chdir(tmp_path)
    auto = load_config(None, FAST)
    assert auto.optimization.ns_dtype == "auto"
    resolved, other = ("bfloat16", "float32") if native else ("float32", "bfloat16")
    named = load_config(None, [*FAST, f"optimization.ns_dtype={resolved}"])
    assert identity_key(named, None) == identity_key(auto, None)
    assert identity_key(load_config(None, [*FAST, f"optimization.ns_dtype={other}"]), None) != (
        identity_key(auto, None)
    )
    # the key of 2026-12-05: the dtype written out as "bfloat16"
    then = identity(auto, None)
    then["optimization.ns_dtype"] = "bfloat16"
    key = hashlib.sha256(json.dumps(then, sort_keys=True, default=str).encode()).hexdigest()[:8]
    old = Path("runs") / f"default-{key}"
    old.mkdir(parents=True)
    (old / RUN_FILE).write_text(json.dumps({"identity": then}))
    assert (default_run_dir(auto, None, None) == old) is native


def test_rerun_without_log_dir_resumes(
    shards: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Ctrl-C (SIGINT after step 6), then the same command again: it resumes in the same
    directory (before, each launch made a new runs/<timestamp> and started at step 0)."""
    args = ["--data_path", str(shards), *FAST, "run.max_steps=12"]
    first = victim({"argv": args, "kill_at": 6, "signal": "SIGINT"}, cwd=tmp_path)
    assert first.returncode == 130, first.stderr[-2000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert train_main(args) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"run dir: runs/{run_dir.name}"  # printed first
    assert "resumed from ckpt-00000006.pt at step 6" in out
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run_dir.name]
    whole = tmp_path / "whole"
    train(load_config(None, args[2:]), whole, str(shards), say=_quiet)
    _same_model(whole, run_dir)
    # once complete, the same command says so instead of training again
    assert train_main(args) == 0
    out = capsys.readouterr().out
    assert "already complete: step 12 of 12" in out and "--log_dir" in out


def test_empty_log_dir_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert train_main(["--log_dir", "", *FAST]) == 2
    assert "--log_dir: empty path" in _err_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_a_directory_that_is_not_a_run_is_refused_untouched(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--log_dir naming a user's directory: refused before any write (it used to get
    config.yaml, env.json, metrics and checkpoints written into it, config.yaml overwritten)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my: own\n")
    (mine / "notes.txt").write_text("keep\n")
    before = tree_state(mine)
    assert train_main(["--data_path", str(shards), "--log_dir", str(mine), *FAST]) == 2
    line = _err_line(capsys)
    assert "not a rootopt run directory" in line and "config.yaml" in line
    assert tree_state(mine) == before


def test_a_refused_launch_on_a_live_run_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live run (its own prepared data, no --log_dir), frozen with SIGSTOP while it holds
    its lock. Launched against it: the same command (D: the lock), `checkpoint.resume=restart`
    (D1: it used to move the live run's checkpoints and metrics to previous/ first),
    another data.max_bytes (D2: it used to prepare the live run's data again) and another
    model (D13: it used to overwrite config.yaml and env.json). Each is refused with one
    line and exit 2, the whole tree (bytes, modes and mtimes, `.lock` included) is
    unchanged, and the live run then finishes with the parameters of an uninterrupted run."""
    over = [
        *TINY,
        "data.corpus=kjv",
        "data.max_bytes=150000",
        "run.max_steps=30",
        "checkpoint.every=5",
    ]
    monkeypatch.chdir(tmp_path)
    live = start_session([sys.executable, "-m", "rootopt.train", *over], env=env(), cwd=tmp_path)
    try:
        wait_for(
            lambda: list((tmp_path / "runs").glob("*/checkpoints/ckpt-00000005.json")),
            180,
            "the live run's first checkpoint",
            live,
        )
        os.kill(live.pid, signal.SIGSTOP)
        (run_dir,) = (tmp_path / "runs").iterdir()
        before = tree_state(run_dir)
        attempts = {
            "restart (D1)": ["--log_dir", str(run_dir), *over, "checkpoint.resume=restart"],
            "data.max_bytes (D2)": ["--log_dir", str(run_dir), *over, "data.max_bytes=90000"],
            "model (D13)": ["--log_dir", str(run_dir), *over, "model.d_model=64"],
            "same command (lock)": [*over],
        }
        problems = []
        for name, args in attempts.items():
            capsys.readouterr()
            rc = train_main(args)
            err = capsys.readouterr().err.strip().splitlines()
            if rc != 2 or len(err) != 1 or "in use by another training process" not in err[0]:
                problems.append(f"{name}: status {rc}, stderr {err[-3:]}")
            elif f"pid {live.pid}" not in err[0]:
                problems.append(f"{name}: the line does not name the live process: {err[0]}")
            after = tree_state(run_dir)
            if after != before:
                changed = sorted(
                    k for k in set(before) | set(after) if before.get(k) != after.get(k)
                )
                problems.append(f"{name}: the live run's directory changed: {changed[:8]}")
                before = after
        assert not problems, "\n".join(problems)
        os.kill(live.pid, signal.SIGCONT)
        _, err = live.communicate(timeout=180)
    finally:
        kill_session(live)
    assert live.returncode == 0, err[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 30
    assert summary["final_loss"] == summary["final_loss"]  # not NaN: its log is intact
    whole = tmp_path / "whole"
    train(load_config(None, over), whole, None, say=_quiet)
    _same_model(whole, run_dir)
