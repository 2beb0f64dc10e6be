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
    from rootopt.data import STAGING
    from rootopt.train.run import directory as rundir

    names = {p.name for p in run.iterdir()} | set(rundir.RUN_PATHS) | {"data", STAGING}
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
        is_dir = at.is_dir() or rel in (
            "tensorboard",
            "previous",
            "data",
            ".rootopt-staging",
            "checkpoints/diverged",
            "checkpoints/invalid",
        )
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


# --------------------------------------------------------------------------- 2. checked, safe dcp-* checkpoints

DCP = [
    *FAST,
    "run.max_steps=8",
    "run.log_every=1",
    "checkpoint.every=4",
    "checkpoint.keep_last=5",
    "optimization.schedule=constant",
]


class _Gadget:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _relist(ck: Path) -> None:
    """Rewrite the marker's checksums to the files as they are now (what someone who can
    write the directory can always do): only the safe unpickler stands in the way."""
    import json

    from rootopt.distributed import checkpoint as dck

    marker = json.loads((ck / dck.MARKER).read_text())
    for name in marker[dck.FILES]:
        digest, size = dck.file_digest(ck / name)
        marker[dck.FILES][name] = {"sha256": digest, "bytes": size}
    (ck / dck.MARKER).write_text(json.dumps(marker))


def _flip(f: Path) -> None:
    blob = bytearray(f.read_bytes())
    blob[len(blob) // 2] ^= 0x10
    f.write_bytes(bytes(blob))


def _zero_page(f: Path) -> None:
    blob = bytearray(f.read_bytes())
    at = (len(blob) // 2) & ~4095
    blob[at : at + 4096] = bytes(min(4096, len(blob) - at))
    f.write_bytes(bytes(blob))


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])


def _no_marker(f: Path) -> None:
    """The checkpoint's marker is lost (a copy that left it out): ``f`` itself is intact.
    Such a checkpoint used to sort as the oldest: the rerun resumed from dcp-00000004
    without a word and then stopped at step 8 for good ("already exists")."""
    (f.parent / "rootopt.json").unlink()


@pytest.fixture(scope="module")
def dcp_runs(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A two-process run (gloo) stopped at step 8 with dcp-00000004 and dcp-00000008, and
    the same run continued untouched to step 12 (the reference)."""
    from _train_fixtures import torchrun

    root = tmp_path_factory.mktemp("dcp")
    base = root / "base"
    torchrun(2, base, shards, DCP)
    assert (base / "checkpoints" / "dcp-00000008").is_dir()
    ref = root / "ref"
    shutil.copytree(base, ref, symlinks=True)
    torchrun(2, ref, shards, [*DCP, "run.max_steps=12"])
    return {"base": base, "ref": ref}


def _model(run: Path, step: int) -> dict[str, Any]:
    from rootopt.distributed import checkpoint as dck

    model = dck.read_full_state(run / "checkpoints" / f"dcp-{step:08d}")["model"]
    assert isinstance(model, dict) and len(model) > 5
    return model


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_flip, "__1_0.distcp sha256 mismatch"),
        (_zero_page, "__1_0.distcp sha256 mismatch"),
        (_truncate, "__1_0.distcp is "),
        (_no_marker, "rootopt.json unreadable (missing)"),
    ],
    ids=["flipped-byte", "zeroed-page", "truncated", "no-marker"],
)
def test_a_damaged_dcp_checkpoint_is_skipped_with_one_line_and_kept(
    dcp_runs: dict[str, Path], shards: Path, tmp_path: Path, damage: Any, reason: str
) -> None:
    """One flipped byte, a zeroed 4 KiB page or a truncation in rank 1's file of the
    newest dcp-* checkpoint: the rerun (two processes) says which checkpoint it skipped
    and why, resumes from the one before, and ends with the reference run's parameters;
    the damaged checkpoint is kept (checkpoints/invalid/), not pruned, though keep_last=1
    prunes everything else. It used to resume from the damaged one with exit 0 and wrong
    weights (flipped byte, zeroed page) or end in torch's traceback (truncation)."""
    import torch

    from _train_fixtures import torchrun

    run = tmp_path / "run"
    shutil.copytree(dcp_runs["base"], run, symlinks=True)
    victim = run / "checkpoints" / "dcp-00000008" / "__1_0.distcp"
    assert victim.stat().st_size > 3 * 4096
    damage(victim)
    damaged = _digest(victim)
    done = torchrun(2, run, shards, [*DCP, "run.max_steps=12", "checkpoint.keep_last=1"])
    said = done.stdout + done.stderr
    assert "Traceback" not in said
    skipped = [ln for ln in said.splitlines() if "skipping invalid checkpoint" in ln]
    assert len(skipped) == 1 and f"dcp-00000008: {reason}" in skipped[0], skipped
    assert "resumed from dcp-00000004 at step 4" in said
    kept = run / "checkpoints" / "invalid" / "dcp-00000008" / "__1_0.distcp"
    assert _digest(kept) == damaged
    assert sorted(p.name for p in (run / "checkpoints").glob("dcp-*")) == ["dcp-00000012"]
    ref, got = _model(dcp_runs["ref"], 12), _model(run, 12)
    assert sorted(ref) == sorted(got)
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


def test_dcp_metadata_that_would_run_code_is_refused_at_world_size_2(
    dcp_runs: dict[str, Path], shards: Path, tmp_path: Path
) -> None:
    """dcp-00000008/.metadata replaced by a pickle whose unpickling runs a shell command
    (and the marker's checksums rewritten to match, so only the unpickler stands in the
    way): two processes resume from dcp-00000004, with one line naming the refused type,
    and the command never runs (torch's reader unpickled it with plain pickle)."""
    import pickle

    from _train_fixtures import torchrun

    run = tmp_path / "run"
    shutil.copytree(dcp_runs["base"], run, symlinks=True)
    flag = tmp_path / "code-ran"
    ck = run / "checkpoints" / "dcp-00000008"
    (ck / ".metadata").write_bytes(pickle.dumps(_Gadget(flag)))
    _relist(ck)
    done = torchrun(2, run, shards, [*DCP, "run.max_steps=12"])
    said = done.stdout + done.stderr
    assert not flag.exists()
    skipped = [ln for ln in said.splitlines() if "skipping invalid checkpoint" in ln]
    assert len(skipped) == 1, skipped
    assert "dcp-00000008: .metadata is not DCP metadata" in skipped[0]
    assert "system is not a type of the DCP metadata format" in skipped[0]
    assert "resumed from dcp-00000004 at step 4" in said and "Traceback" not in said


def _small_dcp(directory: Path, step: int = 3) -> Path:
    """A real dcp-* checkpoint written in this process (no process group)."""
    import torch

    from rootopt.distributed import checkpoint as dck

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return dck.save(directory, step, model, opt, extra={"run_id": "r", "step": step})


def test_dcp_metadata_gadget_is_refused_before_it_runs(tmp_path: Path) -> None:
    """The crafted ``.metadata`` really runs code under plain pickle (what torch's reader
    does); :func:`checked`, the loader and the full-state reader refuse it, checksums
    matching or not (a checkpoint written before checksums too), and nothing runs."""
    import pickle

    from rootopt.distributed import checkpoint as dck

    flag = tmp_path / "code-ran"
    blob = pickle.dumps(_Gadget(flag))
    pickle.loads(blob)  # the proof: plain unpickling runs the command
    assert flag.exists()
    flag.unlink()
    ck = _small_dcp(tmp_path / "ck")
    assert dck.checked(ck).checksummed  # the honest checkpoint passes
    (ck / ".metadata").write_bytes(blob)
    with pytest.raises(
        dck.DistCheckpointError, match=r"\.metadata is \d+ bytes, rootopt\.json says"
    ) as info:
        dck.checked(ck)
    assert info.value.corrupt
    _relist(ck)
    for read in (dck.checked, dck.read_full_state):
        with pytest.raises(dck.DistCheckpointError, match="posix.system is not a type") as info:
            read(ck)
        assert info.value.corrupt
    # without checksums (an older checkpoint): the same refusal
    import json

    marker = json.loads((ck / dck.MARKER).read_text())
    del marker[dck.FILES]
    (ck / dck.MARKER).write_text(json.dumps(marker))
    with pytest.raises(dck.DistCheckpointError, match="posix.system is not a type"):
        dck.read_full_state(ck)
    assert not flag.exists()


def test_dcp_values_that_would_run_code_are_refused(tmp_path: Path) -> None:
    """A non-tensor value in a ``.distcp`` file (DCP stores it with ``torch.save`` and its
    default planner loads it with ``weights_only=False``) holding a code gadget: read
    with ``weights_only=True`` here, refused, and nothing runs."""
    import torch
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from rootopt.distributed import checkpoint as dck

    ck = _small_dcp(tmp_path / "ck")
    flag = tmp_path / "code-ran"
    bad = tmp_path / "bad" / "dcp-00000003"
    state = {"model": {"w": torch.ones(3)}, "optim": {"note": _Gadget(flag)}}
    dcp_save(state, storage_writer=FileSystemWriter(bad), no_dist=True)
    shutil.copy(ck / dck.EXTRA, bad / dck.EXTRA)
    shutil.copy(ck / dck.MARKER, bad / dck.MARKER)
    import json

    marker = json.loads((bad / dck.MARKER).read_text())
    marker[dck.FILES] = {p.name: {} for p in bad.iterdir() if p.name != dck.MARKER}
    (bad / dck.MARKER).write_text(json.dumps(marker))
    _relist(bad)
    assert not flag.exists()
    with pytest.raises(dck.DistCheckpointError, match="names posix.system, which is not loaded"):
        dck.read_full_state(bad)
    assert not flag.exists()


def test_a_dcp_checkpoint_without_checksums_is_read_with_a_note(tmp_path: Path) -> None:
    """An older dcp-* (no file list in its marker) is accepted with one line saying its
    bytes cannot be checked; it is still read through the safe reader."""
    from rootopt.train.checkpoint import catalog as ckpts

    data = Path(__file__).resolve().parent / "data" / "saved_dcp_fdcf298"
    shutil.copytree(data, tmp_path / "c")
    (entry,) = ckpts.list_checkpoints(tmp_path / "c")
    state, note = ckpts.read(entry).state, ckpts.read(entry).note
    assert isinstance(state, dict) and "written before checkpoints carried checksums" in note
    ck = _small_dcp(tmp_path / "new")
    (new,) = ckpts.list_checkpoints(ck.parent)
    assert ckpts.read(new).note == ""


def test_a_peer_killed_during_a_collective_save_leaves_one_line(
    shards: Path, tmp_path: Path
) -> None:
    """Rank 1 is SIGKILLed inside the collective save of dcp-00000008. The surviving
    rank 0 says one line naming the save and the intact checkpoint, with no traceback (it
    used to print torch's traceback of the broken gather); the same command then resumes
    from dcp-00000004 and cleans the partial save.

    The two ranks are started as torchrun starts them (its environment, one process per
    rank), without its agent: the agent, finding rank 1 dead, would stop rank 0 with
    SIGTERM on its own schedule (itself one line, but another path); holding it off with a
    long ``--monitor-interval`` cost 12 s a run."""
    import json
    import subprocess
    import sys

    from _faultkit import free_port, kill_session
    from _train_fixtures import torchrun, torchrun_env

    run = tmp_path / "run"
    script = Path(__file__).resolve().parent / "dist_scripts" / "train_hooked.py"
    argv = ["--data_path", str(shards), "--log_dir", str(run), *DCP, "run.max_steps=12"]
    spec = {"argv": argv, "die_rank": 1, "die_in_save_at": 8}
    env = torchrun_env()
    env["PYTHONPATH"] += os.pathsep + str(Path(__file__).resolve().parent)
    env.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    env["MASTER_PORT"] = str(free_port())
    ranks = []
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}.out", "w") as out:  # the rank holds its own copy
            ranks.append(
                subprocess.Popen(
                    [sys.executable, str(script), json.dumps(spec)],
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    try:
        codes = [proc.wait(timeout=240) for proc in ranks]
    finally:
        for proc in ranks:
            kill_session(proc)  # a rank still running after a failure above
    assert codes[1] == -9 and codes[0] not in (0, -9), codes
    text = (tmp_path / "rank0.out").read_text()
    assert "Traceback" not in text, text[-3000:]
    lines = [ln for ln in text.splitlines() if ln.startswith("rootopt train")]
    assert len(lines) == 1, text[-3000:]
    assert "checkpoint save (dcp-00000008)" in lines[0]
    assert "last checkpoint dcp-00000004 is intact" in lines[0]
    assert list((run / "checkpoints").glob(".dcp-00000008.partial-*"))
    again = torchrun(2, run, shards, [*DCP, "run.max_steps=12"])
    assert "resumed from dcp-00000004 at step 4" in again.stdout
    assert not list((run / "checkpoints").glob(".dcp-*.partial-*"))
    assert (run / "checkpoints" / "dcp-00000012").is_dir()


# --------------------------------------------------------------------------- 3. identity from the computation


def _final_state(run: Path) -> dict[str, Any]:
    from rootopt.train import checkpoint

    found, _ = checkpoint.newest_valid(run / "checkpoints")
    assert found is not None
    return {"model": found.state["model"], "optimizer": found.state["optimizer"]}


def _same_state(a: Any, b: Any, where: str = "") -> None:
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), where
        for k in a:
            _same_state(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


IDENT = [*FAST, "run.max_steps=8", "checkpoint.every=4"]
# Each of these is outside the run's identity: the same key, and the same numbers.
NOT_THE_COMPUTATION = [
    "data.num_workers=2",
    "data.verify_checksums=false",
    "data.corpus=bbc",  # the shards are given: the corpus settings are unused
    "data.text_field=body",
    "checkpoint.keep_last=1",
    "checkpoint.every=3",
    "checkpoint.on_signal=false",
    "monitoring.jsonl=false",
    "monitoring.tensorboard=true",
    "monitoring.histogram_every=2",
    "monitoring.plot=true",
    "run.log_every=1",
    "run.eval_every=2",
    "run.eval_batches=1",
    "run.max_time=3600",
    "run.name=elsewhere",
    "run.peak_tflops=500",  # only the mfu metric divides by it
    "distributed.timeout_s=60",
    "mixed_precision.dtype=fp16",  # autocast is off: unused
    "mixed_precision.init_scale=8",
]


def test_what_does_not_change_the_numbers_does_not_name_another_run(
    shards: Path, tmp_path: Path
) -> None:
    """Each key the identity leaves out is trained with and the final parameters and
    optimizer state are compared bit for bit with the run without it; each one keeps the
    key (and so the default directory). A device or backend equal to what ``auto``
    resolves to keeps it too. They used to start a new run from step 0."""
    import torch

    from rootopt.train.run.directory import identity_key

    base_cfg = load_config(None, IDENT)
    key = identity_key(base_cfg, str(shards))
    train(base_cfg, tmp_path / "base", str(shards), say=_quiet)
    base = _final_state(tmp_path / "base")
    auto = [] if torch.cuda.is_available() else ["run.device=cpu", "distributed.backend=gloo"]
    for i, over in enumerate([*NOT_THE_COMPUTATION, *auto]):
        cfg = load_config(None, [*IDENT, over])
        assert identity_key(cfg, str(shards)) == key, over
        run = tmp_path / f"r{i}"
        train(cfg, run, str(shards), say=_quiet)
        _same_state(base, _final_state(run), over)


def test_what_changes_the_numbers_names_another_run(shards: Path) -> None:
    """Keys that change what is computed change the key, and a new config key is part of
    the identity unless it is listed as not: every resolved key is either in the
    identity or in NOT_IDENTITY (or normalised: the autocast settings when autocast is off,
    the corpus settings when the shards are given, data.path as the resolved data path,
    model.hf_config and model.init_from when empty)."""
    from rootopt.config import to_dict
    from rootopt.train.run import directory as rundir

    cfg = load_config(None, IDENT)
    key = rundir.identity_key(cfg, str(shards))
    for over in (
        "optimization.base_lr=1e-3",
        "run.seed=1",
        "run.threads=2",
        "run.max_steps=9",
        "data.batch_size=4",
        "data.seq_len=16",
        "model.d_model=64",
        "optimization.schedule=linear",
        "distributed.parallel=fsdp",
        "mixed_precision.enabled=true",
        "run.device=cuda",
    ):
        assert rundir.identity_key(load_config(None, [*IDENT, over]), str(shards)) != key, over
    assert rundir.identity_key(cfg, str(shards / "x")) != key
    ident = rundir.identity(load_config(None, [*IDENT, "mixed_precision.enabled=true"]), None)
    flat = rundir._flatten(to_dict(cfg))
    for section_key, _ in flat:
        section, rest = section_key.split(".", 1)
        skip = rundir.NOT_IDENTITY.get(section, ())
        if "*" in skip or rest.split(".")[0] in skip or section_key == "data.path":
            continue
        if section_key in ("model.hf_config", "model.init_from"):  # unused when empty
            continue
        assert section_key in ident, section_key


def test_a_new_default_directory_names_the_run_it_did_not_continue(
    shards: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without --log_dir: another data.num_workers / keep_last / monitoring setting finds
    the same run (already complete); another base_lr starts a new run and says which run
    of the same name it did not continue and which keys differ."""
    monkeypatch.chdir(tmp_path)
    args = ["--data_path", str(shards), *IDENT]
    assert train_main(args) == 0
    (first,) = (tmp_path / "runs").iterdir()
    capsys.readouterr()
    assert train_main([*args, "data.num_workers=1", "checkpoint.keep_last=1"]) == 0
    out = capsys.readouterr().out
    assert f"run dir: runs/{first.name}" in out and "already complete: step 8 of 8" in out
    assert train_main([*args, "optimization.base_lr=1e-3", "run.max_steps=6"]) == 0
    out = capsys.readouterr().out.splitlines()
    second = [p.name for p in (tmp_path / "runs").iterdir() if p.name != first.name]
    assert len(second) == 1
    assert out[0] == f"run dir: runs/{second[0]}"
    assert out[1] == (
        f"note: a run named 'default' exists in runs/{first.name} with other settings "
        f"(optimization.base_lr, run.max_steps); this starts a new run in runs/{second[0]}. "
        f"To continue that one, pass --log_dir runs/{first.name}"
    )


def test_a_run_named_by_the_earlier_key_is_still_found(
    shards: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A default run directory an earlier version named (its key covered the whole
    config) is found by the same command after the upgrade, not started again."""
    from rootopt.train.run.directory import legacy_identity_key

    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, IDENT)
    old = Path("runs") / f"default-{legacy_identity_key(cfg, str(shards))}"
    train(cfg, old, str(shards), say=_quiet)
    capsys.readouterr()
    assert train_main(["--data_path", str(shards), *IDENT]) == 0
    out = capsys.readouterr().out
    assert f"run dir: {old}" in out and "already complete: step 8 of 8" in out
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [old.name]


# --------------------------------------------------------------------------- 4. one clear line each

SITE_HOOK = """
import os, signal, sys
_AT = os.environ["ROOTOPT_TEST_SIGINT_AT"]

class _Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == _AT:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, _Interrupt())
"""


def _sigint_default() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize(
    ("command", "at"),
    [("rootopt", "rootopt.cli"), ("rootopt", "typing"), ("-m", "rootopt.train")],
    ids=["console-script", "importing-typing", "python-m"],
)
def test_sigint_while_the_command_starts_is_one_line(tmp_path: Path, command: str, at: str) -> None:
    """Ctrl-C delivered at a chosen import of the command's start-up (deterministically,
    where a real Ctrl-C in the first ~0.3 s lands on a loaded machine): one line and the
    SIGINT status, no traceback (it used to print the KeyboardInterrupt traceback)."""
    import signal
    import subprocess
    import sys

    from _faultkit import console_script, env

    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(SITE_HOOK)
    e = env(ROOTOPT_TEST_SIGINT_AT=at)
    e["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "hook"), e["PYTHONPATH"]])
    argv = (
        [console_script("rootopt"), "train"]
        if command == "rootopt"
        else [
            sys.executable,
            "-m",
            "rootopt.train",
        ]
    )
    done = subprocess.run(
        [*argv, "--log_dir", str(tmp_path / "run")],
        env=e,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        # as in a terminal: SIGINT at its default action. A test run started in the
        # background (`&` in a non-interactive shell) would hand it down ignored, and the
        # command, rightly, would not hear it.
        preexec_fn=_sigint_default,
    )
    assert done.returncode == -signal.SIGINT, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "rootopt: interrupted while starting; nothing was written"
    ]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("which", ["run.json", "owner.json", "config.yaml"])
def test_a_full_disk_while_setting_up_names_the_file(
    shards: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    which: str,
) -> None:
    """ENOSPC at the set-up write of run.json, owner.json or config.yaml: one line that
    names the file (it used to say only "I/O error: No space left on device")."""
    import errno

    import rootopt._atomic

    real = os.fsync
    target = {"name": ""}

    def fsync(fd: int) -> None:
        if target["name"] and os.readlink(f"/proc/self/fd/{fd}").split("/")[-1].startswith(
            f".{target['name']}."
        ):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd")
    monkeypatch.setattr(rootopt._atomic.os, "fsync", fsync)
    run = tmp_path / "run"
    target["name"] = which
    rc = train_main(["--data_path", str(shards), "--log_dir", str(run), *FAST])
    line = _err_line(capsys)
    assert rc == 1, line
    where = run / which if which != "owner.json" else run / "checkpoints" / which
    assert line == f"rootopt train: I/O error: No space left on device ({where})"
    assert not [p for p in run.rglob(f".{which}.*")]  # no temporary left behind


def test_a_complete_run_on_a_read_only_file_system_says_already_complete(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The directory of a finished run mounted read-only: the same command says
    "already complete" (status 0), and one that would train more says it cannot write
    (status 2); it used to say "not writable" for both."""
    import subprocess

    run = tmp_path / "run"
    args = ["--data_path", str(shards), "--log_dir", str(run), *FAST, "run.max_steps=6"]
    assert train_main(args) == 0
    got = subprocess.run(["mount", "--bind", str(run), str(run)], capture_output=True)
    if got.returncode != 0:
        pytest.skip(f"cannot bind-mount here ({got.stderr.decode().strip()[:80]})")
    try:
        got = subprocess.run(
            ["mount", "-o", "remount,ro,bind", str(run)], capture_output=True, text=True
        )
        if got.returncode != 0:
            pytest.skip(f"cannot remount read-only here ({got.stderr.strip()[:80]})")
        capsys.readouterr()
        assert train_main(args) == 0
        out = capsys.readouterr().out
        assert "already complete: step 6 of 6 (checkpoint ckpt-00000006.pt)" in out
        assert "nothing was written: run directory" in out and "Read-only file system" in out
        assert train_main([*args, "run.max_steps=8"]) == 2
        line = _err_line(capsys)
        assert "is not writable (Read-only file system)" in line
    finally:
        subprocess.run(["umount", str(run)], capture_output=True)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_bad_inputs_are_one_line_each(
    shards: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each used to be accepted silently or reported misleadingly; each is one line,
    status 2, and nothing is created."""
    import hashlib
    import json

    import torch

    monkeypatch.chdir(tmp_path)
    plain = _write(tmp_path / "notes.txt", "hello\n")
    garbage = tmp_path / "g" / "ckpt-00000003.pt"
    garbage.parent.mkdir()
    garbage.write_bytes(os.urandom(3000))
    blob = garbage.read_bytes()
    meta = {"format_version": 1, "step": 3, "sha256": hashlib.sha256(blob).hexdigest()}
    garbage.with_suffix(".json").write_text(json.dumps({**meta, "bytes": len(blob)}))
    base = ["--data_path", str(shards), "--log_dir", str(tmp_path / "run"), *FAST]
    cases: list[tuple[list[str], dict[str, str], str]] = [
        ([*base, "data.corpus="], {}, "config error: data.corpus: empty"),
        (["--data_path", "", *FAST], {}, "--data_path: empty path"),
        (
            ["--config", str(_write(tmp_path / "null.yaml", "run:\n  seed: 1\nmodel:\n")), *base],
            {},
            "config error: model: the section is empty (null); give it keys or remove the line",
        ),
        (
            [
                "--config",
                str(_write(tmp_path / "tag.yaml", "model: !!python/object:os.system {}\n")),
            ],
            {},
            "the YAML tag '!!python/object:os.system' is not supported",
        ),
        ([*base], {"LOCAL_RANK": "x"}, "environment: LOCAL_RANK='x' is not an integer"),
        (
            [*base, f"checkpoint.resume={plain}"],
            {},
            f"checkpoint.resume: {str(plain)!r} is not a rootopt checkpoint",
        ),
        (
            [*base, f"checkpoint.resume={garbage}"],
            {},
            "ckpt-00000003.pt: not a checkpoint (torch.save writes a zip archive",
        ),
    ]
    if not torch.cuda.is_available():  # a launch of two processes: refused when it starts
        two = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
        two["MASTER_PORT"] = "29599"
        cases.append(
            ([*base, "distributed.backend=nccl"], two, "nccl needs a CUDA device; use gloo")
        )
    for argv, environ, want in cases:
        with monkeypatch.context() as m:
            for k, v in environ.items():
                m.setenv(k, v)
            capsys.readouterr()
            rc = train_main(argv)
        line = _err_line(capsys)
        assert rc == 2 and want in line, (argv[-1], line)
        assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists(), want
    # nccl in one process without CUDA: accepted (unused), with a note
    from rootopt.train.main import _environment_notes

    notes = _environment_notes(load_config(None, ["distributed.backend=nccl"]))
    assert len(notes) == (0 if torch.cuda.is_available() else 1)
    # YAML merge keys are YAML, and load (an explicit key wins over a merged one)
    merged = _write(
        tmp_path / "m.yaml", "model:\n  <<: {d_model: 32, n_layers: 2}\n  n_layers: 3\n"
    )
    cfg = load_config(merged)
    assert (cfg.model.d_model, cfg.model.n_layers) == (32, 3)


def test_report_refuses_what_is_not_a_run_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``rootopt report`` on a summary.json that holds ``[]``, and on a binary
    metrics.jsonl: one line naming the file and what is wrong (status 2); they used to
    pass silently, or be called "no records; is it a run directory?"."""
    from rootopt import cli

    a = tmp_path / "a"
    a.mkdir()
    (a / "summary.json").write_text("[]\n")
    (a / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.0}\n')
    assert cli.main(["report", str(a)]) == 2
    assert _err_line(capsys) == (
        f"rootopt report: {str(a / 'summary.json')!r} is not a run summary (it holds a list; "
        "rootopt train writes a JSON object)"
    )
    b = tmp_path / "b"
    b.mkdir()
    (b / "metrics.jsonl").write_bytes(bytes(range(256)) * 40)
    assert cli.main(["report", str(b)]) == 2
    assert "is not a metrics log: binary data and no JSON record" in _err_line(capsys)
    # a log with a cut last line (a crash, a full disk) is still a log: reported on
    (b / "metrics.jsonl").write_bytes(
        b'{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.0}\n{"st\x00\x00'
    )
    assert cli.main(["report", str(b)]) == 1
    assert "metrics.jsonl" in capsys.readouterr().out


def test_coeffs_bad_inputs_are_refused_before_any_work(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``coeffs show --steps 0``, ``coeffs fit`` on a shape whose spectra would take
    minutes to sample, and ``coeffs build-table`` without ``--out`` or with ``--out`` naming
    the table shipped inside the package (an editable install used to rewrite its source
    tree): one refusal each, status 2, the shipped table byte-identical."""
    from rootopt import cli
    from rootopt_analysis.coeffs.build import DEFAULT_OUT

    shipped = _digest(DEFAULT_OUT)
    with pytest.raises(SystemExit) as info:
        cli.main(["coeffs", "show", "--steps", "0"])
    assert info.value.code == 2
    assert "--steps: expected an integer >= 1, got '0'" in capsys.readouterr().err
    assert cli.main(["coeffs", "fit", "--shape", "64x100000000"]) == 2
    assert "the limit is 16777216" in _err_line(capsys)
    with pytest.raises(SystemExit) as info:
        cli.main(["coeffs", "build-table", "--shape", "1x1"])
    assert info.value.code == 2
    assert "the following arguments are required: --out" in capsys.readouterr().err
    link = tmp_path / "table.json"
    link.symlink_to(DEFAULT_OUT)
    for out in (DEFAULT_OUT, link):
        assert cli.main(["coeffs", "build-table", "--shape", "1x1", "--out", str(out)]) == 2
        assert "is the table shipped inside the package" in _err_line(capsys)
    assert _digest(DEFAULT_OUT) == shipped


def test_the_checkpoint_integrity_benchmark_runs_and_refuses_an_existing_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """benchmarks/bench_checkpoint_integrity.py on a tiny model: JSON with the four
    medians and the two ratios; an existing --json is refused before any work."""
    import importlib.util
    import json

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_checkpoint_integrity.py"
    spec = importlib.util.spec_from_file_location("bench_checkpoint_integrity", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "b.json"
    assert bench.main(["--params", "4096", "--repeats", "1", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert sorted(got["median_s"]) == ["rootopt_load", "rootopt_save", "torch_load", "torch_save"]
    assert all(v > 0 for v in got["median_s"].values())
    assert got["save_ratio"] > 0 and got["load_ratio"] > 0 and got["checkpoint_bytes"] > 4096 * 4
    capsys.readouterr()
    assert bench.main(["--json", str(out)]) == 2
    assert "exists; choose another --json" in capsys.readouterr().err
