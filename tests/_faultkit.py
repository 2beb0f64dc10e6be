"""Helpers for the fault tests: a byte-and-time fingerprint of a directory tree, a
subprocess environment, and a training process that can be stopped at a chosen point."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src"
ANALYSIS = Path(__file__).resolve().parents[1] / "analysis"  # rootopt-analysis (rootopt bench)
TESTS = Path(__file__).resolve().parent


def tree_state(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry under ``root`` (``root`` itself included): its kind, size, mode,
    modification time in ns and, for files, the sha256 of its bytes. Two equal
    fingerprints mean nothing was written, moved, deleted or re-created (a rewrite with
    the same bytes still changes the mtime)."""
    out: dict[str, tuple[Any, ...]] = {}
    for path in [root, *sorted(root.rglob("*"))]:
        st = path.lstat()
        rel = str(path.relative_to(root)) or "."
        if path.is_symlink():
            out[rel] = ("link", os.readlink(path), st.st_mtime_ns)
        elif path.is_dir():
            out[rel] = ("dir", st.st_mode, st.st_mtime_ns)
        else:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            out[rel] = ("file", st.st_size, st.st_mode, st.st_mtime_ns, digest)
    return out


def env(**extra: str) -> dict[str, str]:
    """The environment of a subprocess that imports this checkout's rootopt (and
    rootopt-analysis)."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(SRC), str(ANALYSIS), str(TESTS)])
    e["OMP_NUM_THREADS"] = "1"
    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
    ):
        e.pop(key, None)
    e.update(extra)
    return e


def console_script(name: str) -> str:
    """The installed ``rootopt`` / ``torchrun`` command of this interpreter's environment
    (the commands the README prints)."""
    candidate = Path(sys.executable).parent / name
    if candidate.is_file():
        return str(candidate)
    import shutil

    found = shutil.which(name)
    assert found, f"the {name!r} command is not installed next to {sys.executable}"
    return found


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous or a store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kill_session(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL a process started with ``start_new_session=True`` and everything it started."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.communicate(timeout=30)


def start_session(
    argv: list[str], *, env: dict[str, str], cwd: Path | None = None
) -> subprocess.Popen[str]:
    """Start ``argv`` in a session of its own (text pipes), so that :func:`kill_session`
    reaches a launcher and every worker it started."""
    return subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def run_session(
    argv: list[str], *, env: dict[str, str], timeout: float, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in a session of its own and wait; on timeout the whole session (a
    launcher and the workers it started) is killed and the timeout raised."""
    proc = start_session(argv, env=env, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc)
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def wait_for(predicate: Any, timeout: float, what: str, proc: Any = None) -> None:
    """Poll ``predicate`` until true; fail loudly after ``timeout`` s or when ``proc`` ended."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process ended (status {proc.returncode}) before {what}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# A training process that stops itself at a chosen point, for kill points chosen
# deterministically: argv = JSON {"argv": [...], "kill_at": step, "signal": "SIGKILL",
# "nan_steps": [...], "final_eval_signal": "SIGINT"}.
VICTIM = r"""
import json, os, signal, sys
spec = json.loads(sys.argv[1])
import torch
from rootopt.train import loop, main
from rootopt.train.run.state import Hooks
real_train = loop.train
nan_steps = set(spec.get("nan_steps", []))
kill_at = spec.get("kill_at", -1)
sig = getattr(signal, spec.get("signal", "SIGKILL"))

def after_backward(step, model):
    if step in nan_steps:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.fill_(float("nan"))

def after_step(step):
    if step == kill_at:
        os.kill(os.getpid(), sig)
    return False

def train(*args, **kwargs):
    kwargs["hooks"] = Hooks(after_backward=after_backward, after_step=after_step)
    return real_train(*args, **kwargs)

loop.train = train
final_sig = spec.get("final_eval_signal")
if final_sig:
    real_eval = loop.evaluate
    def evaluate(run, *a, **k):
        if run.state.step == run.cfg.run.max_steps:
            os.kill(os.getpid(), getattr(signal, final_sig))
        return real_eval(run, *a, **k)
    loop.evaluate = evaluate
sys.exit(main.main(spec["argv"]))
"""


def victim(
    spec: dict[str, Any], *, timeout: float = 180, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run :data:`VICTIM` to its end (or its self-inflicted signal)."""
    import json

    return subprocess.run(
        [sys.executable, "-c", VICTIM, json.dumps(spec)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )
