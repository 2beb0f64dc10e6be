"""Adversarial battery (slow): kill a run at chosen points, launch it twice at once, corrupt
its inputs, fill or freeze its disk, then rerun the same command until it completes.

A trial *survives* when the rerun ends with the parameters, logged losses and validation
records of an uninterrupted run and every refusal was one line with nothing of the run
changed; it *lost* something otherwise. Each test prints its rows of the battery's table
(tried, survived, lost; docs/training.md, "Fault battery"); every row must have lost 0.

    pytest -q -m slow tests/test_battery.py -s
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from _faultkit import console_script, env, kill_session, start_session, tree_state, wait_for
from _train_fixtures import TINY
from rootopt.config import load_config
from rootopt.monitor import read_jsonl
from rootopt.train import train

pytestmark = pytest.mark.slow

# run-dir data (so data preparation is part of what can be killed), checkpoints every 4
# steps, records every 2, an evaluation every 10
OVER = [
    *TINY,
    "data.corpus=kjv",
    "data.max_bytes=150000",
    "data.samples_per_shard=200",
    "run.max_steps=30",
    "run.log_every=2",
    "run.eval_every=10",
    "checkpoint.every=4",
    "checkpoint.keep_last=2",
]
TABLE: list[tuple[str, int, int, int]] = []


def _row(fault: str, tried: int, survived: int) -> None:
    TABLE.append((fault, tried, survived, tried - survived))
    print(f"\n| {fault} | {tried} | {survived} | {tried - survived} |")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run = tmp_path_factory.mktemp("battery-ref") / "run"
    train(load_config(None, OVER), run, None, say=lambda _: None)
    return _result(run)


def _result(run: Path) -> dict[str, Any]:
    from rootopt.train import checkpoint

    found, _ = checkpoint.newest_valid(run / "checkpoints")
    assert found is not None
    rows = read_jsonl(run / "metrics.jsonl")
    return {
        "model": found.state["model"],
        "loss": [(r["step"], r["loss"]) for r in rows if "loss" in r],
        "val": [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r],
        "steps": found.state["step"],
    }


def _same(ref: dict[str, Any], run: Path) -> bool:
    try:
        got = _result(run)
    except (AssertionError, OSError, ValueError):
        return False
    m1, m2 = ref["model"], got["model"]
    return (
        got["steps"] == ref["steps"]
        and sorted(m1) == sorted(m2)
        and all(torch.equal(m1[k], m2[k]) for k in m1)
        and got["loss"] == ref["loss"]
        and got["val"] == ref["val"]
    )


# A training process that kills itself at a chosen point: the n-th call of a function
# whose (last) path argument contains `match` (os.replace publishes every atomic file,
# os.rename a DCP checkpoint or a restart's move, os.unlink a pruned checkpoint).
KILLER = r"""
import json, os, shutil, signal, sys
spec = json.loads(sys.argv[1])
module = {"os": os, "shutil": shutil}[spec["module"]]
name, match, nth, when = spec["name"], spec["match"], spec["nth"], spec["when"]
real = getattr(module, name)
seen = [0]
def wrapper(*args, **kwargs):
    target = str(args[1] if name in ("replace", "rename") else args[0])
    hit = match in target
    if hit:
        seen[0] += 1
    if hit and seen[0] == nth and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    out = real(*args, **kwargs)
    if hit and seen[0] == nth and when == "after":
        os.kill(os.getpid(), signal.SIGKILL)
    return out
setattr(module, name, wrapper)
if spec.get("torn_log_at"):
    from rootopt.monitor import metrics
    real_log = metrics.Monitor.log
    def log(self, record, labelled=None):
        if record.get("step") == spec["torn_log_at"] and self._jsonl is not None:
            line = json.dumps(record)
            self._jsonl.write(line[: len(line) // 2])
            self._jsonl.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return real_log(self, record, labelled)
    metrics.Monitor.log = log
from rootopt.train.main import main
sys.exit(main(spec["argv"]))
"""


def _killer(argv: list[str], **point: Any) -> subprocess.CompletedProcess[str]:
    spec = {"argv": argv, **point}
    return subprocess.run(
        [sys.executable, "-c", KILLER, json.dumps(spec)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _rerun_until_done(argv: list[str], cwd: Path | None = None, limit: int = 3) -> list[int]:
    """The same command again until it completes; the exit statuses."""
    codes = []
    for _ in range(limit):
        got = subprocess.run(
            [sys.executable, "-m", "rootopt.train", *argv],
            env=env(),
            capture_output=True,
            text=True,
            timeout=300,
            cwd=cwd,
        )
        codes.append(got.returncode)
        if got.returncode == 0:
            break
    return codes


# --------------------------------------------------------------------------- kills


KILL_POINTS: list[tuple[str, dict[str, Any]]] = [
    *[
        (
            f"SIGKILL at step {k}",
            {
                "module": "os",
                "name": "replace",
                "match": "metrics",
                "nth": 0,
                "when": "before",
                "kill_step": k,
            },
        )
        for k in (3, 9, 14, 22, 27)
    ],
    (
        "before a checkpoint's rename (.pt written to its temporary file)",
        {"module": "os", "name": "replace", "match": ".pt", "nth": 2, "when": "before"},
    ),
    (
        "between a checkpoint and its sidecar",
        {"module": "os", "name": "replace", "match": "ckpt-00000008.pt", "nth": 1, "when": "after"},
    ),
    (
        "after a checkpoint, before pruning",
        {
            "module": "os",
            "name": "replace",
            "match": "ckpt-00000012.json",
            "nth": 1,
            "when": "after",
        },
    ),
    (
        "in the middle of pruning",
        {"module": "os", "name": "unlink", "match": ".pt", "nth": 1, "when": "after"},
    ),
    (
        "mid data preparation (interim manifest published, no shard yet)",
        {"module": "os", "name": "replace", "match": "manifest.json", "nth": 1, "when": "after"},
    ),
    (
        "mid data preparation (every shard written, checksums not yet)",
        {"module": "os", "name": "replace", "match": "SHA256SUMS", "nth": 1, "when": "before"},
    ),
    (
        "before run.json is published",
        {"module": "os", "name": "replace", "match": "run.json", "nth": 1, "when": "before"},
    ),
    (
        "a metrics line half written",
        {
            "module": "os",
            "name": "replace",
            "match": "never",
            "nth": 0,
            "when": "before",
            "torn_log_at": 18,
        },
    ),
    (
        "before the summary is published",
        {"module": "os", "name": "replace", "match": "summary.json", "nth": 2, "when": "before"},
    ),
]


def test_kills_at_chosen_points(tmp_path: Path, reference: dict[str, Any]) -> None:
    survived = 0
    for i, (name, point) in enumerate(KILL_POINTS):
        run = tmp_path / f"k{i}"
        argv = ["--log_dir", str(run), *OVER]
        point = dict(point)
        kill_step = point.pop("kill_step", None)
        # a kill right after step k, or at the n-th call of a file operation
        got = _victim_step(argv, kill_step) if kill_step is not None else _killer(argv, **point)
        assert got.returncode in (-9, 0), (name, got.stderr[-2000:])
        codes = _rerun_until_done(argv)
        ok = codes[-1] == 0 and _same(reference, run)
        stale = list(run.rglob(".*.tmp")) + list(run.rglob(".dcp-*.partial-*"))
        ok = ok and not stale
        survived += ok
        print(f"  {name}: killed={got.returncode == -9} reruns={codes} identical={ok}")
    _row(
        "SIGKILL at chosen points (steps 3-27, inside checkpoint/sidecar/prune/data/run.json/metrics/summary writes)",
        len(KILL_POINTS),
        survived,
    )
    assert survived == len(KILL_POINTS)


def _victim_step(argv: list[str], step: int) -> subprocess.CompletedProcess[str]:
    from _faultkit import victim

    return victim({"argv": argv, "kill_at": step})


def test_signals_at_chosen_steps(tmp_path: Path, reference: dict[str, Any]) -> None:
    from _faultkit import victim

    trials = [("SIGINT", 5), ("SIGTERM", 11), ("SIGINT", 20), ("SIGTERM", 29)]
    survived = 0
    for i, (sig, step) in enumerate(trials):
        run = tmp_path / f"s{i}"
        argv = ["--log_dir", str(run), *OVER]
        got = victim({"argv": argv, "kill_at": step, "signal": sig})
        want = 130 if sig == "SIGINT" else 143
        ok = got.returncode == want and "Traceback" not in got.stderr
        codes = _rerun_until_done(argv)
        ok = ok and codes == [0] and _same(reference, run)
        survived += ok
    _row("SIGINT / SIGTERM at chosen steps, then the same command", len(trials), survived)
    assert survived == len(trials)


# --------------------------------------------------------------------------- concurrent launches


def _launch(argv: list[str], cwd: Path) -> subprocess.Popen[str]:
    return start_session([sys.executable, "-m", "rootopt.train", *argv], env=env(), cwd=cwd)


def test_concurrent_launches_on_one_directory(tmp_path: Path, reference: dict[str, Any]) -> None:
    """Two launches of the same command (no --log_dir) at once, the second started 0 to
    2 s after the first; then a live run meets `restart`, another data.max_bytes and
    another model at chosen moments. Exactly one process trains; the others are refused
    with one line (or find the run complete); the run ends identical."""
    survived = tried = 0
    for i, delay in enumerate((0.0, 0.3, 1.0, 2.0)):
        cwd = tmp_path / f"c{i}"
        cwd.mkdir()
        a = _launch(OVER, cwd)
        time.sleep(delay)
        b = _launch(OVER, cwd)
        outs = [p.communicate(timeout=300) for p in (a, b)]
        codes = sorted([a.returncode, b.returncode])
        refused = [o[1] for o, p in zip(outs, (a, b), strict=True) if p.returncode == 2]
        ok = codes in ([0, 2], [0, 0]) and all(
            len([ln for ln in e.splitlines() if ln.startswith("rootopt train")]) == 1
            and "in use by another training process" in e
            for e in refused
        )
        (run,) = (cwd / "runs").iterdir()
        ok = ok and _same(reference, run)
        tried += 1
        survived += ok
        print(f"  same command twice, {delay} s apart: statuses {codes} identical={ok}")
    # a live run (frozen with SIGSTOP at a chosen checkpoint, so it is alive whatever the
    # machine's speed) meets `restart`, other data and another model: each refused with one
    # line, nothing of the live run changed; thawed, it ends identical
    for j, (extra, at) in enumerate(
        (
            (["checkpoint.resume=restart"], 4),
            (["data.max_bytes=90000"], 12),
            (["model.d_model=64"], 20),
        )
    ):
        cwd = tmp_path / f"live{j}"
        cwd.mkdir()
        live = _launch(OVER, cwd)
        try:
            wait_for(
                lambda c=cwd, a=at: any(c.glob(f"runs/*/checkpoints/ckpt-{a:08d}.json")),
                300,
                f"step {at}",
                live,
            )
            os.kill(live.pid, signal.SIGSTOP)
            (run,) = (cwd / "runs").iterdir()
            before = tree_state(run)
            other = _launch(["--log_dir", str(run), *OVER, *extra], cwd)
            _, err = other.communicate(timeout=300)
            untouched = tree_state(run) == before
            os.kill(live.pid, signal.SIGCONT)
            live.communicate(timeout=300)
        finally:
            kill_session(live)
        lines = [ln for ln in err.splitlines() if ln.startswith("rootopt train")]
        ok = other.returncode == 2 and len(lines) == 1 and "in use" in lines[0]
        ok = ok and untouched and live.returncode == 0 and _same(reference, run)
        tried += 1
        survived += ok
        print(
            f"  {extra[0]} against a live run at step {at}: refused={other.returncode == 2} untouched={untouched} identical={ok}"
        )
    _row(
        "concurrent launches: the same command twice (0-2 s apart); restart / other data / other model against a live run",
        tried,
        survived,
    )
    assert survived == tried


# --------------------------------------------------------------------------- corrupt inputs


def _fresh(tmp_path: Path, name: str, steps: int) -> tuple[Path, list[str]]:
    """A run of OVER stopped (signal path) after ``steps`` steps."""
    from rootopt.train import Hooks

    run = tmp_path / name
    argv = ["--log_dir", str(run), *OVER]
    hooks = Hooks(after_step=lambda s: s == steps)
    train(load_config(None, OVER), run, None, say=lambda _: None, hooks=hooks)
    return run, argv


def _flip(path: Path, at: int = -40) -> None:
    blob = bytearray(path.read_bytes())
    blob[at] ^= 0xFF
    path.write_bytes(bytes(blob))


CORRUPTIONS: list[tuple[str, Callable[[Path], None], str]] = [
    (
        "a flipped byte in the newest checkpoint",
        lambda r: _flip(r / "checkpoints" / "ckpt-00000016.pt"),
        "resume",
    ),
    (
        "the newest checkpoint truncated",
        lambda r: (r / "checkpoints" / "ckpt-00000016.pt").write_bytes(b"x" * 10),
        "resume",
    ),
    (
        "the newest sidecar deleted",
        lambda r: (r / "checkpoints" / "ckpt-00000016.json").unlink(),
        "resume",
    ),
    (
        "garbage lines in metrics.jsonl",
        lambda r: (r / "metrics.jsonl").open("ab").write(b'\xff\xfe{not json\n{"step": 99}\n'),
        "resume",
    ),
    (
        "a flipped byte in a train shard",
        lambda r: _flip(r / "data" / "train-000001.tar", 700),
        "refuse",
    ),
    (
        "run.json replaced by garbage",
        lambda r: (r / "run.json").write_bytes(b"\x00garbage"),
        "refuse",
    ),
    ("manifest.json damaged", lambda r: (r / "data" / "manifest.json").write_text("{"), "refuse"),
    (
        "owner.json of another run",
        lambda r: (r / "checkpoints" / "owner.json").write_text(
            json.dumps({"run_id": "f" * 32, "log_dir": "elsewhere"})
        ),
        "refuse",
    ),
]


def test_corrupt_inputs(tmp_path: Path, reference: dict[str, Any]) -> None:
    """'resume': the rerun skips the damage and ends identical. 'refuse': the rerun stops
    with one line and status 2 before touching anything; after the damage is undone
    (from a copy taken before it), the run ends identical."""
    survived = 0
    for i, (name, damage, expect) in enumerate(CORRUPTIONS):
        run, argv = _fresh(tmp_path, f"x{i}", 16)
        backup = tmp_path / f"x{i}.bak"
        shutil.copytree(run, backup)
        damage(run)
        if expect == "resume":
            ok = _rerun_until_done(argv) == [0] and _same(reference, run)
        else:
            before = tree_state(run)
            got = subprocess.run(
                [sys.executable, "-m", "rootopt.train", *argv],
                env=env(),
                capture_output=True,
                text=True,
                timeout=300,
            )
            lines = [ln for ln in got.stderr.splitlines() if ln.startswith("rootopt train")]
            after = {k: v for k, v in tree_state(run).items() if Path(k).name != ".lock"}
            ok = got.returncode == 2 and len(lines) == 1 and "Traceback" not in got.stderr
            ok = ok and after == {k: v for k, v in before.items() if Path(k).name != ".lock"}
            shutil.rmtree(run)
            shutil.copytree(backup, run)
            ok = ok and _rerun_until_done(argv) == [0] and _same(reference, run)
        survived += ok
        print(f"  {name} ({expect}): ok={ok}")
    _row(
        "corrupt inputs (checkpoint bytes / truncation / lost sidecar, garbage metrics lines, a corrupt shard, run.json, manifest, a foreign owner.json)",
        len(CORRUPTIONS),
        survived,
    )
    assert survived == len(CORRUPTIONS)


# --------------------------------------------------------------------------- full and frozen disks


@contextlib.contextmanager
def _tmpfs(where: Path, size: str) -> Any:
    where.mkdir()
    got = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
    )
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({got.stderr.decode().strip()[:80]})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_full_and_read_only_disks(tmp_path: Path, reference: dict[str, Any]) -> None:
    """A real small tmpfs: the run fills it (ENOSPC at a checkpoint or a log write); made
    larger, the same command resumes. Remounted read-only mid-run (EROFS); made writable
    again, it resumes. Each failure is one line with its cause."""
    survived = tried = 0
    for size in ("4600k", "5300k", "5700k"):  # data prep, the 2nd and the 3rd checkpoint
        mnt = _tmpfs(tmp_path / f"full{size}", size)
        with mnt as m:
            run = m / "run"
            argv = ["--log_dir", str(run), *OVER]
            got = subprocess.run(
                [sys.executable, "-m", "rootopt.train", *argv],
                env=env(),
                capture_output=True,
                text=True,
                timeout=300,
            )
            lines = [ln for ln in got.stderr.splitlines() if ln.startswith("rootopt train")]
            failed_well = (
                got.returncode in (1, 2) and len(lines) == 1 and "No space left" in lines[0]
            )
            subprocess.run(["mount", "-o", "remount,size=64m", str(m)], check=True)
            ok = (
                (failed_well or got.returncode == 0)
                and _rerun_until_done(argv) == [0]
                and _same(reference, run)
            )
            tried += 1
            survived += ok
            print(f"  tmpfs of {size}: status {got.returncode} {lines[:1]} -> identical={ok}")
    # a read-only disk: the run is killed, its disk remounted read-only (a remount needs
    # no writer holding a file open), the same command fails with one line and changes
    # nothing; writable again, the same command resumes. (EROFS in the middle of a
    # checkpoint write: tests/test_faults.py, injected.)
    with _tmpfs(tmp_path / "ro", "64m") as m:
        run = m / "run"
        argv = ["--log_dir", str(run), *OVER]
        from _faultkit import victim

        victim({"argv": argv, "kill_at": 14})
        subprocess.run(["mount", "-o", "remount,ro", str(m)], check=True)
        before = tree_state(run)
        got = subprocess.run(
            [sys.executable, "-m", "rootopt.train", *argv],
            env=env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = [ln for ln in got.stderr.splitlines() if ln.startswith("rootopt train")]
        failed_well = (
            got.returncode == 2 and len(lines) == 1 and "Read-only file system" in lines[0]
        )
        failed_well = failed_well and tree_state(run) == before
        subprocess.run(["mount", "-o", "remount,rw", str(m)], check=True)
        ok = failed_well and _rerun_until_done(argv) == [0] and _same(reference, run)
        tried += 1
        survived += ok
        print(f"  read-only disk: {lines[:1]} -> identical={ok}")
    _row(
        "full disk (a real tmpfs of 4.6-5.7 MB: full during data preparation, at the 2nd and at the 3rd checkpoint) and a run's disk remounted read-only, then space / write access back",
        tried,
        survived,
    )
    assert survived == tried


# --------------------------------------------------------------------------- the README's torchrun lines


def test_torchrun_line_ten_times(tmp_path: Path) -> None:
    """`torchrun --standalone --nproc_per_node=2 -m rootopt.train` 10 times in a row, each
    in a fresh directory (a new run each time), rank 1 starting 0 to 1.8 s after rank 0;
    then 3 launches under --max-restarts=1 with rank 1 killed after a checkpoint. Each must
    succeed. run.max_steps=8 / checkpoint.every=4 keep the battery's time."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, time\n"
        "d = os.environ.get('ROOTOPT_TEST_RANK1_DELAY')\n"
        "if d and os.environ.get('RANK') == '1':\n"
        "    time.sleep(float(d))\n"
    )
    torchrun = console_script("torchrun")
    over = ["run.max_steps=8", "checkpoint.every=4"]
    failures = 0
    for i in range(10):
        cwd = tmp_path / f"t{i}"
        cwd.mkdir()
        delay = f"{(i % 4) * 0.6:.1f}"
        got = subprocess.run(
            [torchrun, "--standalone", "--nproc_per_node=2", "-m", "rootopt.train", *over],
            cwd=cwd,
            env={
                **env(),
                "PYTHONPATH": f"{site}{os.pathsep}{env()['PYTHONPATH']}",
                "ROOTOPT_TEST_RANK1_DELAY": delay,
            },
            capture_output=True,
            text=True,
            timeout=400,
        )
        runs = list((cwd / "runs").iterdir()) if (cwd / "runs").exists() else []
        ok = got.returncode == 0 and len(runs) == 1
        ok = ok and json.loads((runs[0] / "summary.json").read_text())["steps"] == 8
        failures += not ok
        print(f"  launch {i + 1} (rank 1 +{delay} s): status {got.returncode} ok={ok}")
    _row(
        "the README's torchrun line, 10 launches in a row (rank 1 delayed 0-1.8 s)",
        10,
        10 - failures,
    )
    restarts_ok = 0
    for i in range(3):
        cwd = tmp_path / f"r{i}"
        cwd.mkdir()
        cmd = [
            torchrun,
            "--standalone",
            "--nproc_per_node=2",
            "--max-restarts=1",
            "-m",
            "rootopt.train",
            "run.max_steps=16",
            "checkpoint.every=4",
        ]
        proc = start_session(cmd, env=env(), cwd=cwd)
        try:
            wait_for(
                lambda c=cwd: any(c.glob("runs/*/checkpoints/dcp-00000004")),
                400,
                "a checkpoint",
                proc,
            )
            from test_user_path import _worker

            os.kill(_worker(proc.pid, 1), signal.SIGKILL)
            out, _err = proc.communicate(timeout=400)
        finally:
            kill_session(proc)
        ok = proc.returncode == 0 and "resumed from dcp-" in out
        restarts_ok += ok
        print(
            f"  --max-restarts=1, rank 1 killed: status {proc.returncode} resumed={'resumed from dcp-' in out}"
        )
    _row(
        "torchrun --max-restarts=1 with rank 1 SIGKILLed after a checkpoint (no --log_dir)",
        3,
        restarts_ok,
    )
    # 3 ranks, rank 2 SIGKILLed mid-run without a restart budget: both survivors' collectives
    # fail, one line is printed between them; the same command then resumes and completes
    one_line = 0
    over3 = [o if not o.startswith("run.max_steps") else "run.max_steps=120" for o in OVER]
    for i in range(3):
        cwd = tmp_path / f"d{i}"
        cwd.mkdir()
        cmd = [torchrun, "--standalone", "--nproc_per_node=3", "-m", "rootopt.train", *over3]
        proc = start_session(cmd, env=env(), cwd=cwd)
        at = 4 * (i + 2)  # after the 2nd, 3rd, 4th checkpoint
        try:
            wait_for(
                lambda c=cwd, a=at: any(c.glob(f"runs/*/checkpoints/dcp-{a:08d}")),
                400,
                "a checkpoint",
                proc,
            )
            from test_user_path import _worker

            os.kill(_worker(proc.pid, 2), signal.SIGKILL)
            _, err = proc.communicate(timeout=400)
        finally:
            kill_session(proc)
        lines = [ln for ln in err.splitlines() if ln.startswith("rootopt train")]
        again = subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=900)
        ok = proc.returncode != 0 and len(lines) == 1 and "collective" in lines[0]
        ok = ok and again.returncode == 0 and "resumed from dcp-" in again.stdout
        one_line += ok
        print(f"  3 ranks, rank 2 killed: {len(lines)} line(s); rerun status {again.returncode}")
    _row(
        "3 ranks, rank 2 SIGKILLed (no restart budget): one line between the survivors, "
        "then the same command resumes",
        3,
        one_line,
    )
    assert failures == 0 and restarts_ok == 3 and one_line == 3
