"""Fault battery: nothing a user owns is lost, every failure is one line.

Each test names the fault it injects; docs/training.md ("Fault battery") lists the faults
these tests inject. Process kills use real SIGKILL; full and read-only disks are
an ``OSError`` raised at the write (the tests run as root, where chmod does not restrict).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from _train_fixtures import FAST, TINY, final_params, prepare_tiny
from _train_fixtures import quiet as _quiet
from rootopt import checkpoint
from rootopt.config import load_config
from rootopt.data import ShardError, load_manifest, prepare
from rootopt.monitor import read_jsonl
from rootopt.train import Hooks, TrainingError, train
from rootopt.train.checkpoint import list_checkpoints, newest_valid, prune
from rootopt.train.checkpoint.catalog import next_serial
from rootopt.train.main import main as train_main

SRC = Path(__file__).resolve().parents[1] / "src"
TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_tiny(tmp_path_factory.mktemp("shards"))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _params(run_dir: Path) -> dict[str, torch.Tensor]:
    state = final_params(run_dir)["model"]
    assert isinstance(state, dict)
    return state


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _losses(run_dir: Path) -> dict[int, Any]:
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"duplicate records: {steps}"
    return {r["step"]: (r["loss"], r["steps"]) for r in rows}


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert len(err[0]) < 600, err[0][:200]
    return err[0]


# --------------------------------------------------------------------------- data ownership


def test_prepare_refuses_a_directory_it_does_not_own(tmp_path: Path) -> None:
    from rootopt.commands.data import main as data_main

    out = tmp_path / "mine"
    out.mkdir()
    (out / "holiday.tar").write_bytes(b"user data")
    args = ["prepare", "--corpus", "kjv", "--out", str(out), "--max_bytes", "20000"]
    assert data_main(args) == 2
    assert (out / "holiday.tar").read_bytes() == b"user data"
    assert sorted(p.name for p in out.iterdir()) == ["holiday.tar"]


def test_prepare_replaces_only_the_files_its_manifest_lists(tmp_path: Path) -> None:
    out = tmp_path / "shards"
    prepare("kjv", out, seq_len=16, max_bytes=30_000, samples_per_shard=400)
    before = {e["name"] for s in load_manifest(out)["splits"].values() for e in s}
    (out / "notes.txt").write_text("mine")
    (out / "extra-000000.tar").write_bytes(b"mine too")
    prepare("kjv", out, seq_len=16, max_bytes=20_000, samples_per_shard=100)
    after = {e["name"] for s in load_manifest(out)["splits"].values() for e in s}
    assert len(after) > len(before)
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "extra-000000.tar").read_bytes() == b"mine too"
    # a planned name that the manifest does not list is refused, not overwritten
    (out / "manifest.json").write_text(
        json.dumps({**load_manifest(out), "splits": {"train": [], "val": []}})
    )
    with pytest.raises(ShardError, match="refusing to overwrite"):
        prepare("kjv", out, seq_len=16, max_bytes=20_000, samples_per_shard=100)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.pop("splits"), "no 'splits' mapping"),
        (lambda m: m.update(splits=[1, 2]), "no 'splits' mapping"),
        (lambda m: m["splits"]["train"][0].pop("name"), "has no 'name'"),
        (lambda m: m["splits"]["train"][0].update(name="../x.tar"), "not a plain shard file"),
        (lambda m: m["splits"]["train"][0].update(name="/etc/x.tar"), "not a plain shard file"),
        (lambda m: m["splits"].update(val="v.tar"), "splits.val is not a list"),
        (lambda m: m["splits"]["train"][0].update(samples="9"), "valid 'samples'"),
    ],
)
def test_bad_manifest_is_one_line(shards: Path, tmp_path: Path, edit: Any, message: str) -> None:
    d = _copy(shards, tmp_path / "d")
    m = json.loads((d / "manifest.json").read_text())
    edit(m)
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ShardError, match=message):
        load_manifest(d)


# --------------------------------------------------------------------------- validate before step 1


@pytest.mark.parametrize("fault", ["corrupt_val", "missing_val", "truncated_unchecked"])
def test_bad_shard_stops_before_step_one(
    shards: Path, tmp_path: Path, fault: str, capsys: pytest.CaptureFixture[str]
) -> None:
    d = _copy(shards, tmp_path / "d")
    over = [*FAST]
    if fault == "corrupt_val":
        blob = bytearray((d / "val-000000.tar").read_bytes())
        blob[900] ^= 0xFF
        (d / "val-000000.tar").write_bytes(bytes(blob))
    elif fault == "missing_val":
        (d / "val-000000.tar").unlink()
    else:
        victim = d / "train-000002.tar"
        victim.write_bytes(victim.read_bytes()[:5000])
        over.append("data.verify_checksums=false")
    run = tmp_path / "run"
    assert train_main(["--data_path", str(d), "--log_dir", str(run), *over]) == 2
    line = _one_line(capsys)
    assert "shard" in line and ("val-000000" in line or "train-000002" in line)
    assert not [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]  # no step ran


def test_data_deleted_mid_run_leaves_an_emergency_checkpoint(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = _copy(shards, tmp_path / "d")
    over = [*FAST, "run.max_steps=60", "checkpoint.every=1000"]
    train(load_config(None, over), tmp_path / "whole", str(d), say=_quiet)

    def delete(step: int) -> bool:
        if step == 3:
            for p in d.glob("train-*.tar"):
                p.rename(p.with_suffix(".gone"))
        return False

    with pytest.raises(ShardError, match=r"missing.*emergency checkpoint ckpt-\d+\.pt written"):
        train(
            load_config(None, over),
            tmp_path / "run",
            str(d),
            say=_quiet,
            hooks=Hooks(after_step=delete),
        )
    ckpts = list_checkpoints(tmp_path / "run" / "checkpoints")
    assert len(ckpts) == 1 and checkpoint.load(ckpts[0].path)["reason"] == "emergency"
    for p in d.glob("train-*.gone"):
        p.rename(p.with_suffix(".tar"))
    s = train(load_config(None, over), tmp_path / "run", str(d), say=_quiet)
    assert s.resumed_from == ckpts[0].name and s.steps == 60
    assert _same(_params(tmp_path / "whole"), _params(tmp_path / "run"))
    assert _losses(tmp_path / "whole").keys() == _losses(tmp_path / "run").keys()


# --------------------------------------------------------------------------- checkpoint ownership


def test_restart_after_invalid_checkpoints_keeps_what_it_writes(
    shards: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    over = [*FAST, "checkpoint.keep_last=2"]
    train(load_config(None, [*over, "run.max_steps=40"]), run, str(shards), say=_quiet)
    for e in list_checkpoints(run / "checkpoints"):
        e.path.write_bytes(b"garbage")
    s = train(load_config(None, [*over, "run.max_steps=20"]), run, str(shards), say=_quiet)
    assert s.resumed_from == "" and s.steps == 20
    kept = [p.name for p in list_checkpoints(run / "checkpoints")]
    assert "ckpt-00000020.pt" in kept and s.checkpoint == "ckpt-00000020.pt"
    assert checkpoint.load(run / "checkpoints" / "ckpt-00000020.pt")["step"] == 20


def test_resume_never_on_a_used_dir_refuses_and_restart_moves_it_aside(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    base = ["--data_path", str(shards), "--log_dir", str(run), *FAST, "run.max_steps=10"]
    assert train_main(base) == 0
    old = (run / "checkpoints" / "ckpt-00000010.pt").read_bytes()
    old_metrics = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert train_main([*base, "checkpoint.resume=never"]) == 2
    line = _one_line(capsys)
    assert "checkpoint.resume=restart" in line and "ckpt-00000010.pt" in line
    assert (run / "checkpoints" / "ckpt-00000010.pt").read_bytes() == old
    assert train_main([*base, "checkpoint.resume=restart", "optimization.base_lr=1e-3"]) == 0
    (prev,) = (run / "previous").iterdir()
    assert (prev / "checkpoints" / "ckpt-00000010.pt").read_bytes() == old
    assert (prev / "metrics.jsonl").read_text() == old_metrics
    assert checkpoint.load(run / "checkpoints" / "ckpt-00000010.pt")["config"]["optimization"][
        "base_lr"
    ] == pytest.approx(1e-3)


def test_second_run_on_a_shared_checkpoint_dir_is_refused(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shared = tmp_path / "ckpts"
    a = ["--data_path", str(shards), *FAST, "run.max_steps=10", f"checkpoint.dir={shared}"]
    assert train_main([*a, "--log_dir", str(tmp_path / "A")]) == 0
    before = {p.name: p.read_bytes() for p in shared.iterdir() if p.suffix == ".pt"}
    capsys.readouterr()
    rc = train_main(
        [*a, "--log_dir", str(tmp_path / "B"), "run.seed=3", "optimization.base_lr=1e-2"]
    )
    assert rc == 2
    assert "belongs to another run" in _one_line(capsys)
    assert {p.name: p.read_bytes() for p in shared.iterdir() if p.suffix == ".pt"} == before


def test_a_live_process_holds_its_checkpoint_dir(shards: Path, tmp_path: Path) -> None:
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    lock = checkpoint.DirLock(ckpts)
    lock.acquire()
    try:
        with pytest.raises(checkpoint.CheckpointError, match="in use by another training process"):
            train(
                load_config(None, [*FAST, "run.max_steps=2"]),
                tmp_path / "run",
                str(shards),
                say=_quiet,
            )
    finally:
        lock.release()


def test_pruning_goes_by_write_order_and_run(tmp_path: Path) -> None:
    payload = {"x": torch.zeros(2)}

    def save(step: int, run_id: str, keep_last: int) -> None:  # as the run's checkpointer
        path = checkpoint.save(tmp_path, step, payload, run_id=run_id, serial=next_serial(tmp_path))
        prune(tmp_path, run_id=run_id, keep_last=keep_last, keep=path)

    save(90, "other", 5)
    for step in (50, 60):
        save(step, "mine", 5)
    for step in (10, 20):  # a restart of "mine" from step 0: lower steps, written later
        save(step, "mine", 2)
    names = sorted(p.name for p in list_checkpoints(tmp_path))
    assert names == ["ckpt-00000010.pt", "ckpt-00000020.pt", "ckpt-00000090.pt"]
    found, _ = newest_valid(tmp_path)
    assert found is not None and found.path.name == "ckpt-00000020.pt"


# --------------------------------------------------------------------------- divergence


def test_divergence_stops_keeps_the_good_checkpoint_and_report_names_the_cause(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rootopt.monitor.report import check_run

    run = tmp_path / "run"
    base = ["--data_path", str(shards), "--log_dir", str(run), *FAST]
    assert train_main([*base, "run.max_steps=20", "checkpoint.keep_last=1"]) == 0
    good = (run / "checkpoints" / "ckpt-00000020.pt").read_bytes()
    capsys.readouterr()
    over = [
        "run.max_steps=80",
        "checkpoint.keep_last=1",
        "checkpoint.every=2",
        "optimization.base_lr=1e3",
        "run.max_nonfinite=4",
        "optimization.clip.mode=none",
    ]
    assert train_main([*base, *over]) == 1
    line = _one_line(capsys)
    assert "diverged at step" in line and "ckpt-00000020.pt" in line and "base_lr" in line
    # a changed config names a new default run directory: the hint names this one
    assert f"rerun with --log_dir {run} to resume from it" in line
    kept = list_checkpoints(run / "checkpoints")
    assert [p.name for p in kept] == ["ckpt-00000020.pt"] and kept[0].path.read_bytes() == good
    rep = check_run(run)
    assert "diverged" in rep.symptoms and "nonfinite" not in rep.symptoms
    assert "mixed precision" not in rep.render() and "learning rate too high" in rep.render()
    assert json.loads((run / "summary.json").read_text())["status"] == "diverged"


def test_fp16_scale_overflow_every_step_is_divergence(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rootopt.monitor.report import check_run

    run = tmp_path / "run"
    args = [
        "--data_path",
        str(shards),
        "--log_dir",
        str(run),
        *FAST,
        "run.max_steps=40",
        "mixed_precision.enabled=true",
        "mixed_precision.dtype=fp16",
        "mixed_precision.loss_scale=1e30",
        "run.max_nonfinite=6",
    ]
    assert train_main(args) == 1
    assert "6 consecutive non-finite steps" in _one_line(capsys)
    assert not list_checkpoints(run / "checkpoints")
    assert "nonfinite" in check_run(run).symptoms  # fp16: the loss scale is the likely cause


def test_loss_spike_rule(shards: Path, tmp_path: Path) -> None:
    from rootopt.train.metrics.records import account, divergence
    from rootopt.train.run.state import TrainState
    from rootopt.train.step import StepResult

    cfg = load_config(
        None, ["run.loss_spike_factor=3", "run.loss_spike_window=10", "run.loss_spike_patience=3"]
    )

    class R:
        pass

    r: Any = R()
    r.cfg, r.state = cfg, TrainState()
    stops = []
    for i, loss in enumerate([2.0] * 12 + [7.0, 2.1, 7.0, 7.0, 7.0]):
        out = StepResult(loss, 1.0, True, [1e-3], 8)
        account(r.state, out)
        reason = divergence(r, out)
        if reason:
            stops.append((i, reason))
    assert len(stops) == 1 and stops[0][0] == 16 and "median 2" in stops[0][1]


# --------------------------------------------------------------------------- honest logs


def test_records_are_strict_json_with_every_groups_lr(shards: Path, tmp_path: Path) -> None:
    def nan(step: int, model: torch.nn.Module) -> None:
        if step < 5:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))

    cfg = load_config(None, [*FAST, "run.max_steps=10"])
    train(cfg, tmp_path / "run", str(shards), say=_quiet, hooks=Hooks(after_backward=nan))

    def refuse(token: str) -> None:
        raise ValueError(token)

    for name in ("metrics.jsonl", "events.jsonl", "summary.json"):
        text = (tmp_path / "run" / name).read_text()
        for line in text.splitlines() if name.endswith("l") else [text]:
            json.loads(line, parse_constant=refuse)
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert rows[0]["loss"] is None and rows[0]["steps"] == 5 and rows[0]["finite_steps"] == 0
    assert rows[1]["finite_steps"] == 5 and isinstance(rows[1]["loss"], float)
    labels = set(rows[1]["lr_groups"])
    assert {"0.root", "1.adamw"} <= labels or len(labels) >= 2, labels


def test_resume_keeps_lr_and_base_lr_consistent(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rootopt.train.schedule import LRMultiplier

    run = tmp_path / "run"
    base = ["--data_path", str(shards), "--log_dir", str(run), *FAST, "run.log_every=1"]
    assert train_main([*base, "run.max_steps=10"]) == 0
    capsys.readouterr()
    assert train_main([*base, "run.max_steps=20", "optimization.base_lr=1e-3"]) == 0
    out = capsys.readouterr().out
    assert "10 steps in" in out and "(20 in total)" in out and "base_lr changed" in out
    lrs = {r["step"]: r["lr"] for r in read_jsonl(run / "metrics.jsonl") if "lr" in r}
    sched = LRMultiplier("cosine", warmup=5, total=20, min_ratio=0.1)
    for step in (11, 12, 20):  # step n runs at multiplier(n - 1) of the *new* schedule and lr
        assert lrs[step] == pytest.approx(1e-3 * sched(step - 1), rel=1e-12), step


def test_truncated_metrics_fail_the_report(shards: Path, tmp_path: Path) -> None:
    from rootopt.monitor.report import check_run

    run = tmp_path / "run"
    train(load_config(None, [*FAST, "run.max_steps=20"]), run, str(shards), say=_quiet)
    text = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(text[: len(text) - 40])
    rep = check_run(run)
    assert not rep.ok and "incomplete_log" in rep.symptoms


# --------------------------------------------------------------------------- full and read-only disks


@pytest.mark.parametrize("where", ["checkpoint_enospc", "checkpoint_erofs", "metrics_enospc"])
def test_disk_errors_lose_nothing(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    import rootopt._atomic
    from rootopt.monitor import metrics

    over = [*FAST, "run.max_steps=30", "checkpoint.every=5"]
    train(load_config(None, over), tmp_path / "whole", str(shards), say=_quiet)
    armed = {"on": False}
    code = errno.EROFS if where == "checkpoint_erofs" else errno.ENOSPC
    real_fsync, real_log = os.fsync, metrics.Monitor.log

    def fsync(fd: int) -> None:
        if armed["on"]:
            raise OSError(code, os.strerror(code))
        real_fsync(fd)

    def log(self: Any, record: dict[str, Any], labelled: Any = None) -> None:
        if armed["on"] and "loss" in record:
            raise OSError(code, os.strerror(code), str(self.run_dir / "metrics.jsonl"))
        real_log(self, record, labelled)

    if where.startswith("checkpoint"):
        monkeypatch.setattr(rootopt._atomic.os, "fsync", fsync)
    else:
        monkeypatch.setattr(metrics.Monitor, "log", log)
    run = tmp_path / "run"
    hooks = Hooks(after_step=lambda s: armed.update(on=s >= 12) and False)
    with pytest.raises(TrainingError) as info:
        train(load_config(None, over), run, str(shards), say=_quiet, hooks=hooks)
    msg = str(info.value)
    assert "\n" not in msg and os.strerror(code) in msg
    if where.startswith("checkpoint"):
        assert "ckpt-00000015.pt" in msg and "ckpt-00000010.pt is intact" in msg
    else:
        assert "emergency checkpoint ckpt-00000015.pt written" in msg
    assert not list((run / "checkpoints").glob(".*.tmp"))
    monkeypatch.undo()
    s = train(load_config(None, over), run, str(shards), say=_quiet)
    assert s.steps == 30 and s.resumed_from
    assert _same(_params(tmp_path / "whole"), _params(run))
    assert _losses(tmp_path / "whole") == _losses(run)


# --------------------------------------------------------------------------- SIGKILL


KILL_OVER = [
    *TINY,
    "run.max_steps=36",
    "checkpoint.every=4",
    "run.log_every=5",
    "run.eval_every=12",
]

VICTIM = """
import os, signal, sys
from pathlib import Path
from rootopt.config import load_config
from rootopt.train import Hooks, train
shards, run, kill_at, over = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
def hook(step):
    if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return False
train(load_config(None, over), run, shards, say=lambda m: None,
      hooks=Hooks(after_step=hook if kill_at > 0 else None))
"""


def _kill_trial(shards: Path, run: Path, rng: random.Random, mode: str) -> str:
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{TESTS}"}
    kill_at = rng.randint(5, 33) if mode == "step" else 0
    proc = subprocess.Popen(
        [sys.executable, "-c", VICTIM, str(shards), str(run), str(kill_at), *KILL_OVER],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    if mode == "time":  # an arbitrary point: mid-step, mid-write, mid-log
        deadline = time.time() + 120
        metrics = run / "metrics.jsonl"
        while (
            time.time() < deadline
            and proc.poll() is None
            and not (metrics.is_file() and metrics.stat().st_size > 0)
        ):
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.6))
        proc.send_signal(signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode in (-signal.SIGKILL, 0), err[-2000:]
    return f"{mode}@{kill_at or 'random'} rc={proc.returncode}"


def _battery(shards: Path, tmp_path: Path, trials: list[str], seed: int) -> None:
    whole = tmp_path / "whole"
    train(load_config(None, KILL_OVER), whole, str(shards), say=_quiet)
    want_params, want_losses = _params(whole), _losses(whole)
    rng = random.Random(seed)
    for i, mode in enumerate(trials):
        run = tmp_path / f"trial{i}"
        _kill_trial(shards, run, rng, mode)
        s = train(load_config(None, KILL_OVER), run, str(shards), say=_quiet)
        assert s.steps == 36
        assert _same(want_params, _params(run)), f"trial {i} ({mode}): parameters differ"
        assert _losses(run) == want_losses, f"trial {i} ({mode}): logged losses differ"
        vals = [
            (r["step"], r["val_loss"]) for r in read_jsonl(run / "metrics.jsonl") if "val_loss" in r
        ]
        assert vals == [
            (r["step"], r["val_loss"])
            for r in read_jsonl(whole / "metrics.jsonl")
            if "val_loss" in r
        ]


def test_sigkill_at_random_points_resumes_identically(shards: Path, tmp_path: Path) -> None:
    _battery(shards, tmp_path, ["step", "step", "time"], seed=7)


@pytest.mark.slow
def test_sigkill_battery_extended(shards: Path, tmp_path: Path) -> None:
    _battery(shards, tmp_path, ["step", "time"] * 6, seed=11)


# --------------------------------------------------------------------------- memory and smaller bugs


def test_log_step_statistics_use_per_tensor_reductions() -> None:
    from rootopt.train.step import RATIO_SAMPLE, grad_stats, param_sample, update_ratios

    model = torch.nn.Sequential(torch.nn.Linear(600, 500), torch.nn.Linear(500, 3))
    model(torch.randn(4, 600)).sum().backward()
    params = list(model.parameters())
    stats = grad_stats(params)
    flat = torch.cat([p.grad.abs().flatten() for p in params if p.grad is not None])
    assert stats["grad_abs_max"] == float(flat.max())
    assert stats["grad_abs_min"] == float(flat[flat > 0].min())
    snap = param_sample(model)
    assert len(snap) == len(params)
    assert all(t.numel() <= RATIO_SAMPLE for t, _ in snap.values())  # bounded, not a clone
    small = dict(model.named_parameters())["1.weight"]
    assert snap["1.weight"][1] == 1  # small tensors: every entry (exact)
    with torch.no_grad():
        small.mul_(1.5)
    ratios = update_ratios(snap, model)
    assert ratios["1.weight"] == pytest.approx(0.5, rel=1e-6)
    assert ratios["0.weight"] == 0.0


def test_resolve_data_prepares_again_when_its_settings_change(tmp_path: Path) -> None:
    from rootopt.train.build import ProcessInfo
    from rootopt.train.data import resolve_data

    info = ProcessInfo(0, 1, 0)
    base = ["data.corpus=kjv", "data.seq_len=16", "data.samples_per_shard=500"]
    out = resolve_data(load_config(None, [*base, "data.max_bytes=20000"]), tmp_path, None, info)
    first = load_manifest(out)
    again = resolve_data(load_config(None, [*base, "data.max_bytes=20000"]), tmp_path, None, info)
    assert load_manifest(again) == first  # unchanged settings: reused
    bigger = load_manifest(
        resolve_data(load_config(None, [*base, "data.max_bytes=40000"]), tmp_path, None, info)
    )
    assert bigger["text_bytes"] == 40000 > first["text_bytes"]
    other = load_manifest(
        resolve_data(
            load_config(None, [*base, "data.max_bytes=40000", "data.val_fraction=0.2"]),
            tmp_path,
            None,
            info,
        )
    )
    n_val = sum(e["samples"] for e in other["splits"]["val"])
    assert n_val > sum(e["samples"] for e in bigger["splits"]["val"])


def test_diagnose_uses_the_runs_own_data(shards: Path, tmp_path: Path) -> None:
    from rootopt.train.tools.diagnose import diagnose

    run = tmp_path / "run"
    train(load_config(None, [*FAST, "run.max_steps=5"]), run, str(shards), say=_quiet)
    lines = diagnose(run)
    assert lines[0].startswith("diagnostics at step 5 (checkpoint)")
    assert not (run / "data").exists()  # nothing prepared into the run dir
