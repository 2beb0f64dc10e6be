"""The Checkpointer (rootopt.train.checkpoint): one listing of both formats, one "newest
valid" rule, one prune rule, and every caller (resume, export, diagnose) on them."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from _train_fixtures import FAST, prepare_tiny
from _train_fixtures import quiet as _quiet
from rootopt.config import load_config
from rootopt.train import train

OLD_DCP_RUN = Path(__file__).resolve().parent / "data" / "ddp_run_3ad6c87"
# the settings tests/data/make_ddp_run.py trained that run with (its model and data)
OLD_DCP_OVER = [
    *FAST,
    "run.log_every=1",
    "checkpoint.every=4",
    "optimization.warmup_steps=5",
    "optimization.schedule=constant",
]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_tiny(tmp_path_factory.mktemp("ckpt-shards") / "d")


def _flip(path: Path) -> None:
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x55
    path.write_bytes(bytes(blob))


def _unlink(path: Path) -> None:
    path.unlink()


def _garble(path: Path) -> None:
    path.write_text("{not json")


@pytest.mark.parametrize(
    ("damage", "reason"),
    [(_unlink, "rootopt.json unreadable (missing)"), (_garble, "rootopt.json unreadable (")],
    ids=["missing", "garbled"],
)
def test_a_dcp_checkpoint_without_a_readable_marker_is_set_aside_never_pruned(
    shards: Path, tmp_path: Path, damage: Callable[[Path], None], reason: str
) -> None:
    """A torchrun run's newest ``dcp-*`` lost its ``rootopt.json`` (or it is garbled): the
    rerun (one process here) names it, moves it to ``checkpoints/invalid/`` and resumes from
    the one before; keep_last=1 prunes everything else. It used to sort as the oldest: the
    resume took the previous one without a word and pruning deleted the damaged one."""
    run = tmp_path / "run"
    shutil.copytree(OLD_DCP_RUN, run)
    ck = run / "checkpoints"
    shutil.copytree(ck / "dcp-00000004", ck / "dcp-00000005")
    damage(ck / "dcp-00000005" / "rootopt.json")
    said: list[str] = []
    over = [*OLD_DCP_OVER, "run.max_steps=6", "checkpoint.keep_last=1"]
    s = train(load_config(None, over), run, str(shards), say=said.append)
    skipped = [line for line in said if "skipping invalid checkpoint" in line]
    assert len(skipped) == 1 and f"dcp-00000005: {reason}" in skipped[0], said
    assert f"(kept in {ck / 'invalid'})" in skipped[0]
    assert s.resumed_from == "dcp-00000004" and s.steps == 6
    kept = ck / "invalid" / "dcp-00000005"
    assert (kept / "extra.pt").read_bytes() == (
        OLD_DCP_RUN / "checkpoints" / "dcp-00000004" / "extra.pt"
    ).read_bytes()
    left = sorted(p.name for p in ck.iterdir() if not p.name.startswith("."))
    assert left == ["ckpt-00000006.json", "ckpt-00000006.pt", "invalid", "owner.json"]


def test_export_says_which_checkpoint_it_skipped_and_why(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The newest checkpoint is corrupt: the export names it and why, as training does,
    and exports the one before (it used to do so without a word)."""
    pytest.importorskip("transformers")
    from rootopt.commands.export import main as export_main

    run = tmp_path / "run"
    train(load_config(None, [*FAST, "run.max_steps=20"]), run, str(shards), say=_quiet)
    newest = run / "checkpoints" / "ckpt-00000020.pt"
    _flip(newest)
    damaged = newest.read_bytes()
    capsys.readouterr()
    assert export_main([str(run), str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("skipping invalid checkpoint: ckpt-00000020.pt: sha256 mismatch"), out
    assert "exported ckpt-00000010.pt (step 10)" in out[-1], out
    assert newest.read_bytes() == damaged  # an export reads the run, never moves it
    assert not (run / "checkpoints" / "invalid").exists()


def test_diagnose_and_export_read_a_run_whose_checkpoints_are_elsewhere(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``checkpoint.dir`` outside the run directory: ``rootopt diagnose RUN`` reads its
    newest checkpoint there (it used to look in RUN/checkpoints only and diagnose a fresh
    model), and so does ``rootopt export``."""
    pytest.importorskip("transformers")
    from rootopt.commands.diagnose import main as diagnose_main
    from rootopt.commands.export import main as export_main

    run, elsewhere = tmp_path / "run", tmp_path / "kept"
    over = [*FAST, "run.max_steps=10", f"checkpoint.dir={elsewhere}"]
    train(load_config(None, over), run, str(shards), say=_quiet)
    assert (elsewhere / "ckpt-00000010.pt").is_file() and not (run / "checkpoints").exists()
    capsys.readouterr()
    assert diagnose_main([str(run)]) == 0
    assert capsys.readouterr().out.startswith("diagnostics at step 10 (checkpoint)")
    assert export_main([str(run), str(tmp_path / "out")]) == 0
    assert "exported ckpt-00000010.pt (step 10)" in capsys.readouterr().out


# --------------------------------------------------------------------------- the catalog


def _pt(directory: Path, step: int, run_id: str, serial: int) -> Path:
    from rootopt import checkpoint

    return checkpoint.save(directory, step, {"x": torch.zeros(2)}, run_id=run_id, serial=serial)


def _dcp(directory: Path, step: int, run_id: str, serial: int) -> Path:
    """A real dcp-* checkpoint written in this process (no process group)."""
    from rootopt.distributed import checkpoint as dck

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meta = {"run_id": run_id, "suspect": False, "serial": serial}
    return dck.save(directory, step, model, opt, extra={"run_id": run_id}, meta=meta)


def test_one_listing_orders_both_formats_by_write_and_puts_the_unreadable_last(
    tmp_path: Path,
) -> None:
    """One serial orders ``.pt`` and ``dcp-*`` together (not the step: a restarted run
    writes lower steps later); a checkpoint whose sidecar or marker cannot be read counts
    as the newest, in either format."""
    from rootopt.train.checkpoint import list_checkpoints, newest_valid

    _dcp(tmp_path, 30, "r", 1)
    _pt(tmp_path, 40, "r", 2)
    _pt(tmp_path, 10, "r", 3)
    _dcp(tmp_path, 20, "r", 4)
    names = [e.name for e in list_checkpoints(tmp_path)]
    assert names == ["dcp-00000030", "ckpt-00000040.pt", "ckpt-00000010.pt", "dcp-00000020"]
    found, skipped = newest_valid(tmp_path)
    assert found is not None and found.path.name == "dcp-00000020" and skipped == []
    assert found.state["run_id"] == "r"  # a dcp-*: its extra.pt
    (tmp_path / "dcp-00000030" / "rootopt.json").unlink()
    (tmp_path / "ckpt-00000040.json").unlink()
    listed = list_checkpoints(tmp_path)
    assert [e.name for e in listed][-2:] == ["dcp-00000030", "ckpt-00000040.pt"]
    assert [e.valid for e in listed] == [True, True, False, False]
    assert listed[-2].reason == "rootopt.json unreadable (missing)"
    found, skipped = newest_valid(tmp_path)
    assert found is not None and found.path.name == "dcp-00000020"
    assert len(skipped) == 2
    assert skipped[0].startswith("ckpt-00000040.pt: no checksum sidecar")
    assert skipped[1].startswith("dcp-00000030: rootopt.json unreadable (missing)")


def test_one_prune_rule_deletes_only_what_a_readable_record_names_as_this_runs(
    tmp_path: Path,
) -> None:
    """Both formats count, oldest written first; never deleted: the one just written,
    another run's, one of another format version, and one whose record cannot be read
    (a damaged checkpoint is kept, it used to be pruned when it was a ``dcp-*``)."""
    import json

    from rootopt.train.checkpoint import list_checkpoints, prune

    _dcp(tmp_path, 1, "mine", 1)
    torn = _dcp(tmp_path, 2, "mine", 2)
    (torn / "rootopt.json").unlink()  # its extra.pt still names the run
    _pt(tmp_path, 3, "other", 3)
    future = _pt(tmp_path, 4, "mine", 4)
    meta = json.loads(future.with_suffix(".json").read_text())
    future.with_suffix(".json").write_text(json.dumps({**meta, "format_version": 99}))
    _pt(tmp_path, 5, "mine", 5)
    _dcp(tmp_path, 6, "mine", 6)
    newest = _pt(tmp_path, 7, "mine", 7)
    gone = prune(tmp_path, run_id="mine", keep_last=2, keep=newest)
    assert [p.name for p in gone] == ["dcp-00000001", "ckpt-00000005.pt"]
    left = [e.name for e in list_checkpoints(tmp_path)]
    assert left == [
        "ckpt-00000003.pt",
        "ckpt-00000004.pt",
        "dcp-00000006",
        "ckpt-00000007.pt",
        "dcp-00000002",
    ]
    assert (tmp_path / "dcp-00000002" / "extra.pt").is_file()
    assert not (tmp_path / "ckpt-00000005.json").exists()
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        prune(tmp_path, run_id="mine", keep_last=0)


def test_set_aside_never_replaces_what_was_set_aside_before(tmp_path: Path) -> None:
    """A checkpoint moved into ``invalid/`` (or ``diverged/``) where one of the same name
    already lies gets a suffix: the earlier one stays."""
    from rootopt.train.checkpoint import list_checkpoints
    from rootopt.train.checkpoint.catalog import INVALID, set_aside

    first = _pt(tmp_path, 8, "r", 1)
    earlier = first.read_bytes()
    assert set_aside(tmp_path, list_checkpoints(tmp_path), INVALID) == ["ckpt-00000008.pt"]
    second = _pt(tmp_path, 8, "r2", 2)  # another run wrote step 8 again
    assert second.read_bytes() != earlier
    again = second.read_bytes()
    assert set_aside(tmp_path, list_checkpoints(tmp_path), INVALID) == ["ckpt-00000008.pt"]
    kept = sorted(p.name for p in (tmp_path / INVALID).iterdir())
    assert kept == [
        "ckpt-00000008.json",
        "ckpt-00000008.json.1",
        "ckpt-00000008.pt",
        "ckpt-00000008.pt.1",
    ]
    assert (tmp_path / INVALID / "ckpt-00000008.pt").read_bytes() == earlier
    assert (tmp_path / INVALID / "ckpt-00000008.pt.1").read_bytes() == again
    assert list_checkpoints(tmp_path) == []


def test_a_second_divergence_keeps_what_the_first_set_aside(shards: Path, tmp_path: Path) -> None:
    """Two sessions diverge alike: each moves its suspect checkpoints (13 and 14, written
    inside the episode that began at step 11) into ``checkpoints/diverged/``; the second
    session's get a suffix there (they used to replace the first session's)."""
    from rootopt.train import Diverged, Hooks

    run = tmp_path / "run"
    over = [*FAST, "run.max_steps=40", "checkpoint.every=2", "checkpoint.keep_last=20"]
    cfg = load_config(None, [*over, "run.max_nonfinite=4"])

    def nan(step: int, model: torch.nn.Module) -> None:
        if step in (10, 11, 14, 15, 16, 17):  # steps 11-12 and 15-18 non-finite
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))

    for _ in range(2):
        with pytest.raises(Diverged, match=r"at step 18: .*ckpt-00000010\.pt is kept"):
            train(cfg, run, str(shards), say=_quiet, hooks=Hooks(after_backward=nan))
    aside = run / "checkpoints" / "diverged"
    names = [f"ckpt-000000{s}.{x}{n}" for s in (13, 14) for x in ("json", "pt") for n in ("", ".1")]
    assert sorted(p.name for p in aside.iterdir()) == sorted(names)
    for s in (13, 14):
        first, second = (aside / f"ckpt-000000{s}.pt{n}" for n in ("", ".1"))
        assert first.read_bytes() != second.read_bytes()  # two sessions' files, both kept
