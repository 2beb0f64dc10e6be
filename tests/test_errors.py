"""One line per failure, naming the real cause (issue 18: D8-D12, D15 and the misleading
messages a new user met)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from _faultkit import env
from _train_fixtures import FAST, prepare_tiny
from _train_fixtures import quiet as _quiet
from rootopt.config import load_config
from rootopt.monitor import read_jsonl
from rootopt.train import Hooks, train
from rootopt.train.main import main as train_main


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_tiny(tmp_path_factory.mktemp("shards"))


def _line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "Traceback" not in err[0] and len(err[0]) < 700, err[0][:300]
    return err[0]


# --------------------------------------------------------------------------- D8


def test_a_full_disk_is_reported_with_its_cause(
    shards: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """D8: metrics.jsonl hits a full disk at step 15 (its file is swapped for /dev/full:
    every flush and the final close fail with the kernel's ENOSPC). The line names the
    step and the emergency checkpoint; closing the files afterwards fails again but does
    not replace it (it used to leave only "No space left on device")."""
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    from rootopt.monitor import metrics

    real = metrics.Monitor.log

    def log(self: Any, record: dict[str, Any], labelled: Any = None) -> None:
        if (
            record.get("step", 0) >= 15
            and self._jsonl is not None
            and self._jsonl.name != "/dev/full"
        ):
            self._jsonl.close()
            self._jsonl = open("/dev/full", "a", encoding="utf-8")  # noqa: SIM115
        real(self, record, labelled)

    monkeypatch.setattr(metrics.Monitor, "log", log)
    run = tmp_path / "run"
    rc = train_main(["--data_path", str(shards), "--log_dir", str(run), *FAST, "run.max_steps=30"])
    assert rc == 1
    line = _line(capsys)
    assert "No space left on device" in line and "(at step 15)" in line, line
    assert "emergency checkpoint ckpt-00000015.pt written" in line, line
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and "at step 15" in summary["detail"]


# --------------------------------------------------------------------------- D9, D10


def test_a_data_worker_failure_is_one_line(
    shards: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """D9: with data.num_workers=2 the shards disappear mid-run; the worker's error
    becomes one line naming the shard and the worker (it used to print the worker's
    traceback)."""
    d = tmp_path / "d"
    shutil.copytree(shards, d)
    import rootopt.train.loop as loop

    real = loop.train

    def train_hidden(*a: Any, **k: Any) -> Any:
        def hide(step: int) -> bool:
            if step == 3:
                for p in d.glob("train-*.tar"):
                    p.rename(p.with_suffix(".gone"))
            return False

        k["hooks"] = Hooks(after_step=hide)
        return real(*a, **k)

    monkeypatch.setattr(loop, "train", train_hidden)
    args = ["--data_path", str(d), "--log_dir", str(tmp_path / "r"), *FAST]
    args += ["data.num_workers=2", "run.max_steps=200"]
    assert train_main(args) == 2
    line = _line(capsys)
    assert "is missing from" in line and "(in data-loader worker" in line, line
    assert line.endswith("rerun to resume"), line  # an emergency or the periodic checkpoint


def test_cpu_out_of_memory_is_one_line(
    shards: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """D10: the CPU allocator refuses (a real ``RuntimeError`` from torch, 2**50 bytes
    asked for at step 5's backward). One line with the fix and the emergency checkpoint
    (it used to be a 55-line traceback)."""
    import rootopt.train.loop as loop

    real = loop.train

    def train_oom(*a: Any, **k: Any) -> Any:
        def allocate(step: int, model: torch.nn.Module) -> None:
            if step == 4:
                torch.empty(1 << 50, dtype=torch.uint8)

        k["hooks"] = Hooks(after_backward=allocate)
        return real(*a, **k)

    monkeypatch.setattr(loop, "train", train_oom)
    args = ["--data_path", str(shards), "--log_dir", str(tmp_path / "r"), *FAST, "run.max_steps=20"]
    assert train_main(args) == 1
    line = _line(capsys)
    assert line.startswith("rootopt train: out of memory at step 5"), line
    assert "can't allocate memory" in line and "data.batch_size" in line
    assert "emergency checkpoint ckpt-00000004.pt written" in line
    events = [e["event"] for e in read_jsonl(tmp_path / "r" / "events.jsonl")]
    assert "oom" in events


# --------------------------------------------------------------------------- D11


# The child restores Python's own SIGINT handler first: a test run started in the background
# (`cmd &` in a script, nohup) inherits SIGINT ignored, and Python then never installs it, so
# the kill below would be ignored and the test would train to the end instead.
_SIGINT_AT_TORCH = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while torch starts importing
        return None
sys.meta_path.insert(0, Interrupt())
"""


@pytest.mark.parametrize(
    "entry",
    [
        "from rootopt.cli import main; sys.exit(main())",  # what the `rootopt` script runs
        "import runpy; runpy.run_module('rootopt.train', run_name='__main__')",  # python -m
    ],
)
def test_ctrl_c_while_importing_is_one_line(tmp_path: Path, entry: str) -> None:
    """D11: SIGINT exactly when ``torch`` starts importing (a deterministic kill point):
    one line, status 130 (it used to print a traceback from ``import rootopt``)."""
    argv = ["train"] if "cli" in entry else []
    proc = subprocess.run(
        [sys.executable, "-c", _SIGINT_AT_TORCH + entry, *argv, "--log_dir", str(tmp_path / "r")],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 130, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "interrupted" in lines[0] and "Traceback" not in proc.stderr, lines
    assert not (tmp_path / "r").exists()


# --------------------------------------------------------------------------- D12


def test_seed_out_of_range_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert train_main(["--print-config", f"run.seed={2**64}"]) == 2
    assert "run.seed: must be <=" in _line(capsys)


def test_world_size_without_a_rendezvous_address(
    shards: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert train_main(["--data_path", str(shards), "--log_dir", str(tmp_path / "r"), *FAST]) == 2
    assert "MASTER_ADDR and MASTER_PORT are not" in _line(capsys)
    assert not (tmp_path / "r").exists()


def test_a_missing_peer_fails_within_the_rendezvous_timeout(shards: Path, tmp_path: Path) -> None:
    """D12: rank 0 of 2 started alone. It gives up after distributed.rendezvous_timeout_s
    (3 s here) with one line (it used to wait for the 1,800 s collective timeout, then print
    42 lines). The subprocess timeout only fails the test loudly if it hangs."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rootopt.train",
            "--data_path",
            str(shards),
            "--log_dir",
            str(tmp_path / "r"),
            *FAST,
            "distributed.rendezvous_timeout_s=3",
        ],
        env=env(WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "rank 0/2: the process group did not form within 3 s" in lines[0], lines
    assert "1 of 2 processes joined" in lines[0]


def test_a_damaged_metrics_line_does_not_stop_a_resume(shards: Path, tmp_path: Path) -> None:
    """D12: a non-UTF-8 byte in metrics.jsonl (a damaged disk block) ended the resume in
    a UnicodeDecodeError traceback; the line is now moved aside like a cut one."""
    run = tmp_path / "run"
    over = [*FAST, "run.max_steps=20"]
    train(
        load_config(None, over),
        run,
        str(shards),
        say=_quiet,
        hooks=Hooks(after_step=lambda s: s == 10),
    )
    with (run / "metrics.jsonl").open("ab") as fh:
        fh.write(b'{"step": 11, "loss": \xff\xfe}\n')
    s = train(load_config(None, over), run, str(shards), say=_quiet)
    assert s.steps == 20 and s.resumed_from == "ckpt-00000010.pt"
    assert b"\xff\xfe" in (run / "metrics.superseded.jsonl").read_bytes()
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    assert steps == [5, 10, 15, 20]


@pytest.mark.parametrize(
    "argv",
    [
        ["--shape", "abc"],
        ["--shape", "0x5"],
        ["--dtype", "foo"],
        ["--steps", "0"],
        ["--delta", "-1"],
    ],
)
def test_build_table_arguments(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """D12: each used to end in a traceback (some after minutes of fitting)."""
    from rootopt import cli

    out = tmp_path / "t.json"
    try:
        rc = cli.main(["coeffs", "build-table", *argv, "--out", str(out)])
    except SystemExit as exc:  # argparse's usage error
        rc = exc.code  # type: ignore[assignment]
    assert rc == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("rootopt coeffs")
    assert not out.exists()


def test_build_table_refuses_a_damaged_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rootopt import cli

    out = tmp_path / "t.json"
    text = json.dumps({"format": "rootopt.adanewton_table/1", "entries": [{"shape": "8x8"}]})
    out.write_text(text)
    assert cli.main(["coeffs", "build-table", "--shape", "8x8", "--out", str(out)]) == 2
    assert "damaged AdaNewton table" in _line(capsys)
    assert out.read_text() == text


# --------------------------------------------------------------------------- D15


def test_report_fails_a_log_cut_at_a_line_boundary(shards: Path, tmp_path: Path) -> None:
    """D15: the last records of metrics.jsonl removed at a line boundary: every remaining
    line is valid JSON, but summary.json counted more (it used to PASS)."""
    from rootopt.monitor.report import check_run

    run = tmp_path / "run"
    train(load_config(None, [*FAST, "run.max_steps=20"]), run, str(shards), say=_quiet)
    rep = check_run(run)
    assert rep.ok and "as many as the run wrote" in rep.render()
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(lines[:-1]))
    rep = check_run(run)
    assert not rep.ok and "incomplete_log" in rep.symptoms
    assert f"holds {len(lines) - 1} records but the run wrote {len(lines)}" in rep.render()


# --------------------------------------------------------------------------- misleading messages


def test_messages_say_what_is_wrong(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Misleading lines a new user met, each now naming the real problem."""
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    assert train_main(["--config", str(fifo)]) == 2
    assert "is not a regular file" in _line(capsys)  # was: "does not exist"

    afile = tmp_path / "afile"
    afile.write_text("mine")
    args = ["--data_path", str(shards), *FAST]
    assert train_main([*args, "--log_dir", str(tmp_path / "r1"), f"checkpoint.dir={afile}"]) == 2
    assert (
        "checkpoint.dir" in (line := _line(capsys)) and "is not a directory" in line
    )  # was: "File exists"
    assert afile.read_text() == "mine" and not (tmp_path / "r1").exists()

    assert train_main(["--data_path", str(afile), "--log_dir", str(tmp_path / "r2"), *FAST]) == 2
    assert "is a file, not a prepared shard directory" in _line(
        capsys
    )  # was: "holds no manifest.json"

    from rootopt.commands.data import main as data_main

    assert data_main(["verify", str(tmp_path / "nope")]) == 2
    assert "does not exist" in _line(capsys)  # was: "holds no manifest.json"


def test_tiny_max_time_still_progresses(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """run.max_time=1e-6 used to stop before the first step, print "stopped at run.max_time
    after a checkpoint" with no checkpoint written, and never progress on a rerun."""
    run = tmp_path / "run"
    args = ["--data_path", str(shards), "--log_dir", str(run), *FAST, "run.max_time=1e-6"]
    for want in (1, 2):
        assert train_main(args) == 0
        out = capsys.readouterr().out
        assert "stopped at run.max_time after a checkpoint" in out
        assert "no loss record yet" in out and "nan" not in out  # was "loss nan → nan"
        assert (run / "checkpoints" / f"ckpt-{want:08d}.pt").is_file()
        assert json.loads((run / "summary.json").read_text())["steps"] == want


def test_signal_before_the_first_step_says_so(shards: Path, tmp_path: Path) -> None:
    """SIGTERM while the run starts (here: when the model is seeded, during set-up) is one
    true line: nothing was lost; it used to claim "stopped without a final checkpoint"."""
    script = (
        "import os, signal, sys, torch\n"
        "real = torch.manual_seed\n"
        "def seed(s):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return real(s)\n"
        "torch.manual_seed = seed\n"
        "from rootopt.train.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", script, "--data_path", str(shards), "--log_dir", str(run), *FAST],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith("adanewton ")]
    assert len(lines) == 1, lines
    assert "before training started; nothing of the run was lost" in lines[0]
