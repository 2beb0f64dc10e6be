"""Integrity (issue 33): a run writes nothing through a planted link, checks every byte
of a checkpoint before it reads one (``dcp-*`` included) and never runs code from one,
names its default directory after what it computes, and answers bad inputs with one line.

docs/operations.md, "What a run trusts", states the rules these tests pin down.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from _faultkit import tree_state
from _train_fixtures import FAST, prepare_tiny
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
    assert "Traceback" not in err[0] and len(err[0]) < 700, err[0][:300]
    return err[0]


# --------------------------------------------------------------------------- 1. no write through a link

# A run that writes every output it has: its own prepared data, TensorBoard, the plot,
# periodic checkpoints, and (after `restart`) previous/.
OWN = [
    *FAST,
    "data.corpus=kjv",
    "data.max_bytes=150000",
    "data.samples_per_shard=400",
    "run.max_steps=6",
    "checkpoint.every=3",
    "checkpoint.keep_last=5",
    "monitoring.tensorboard=true",
    "monitoring.plot=true",
    "monitoring.histogram_every=3",
]


def _user_things(root: Path) -> tuple[Path, Path]:
    """A user's file and a user's directory (with a file whose name looks like one of a
    run's stale temporaries), outside the run."""
    root.mkdir()
    f = root / "precious.txt"
    f.write_bytes(b"a user's file\n" * 10)
    d = root / "folder"
    d.mkdir()
    (d / ".ckpt-00000003.pt.abcdef.tmp").write_bytes(b"a user's file in a user's folder\n")
    (d / ".run.json.abcdef.tmp").write_bytes(b"another\n")
    (d / "notes.txt").write_bytes(b"notes\n")
    return f, d


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run directory holding every kind of file a run writes."""
    run = tmp_path_factory.mktemp("full") / "run"
    train(load_config(None, OWN), run, None, say=_quiet)
    train(load_config(None, [*OWN, "checkpoint.resume=restart"]), run, None, say=_quiet)
    return run


def _written_paths(run: Path) -> list[str]:
    """Every path the run wrote at the top of its directory and of its checkpoint
    directory (read from a real run, so a new output is covered when it appears), plus the
    ones the code declares that this run did not need (e.g. metrics.superseded.jsonl)."""
    from rootopt.train import rundir

    names = {p.name for p in run.iterdir()} | set(rundir.RUN_PATHS) | {"data"}
    ckpt = {f"checkpoints/{p.name}" for p in (run / "checkpoints").iterdir()}
    ckpt |= {f"checkpoints/{n}" for n in rundir.CKPT_PATHS}
    ckpt |= {"checkpoints/ckpt-00000009.pt", "checkpoints/ckpt-00000009.json"}  # next ones
    return sorted((names - {"checkpoints"}) | ckpt | {"checkpoints"})


def test_a_link_anywhere_the_run_writes_is_refused_and_its_target_untouched(
    full_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A symbolic link planted at each path a run writes, appends, moves or prunes (to a
    user's file, or to a user's directory where the run has a directory): the rerun that
    would resume, write and prune is refused with one line (status 2) naming the link, and
    the link's target and the whole run directory are byte-identical afterwards (they
    used to be truncated, appended to, moved into or cleaned)."""
    paths = _written_paths(full_run)
    for must in (
        ".lock",
        "checkpoints/.lock",
        "config.yaml",
        "env.json",
        "routing.txt",
        "run.json",
        "summary.json",
        "metrics.jsonl",
        "events.jsonl",
        "metrics.superseded.jsonl",
        "loss_curve.png",
        "tensorboard",
        "previous",
        "data",
        "checkpoints",
        "checkpoints/owner.json",
        "checkpoints/ckpt-00000006.pt",
        "checkpoints/ckpt-00000006.json",
        "checkpoints/diverged",
    ):
        assert must in paths, must
    problems = []
    for i, rel in enumerate(paths):
        run = tmp_path / f"r{i}"
        shutil.copytree(full_run, run, symlinks=True)
        user_file, user_dir = _user_things(tmp_path / f"u{i}")
        at = run / rel
        is_dir = at.is_dir() or rel in ("tensorboard", "previous", "data", "checkpoints/diverged")
        target = user_dir if is_dir else user_file
        if at.is_dir():
            shutil.rmtree(at)
        elif at.exists():
            at.unlink()
        at.symlink_to(target)
        users = tree_state(user_file.parent)
        before = tree_state(run)
        capsys.readouterr()
        rc = train_main(["--log_dir", str(run), *OWN, "run.max_steps=9"])
        err = capsys.readouterr().err.strip().splitlines()
        if rc != 2 or len(err) != 1 or "symbolic link" not in err[0] or rel not in err[0]:
            problems.append(f"{rel}: status {rc}, stderr {err[-2:]}")
        if tree_state(user_file.parent) != users:
            problems.append(f"{rel}: the link's target changed")
        if tree_state(run) != before:
            problems.append(f"{rel}: the run directory changed")
    assert not problems, "\n".join(problems)


def test_stale_temporaries_that_are_links_are_removed_not_followed(
    full_run: Path, tmp_path: Path
) -> None:
    """Links named like the temporaries an interrupted write leaves (removed at start)
    are removed as links: what they point to stays byte-identical."""
    run = tmp_path / "run"
    shutil.copytree(full_run, run, symlinks=True)
    user_file, user_dir = _user_things(tmp_path / "user")
    planted = [
        run / ".run.json.abc123.tmp",
        run / ".summary.json.abc123.tmp",
        run / "checkpoints" / ".ckpt-00000009.pt.abc123.tmp",
        run / "checkpoints" / ".owner.json.abc123.tmp",
    ]
    for p in planted:
        p.symlink_to(user_file)
    (run / "checkpoints" / ".dcp-00000009.partial-0123456789ab").symlink_to(user_dir)
    users = tree_state(user_file.parent)
    s = train(load_config(None, [*OWN, "run.max_steps=9"]), run, None, say=_quiet)
    assert s.status == "completed" and s.steps == 9
    assert not any(os.path.lexists(p) for p in planted)
    assert not os.path.lexists(run / "checkpoints" / ".dcp-00000009.partial-0123456789ab")
    assert tree_state(user_file.parent) == users


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_every_write_primitive_refuses_or_replaces_a_link(tmp_path: Path) -> None:
    """The writes themselves, for a link planted after the start-up check (a race):
    appends and locks refuse it (O_NOFOLLOW), whole-file writes replace it, directories
    refuse it; the target is never written."""
    from rootopt import checkpoint
    from rootopt._atomic import (
        LinkError,
        atomic_write,
        open_append,
        own_dir,
        publish_dir,
        staging_dir,
    )
    from rootopt.monitor import Monitor, plot_loss

    user_file, user_dir = _user_things(tmp_path / "user")
    users = tree_state(user_file.parent)
    run = tmp_path / "run"
    run.mkdir()
    for name in ("metrics.jsonl", "events.jsonl", "metrics.superseded.jsonl", ".lock"):
        (run / name).symlink_to(user_file)
    with pytest.raises(LinkError, match="symbolic link"):
        open_append(run / "metrics.jsonl")
    with pytest.raises(LinkError, match="symbolic link"):
        open_append(run / "metrics.superseded.jsonl", binary=True)
    with pytest.raises(LinkError, match="symbolic link"):
        Monitor(run, jsonl=True, tensorboard=False, prometheus=None)
    with pytest.raises(LinkError, match="symbolic link"):
        checkpoint.DirLock(run).acquire()
    # whole files: the link is replaced by the new file
    (run / "config.yaml").symlink_to(user_file)
    atomic_write(run / "config.yaml", b"x: 1\n")
    assert (
        not (run / "config.yaml").is_symlink() and (run / "config.yaml").read_bytes() == b"x: 1\n"
    )
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    (run / "loss_curve.png").symlink_to(user_file)
    assert plot_loss(run) == run / "loss_curve.png"
    assert (run / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert not (run / "loss_curve.png").is_symlink()
    # directories
    (run / "tensorboard").symlink_to(user_dir)
    with pytest.raises(LinkError):
        own_dir(run / "tensorboard")
    (run / "events.jsonl").unlink()
    with pytest.raises(LinkError):
        Monitor(run, jsonl=False, tensorboard=True, prometheus=None)
    (run / "data").symlink_to(user_dir)
    tmp = staging_dir(run, "data")
    (tmp / "a").write_bytes(b"1")
    with pytest.raises(LinkError):
        publish_dir(tmp, run / "data")
    assert tree_state(user_file.parent) == users
    assert _digest(user_file) == hashlib.sha256(b"a user's file\n" * 10).hexdigest()
