"""Progress is never lost on a rerun: rebuilt data resumes (D3), the last good checkpoint
survives divergence episodes and kills (D4), a checkpoint this build cannot read stops the
run instead of being skipped (D5), the final evaluation survives a signal (D6) and a
failed evaluation is redone (D7), stale temporary files are removed (D14), files follow
the umask (D16), and `restart` keeps the old run's config (issue 18).
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from _faultkit import tree_state, victim
from _train_fixtures import FAST, TINY, final_params, prepare_tiny
from _train_fixtures import quiet as _quiet
from rootopt.config import load_config
from rootopt.data import ShardError, load_manifest, prepare
from rootopt.monitor import read_jsonl
from rootopt.train import Diverged, Hooks, train
from rootopt.train.checkpoint import list_checkpoints
from rootopt.train.main import main as train_main


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_tiny(tmp_path_factory.mktemp("shards"))


def _model(run_dir: Path) -> dict[str, torch.Tensor]:
    m = final_params(run_dir)["model"]
    assert isinstance(m, dict)
    return m


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and len(a) > 5 and all(torch.equal(a[k], b[k]) for k in a)


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "Traceback" not in err[0] and len(err[0]) < 700
    return err[0]


# --------------------------------------------------------------------------- D3


def test_prepared_shards_are_byte_reproducible(tmp_path: Path) -> None:
    a = prepare("kjv", tmp_path / "a", seq_len=32, max_bytes=60_000, samples_per_shard=300)
    b = prepare("kjv", tmp_path / "b", seq_len=32, max_bytes=60_000, samples_per_shard=300)
    names = [e["name"] for s in a["splits"].values() for e in s]
    assert len(names) >= 3 and names == [e["name"] for s in b["splits"].values() for e in s]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert (tmp_path / "a" / "manifest.json").read_bytes() == (
        tmp_path / "b" / "manifest.json"
    ).read_bytes()


def test_deleted_run_data_is_prepared_again_and_the_run_resumes(tmp_path: Path) -> None:
    """D3: a run that prepared its own data, interrupted; its data/ deleted; the same
    command prepares it again and resumes (it used to refuse forever: different tar bytes)."""
    over = [*FAST, "data.corpus=kjv", "data.max_bytes=150000", "run.max_steps=20"]
    run = tmp_path / "run"
    part = train(
        load_config(None, over), run, None, say=_quiet, hooks=Hooks(after_step=lambda s: s == 8)
    )
    assert part.steps == 8
    shutil.rmtree(run / "data")
    said: list[str] = []
    s = train(load_config(None, over), run, None, say=said.append)
    assert s.resumed_from == "ckpt-00000008.pt" and s.steps == 20, said
    whole = tmp_path / "whole"
    train(load_config(None, over), whole, None, say=_quiet)
    assert _same(_model(whole), _model(run))


def test_a_resume_on_other_data_is_refused_before_the_data_is_touched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """D2 on a run that is not live: the rerun with another data.max_bytes is refused with
    one line naming the setting, before its prepared data is replaced (it used to prepare
    the data again, then refuse "written for different data shards", the old data gone)."""
    run = tmp_path / "run"
    over = [*FAST, "data.corpus=kjv", "data.max_bytes=150000", "run.max_steps=10"]
    assert train_main(["--log_dir", str(run), *over]) == 0
    before = _without_locks(tree_state(run))
    capsys.readouterr()
    assert train_main(["--log_dir", str(run), *over, "data.max_bytes=90000"]) == 2
    line = _one_line(capsys)
    assert "data.max_bytes: 150000 → 90000" in line, line
    assert _without_locks(tree_state(run)) == before


# --------------------------------------------------------------------------- D4


def test_last_good_checkpoint_survives_divergence_episodes_and_kills(
    shards: Path, tmp_path: Path
) -> None:
    """D4: good checkpoint at step 10; a NaN episode (steps 11-13) and checkpoints written
    inside it; SIGKILL at step 17; the rerun resumes inside the episode and diverges on a
    second NaN streak; the next rerun must resume from the good checkpoint (it used to be
    pruned, and the run silently started from step 0)."""
    run = tmp_path / "run"
    base = ["--data_path", str(shards), "--log_dir", str(run), *FAST, "checkpoint.every=2"]
    args = [*base, "run.max_steps=40", "checkpoint.keep_last=1", "run.max_nonfinite=4"]
    first = victim({"argv": args, "nan_steps": [10, 11, 12], "kill_at": 17})
    assert first.returncode == -9, first.stderr[-2000:]

    def nan(step: int, model: torch.nn.Module) -> None:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.fill_(float("nan"))

    cfg = load_config(None, args[4:])
    with pytest.raises(Diverged, match=r"diverged at step .*ckpt-00000010\.pt is kept"):
        train(cfg, run, str(shards), say=_quiet, hooks=Hooks(after_backward=nan))
    said: list[str] = []
    s = train(cfg, run, str(shards), say=said.append)
    assert s.resumed_from == "ckpt-00000010.pt", said
    assert s.steps == 40


# --------------------------------------------------------------------------- D5


def _two_checkpoints(shards: Path, run: Path) -> list[str]:
    base = ["--data_path", str(shards), "--log_dir", str(run), *FAST, "checkpoint.keep_last=3"]
    assert train_main([*base, "run.max_steps=20"]) == 0
    names = [p.name for p in list_checkpoints(run / "checkpoints")]
    assert names == ["ckpt-00000010.pt", "ckpt-00000020.pt"]
    return base


@pytest.mark.parametrize("fault", ["newer_format", "load_error", "eio"])
def test_an_unreadable_checkpoint_stops_the_run_and_keeps_everything(
    shards: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    fault: str,
) -> None:
    """D5: the newest checkpoint is intact but this build cannot read it (a newer format
    version, a load error after its checksum verified, EIO). The rerun stops with one line
    and status 2, and nothing in the run directory changes (it used to skip it, resume from
    an older checkpoint or from step 0 with status 0, and prune it)."""
    run = tmp_path / "run"
    base = _two_checkpoints(shards, run)
    newest = run / "checkpoints" / "ckpt-00000020.pt"
    side = newest.with_suffix(".json")
    meta = json.loads(side.read_text())
    if fault == "newer_format":
        side.write_text(json.dumps({**meta, "format_version": 2}) + "\n")
    elif fault == "load_error":
        # a pickle that weights_only loading refuses, with a matching checksum
        buf = io.BytesIO()
        torch.save({"step": 20, "model": Path("x")}, buf)
        newest.write_bytes(buf.getvalue())
        import hashlib

        side.write_text(
            json.dumps({**meta, "sha256": hashlib.sha256(buf.getvalue()).hexdigest()}) + "\n"
        )
    before = _without_locks(tree_state(run))
    if fault == "eio":  # the sidecar's read fails with EIO (injected: a failing disk)
        real = Path.read_bytes

        def eio(self: Path) -> bytes:
            if self.name == "ckpt-00000020.json":
                raise OSError(errno.EIO, os.strerror(errno.EIO), str(self))
            return real(self)

        monkeypatch.setattr(Path, "read_bytes", eio)
    capsys.readouterr()
    assert train_main([*base, "run.max_steps=40", "checkpoint.keep_last=1"]) == 2
    monkeypatch.undo()
    line = _one_line(capsys)
    assert "ckpt-00000020" in line and "nothing was started" in line, line
    assert _without_locks(tree_state(run)) == before


def _without_locks(state: dict[str, Any]) -> dict[str, Any]:
    """The tree without the run's own lock files, which the launch takes (and stamps with
    its pid) before it checks anything; directory mtimes stay (no file came or went)."""
    return {k: v for k, v in state.items() if Path(k).name != ".lock"}


# --------------------------------------------------------------------------- D6


@pytest.mark.parametrize(("sig", "status"), [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_during_the_final_evaluation(
    shards: Path, tmp_path: Path, sig: str, status: int
) -> None:
    """D6: SIGINT/SIGTERM at the start of the final evaluation (after the final
    checkpoint). The line is true (a final checkpoint exists), summary.json says so, and
    the rerun runs the final evaluation (it used to say "stopped without a final
    checkpoint", SIGTERM left no summary, and no rerun ever evaluated)."""
    run = tmp_path / "run"
    args = ["--data_path", str(shards), "--log_dir", str(run), *TINY, "run.max_steps=20"]
    got = victim({"argv": args, "final_eval_signal": sig})
    assert got.returncode == status, got.stderr[-2000:]
    text = got.stdout + got.stderr
    assert "without a final checkpoint" not in text and "Traceback" not in text
    assert "after the final checkpoint ckpt-00000020.pt" in got.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["checkpoint"] == "ckpt-00000020.pt"
    assert not [
        r for r in read_jsonl(run / "metrics.jsonl") if r.get("step") == 20 and "val_loss" in r
    ]
    s = train(load_config(None, args[4:]), run, str(shards), say=_quiet)
    assert s.status == "completed" and s.session_steps == 0
    whole = tmp_path / "whole"
    train(load_config(None, args[4:]), whole, str(shards), say=_quiet)
    want = [r for r in read_jsonl(whole / "metrics.jsonl") if "val_loss" in r]
    have = [r for r in read_jsonl(run / "metrics.jsonl") if "val_loss" in r]
    assert [(r["step"], r["val_loss"]) for r in have] == [(r["step"], r["val_loss"]) for r in want]
    assert want[-1]["step"] == 20


# --------------------------------------------------------------------------- D7


def test_a_failed_evaluation_is_redone_on_resume(shards: Path, tmp_path: Path) -> None:
    """D7: the validation shard disappears just before the evaluation at step 10; the run
    stops with an emergency checkpoint at step 10; with the shard back, the rerun writes
    the step-10 validation record first (it used to be lost)."""
    d = tmp_path / "d"
    shutil.copytree(shards, d)
    over = [*TINY, "run.max_steps=20", "run.eval_every=10", "checkpoint.every=1000"]
    val = d / "val-000000.tar"

    def hide(step: int) -> bool:
        if step == 9:
            val.rename(val.with_suffix(".gone"))
        return False

    run = tmp_path / "run"
    with pytest.raises(ShardError, match=r"val-000000.*emergency checkpoint ckpt-00000010\.pt"):
        train(load_config(None, over), run, str(d), say=_quiet, hooks=Hooks(after_step=hide))
    val.with_suffix(".gone").rename(val)
    train(load_config(None, over), run, str(d), say=_quiet)
    whole = tmp_path / "whole"
    train(load_config(None, over), whole, str(d), say=_quiet)

    def vals(r: Path) -> list[tuple[int, float]]:
        return [
            (x["step"], x["val_loss"]) for x in read_jsonl(r / "metrics.jsonl") if "val_loss" in x
        ]

    assert vals(run) == vals(whole) and [s for s, _ in vals(whole)] == [10, 20]


# --------------------------------------------------------------------------- D14, D16


def test_stale_temporary_files_of_the_run_are_removed_at_start(
    shards: Path, tmp_path: Path
) -> None:
    """D14: temporary files a killed save left behind (``.ckpt-*.tmp``, a ``.dcp-*.partial-*``
    directory, ``.run.json.*.tmp``) are removed when the run starts again; files that are
    not ours stay."""
    run = tmp_path / "run"
    base = ["--data_path", str(shards), "--log_dir", str(run), *FAST]
    assert train_main([*base, "run.max_steps=10"]) == 0
    ck = run / "checkpoints"
    stale = [
        ck / ".ckpt-00000020.pt.k2j3h4.tmp",
        ck / ".ckpt-00000020.json.x8y9z0.tmp",
        run / ".run.json.a1b2c3.tmp",
        run / ".metrics.jsonl.q1w2e3.tmp",
    ]
    for p in stale:
        p.write_bytes(b"partial")
    partial = ck / ".dcp-00000020.partial-0123456789ab"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"partial")
    user = [run / ".my-notes.tmp", ck / "keep-me.tmp"]
    for p in user:
        p.write_text("mine")
    assert train_main([*base, "run.max_steps=20"]) == 0
    assert [p for p in [*stale, partial] if p.exists()] == []
    assert all(p.read_text() == "mine" for p in user)


def test_files_follow_the_umask(shards: Path, tmp_path: Path) -> None:
    """D16: manifests, checksums, checkpoints, run.json and owner.json get the permissions
    the umask gives (they used to be 0600 whatever the umask: a shared dataset was
    unreadable to the user's group)."""
    old = os.umask(0o022)
    try:
        prepare("kjv", tmp_path / "data", seq_len=32, max_bytes=40_000, samples_per_shard=400)
        run = tmp_path / "run"
        train(
            load_config(None, [*FAST, "run.max_steps=5"]), run, str(tmp_path / "data"), say=_quiet
        )
        os.umask(0o027)
        run2 = tmp_path / "run2"
        train(
            load_config(None, [*FAST, "run.max_steps=5"]), run2, str(tmp_path / "data"), say=_quiet
        )
    finally:
        os.umask(old)
    for path, mode in [
        (tmp_path / "data" / "manifest.json", 0o644),
        (tmp_path / "data" / "SHA256SUMS", 0o644),
        (run / "run.json", 0o644),
        (run / "checkpoints" / "owner.json", 0o644),
        (run / "checkpoints" / "ckpt-00000005.pt", 0o644),
        (run / "checkpoints" / "ckpt-00000005.json", 0o644),
        (run / "summary.json", 0o644),
        (run2 / "run.json", 0o640),
        (run2 / "checkpoints" / "ckpt-00000005.pt", 0o640),
    ]:
        assert path.stat().st_mode & 0o777 == mode, (path.name, oct(path.stat().st_mode))


# --------------------------------------------------------------------------- restart


def test_restart_moves_the_old_config_aside(shards: Path, tmp_path: Path) -> None:
    """`checkpoint.resume=restart` keeps the old run's config.yaml (and env.json, run.json)
    in previous/ instead of overwriting them."""
    run = tmp_path / "run"
    base = ["--data_path", str(shards), "--log_dir", str(run), *FAST, "run.max_steps=5"]
    assert train_main(base) == 0
    old_cfg = (run / "config.yaml").read_text()
    old_id = json.loads((run / "run.json").read_text())["run_id"]
    assert train_main([*base, "checkpoint.resume=restart", "optimization.base_lr=1e-3"]) == 0
    (prev,) = (run / "previous").iterdir()
    assert (prev / "config.yaml").read_text() == old_cfg
    assert json.loads((prev / "run.json").read_text())["run_id"] == old_id
    assert json.loads((run / "run.json").read_text())["run_id"] != old_id
    assert "base_lr: 0.001" in (run / "config.yaml").read_text()


def test_manifest_records_content_digests(shards: Path) -> None:
    m: dict[str, Any] = load_manifest(shards)
    entries = [e for s in m["splits"].values() for e in s]
    assert entries and all(len(e["content"]) == 64 for e in entries)
