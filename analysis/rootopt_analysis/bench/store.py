"""The defaults study's run store: one JSON line per finished run, small enough to commit.

A study directory holds ``runs.jsonl`` (every finished training run) and ``timing.jsonl``
(step-time ratios and FLOP counts). The study's worker processes still write each result as a
file under ``runs/`` (atomically, so nothing is lost if the parent dies); the parent appends the
*compact* record of each finished run to ``runs.jsonl``, and on opening imports any file that
the log does not hold yet. The compact record keeps everything the study reads (the spec, the
losses, the curves, the momentum tail) and reduces the training-loss series to its smoothness;
the study reads compact records only, so a summary rendered from a committed store equals the
one rendered where the runs ran.

A torn last line (a kill during an append) is skipped on reading and closed before the next
append; its run's file, if any, is imported again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

Result = dict[str, Any]

RUNS = "runs.jsonl"
TIMING = "timing.jsonl"
_NO = object()
SPEC_DEFAULTS: dict[str, Any] = {
    "clip": 1.0,
    "corruption": {"kind": "none", "scale": 0.0, "rate": 0.0, "df": 2},
    "lr_mult": 1.0,
    "side_lr_mult": 1.0,
}


def compact(r: Result) -> Result:
    """The stored form of a run's result: the training-loss series replaced by its smoothness
    (the only statistic the study takes from it), evaluations without their timers."""
    from rootopt_analysis.bench.suites import smoothness

    out = {k: v for k, v in r.items() if k not in ("train_loss", "last_eval")}
    if "spec" in r:  # fields at their default are left out (RunSpec.from_dict restores them)
        out["spec"] = {k: v for k, v in r["spec"].items() if SPEC_DEFAULTS.get(k, _NO) != v}
    if "train_loss" in r:
        steps = int(r["spec"]["steps"])
        out["smoothness"] = smoothness(r["train_loss"], skip=max(1, steps // 10))
        out["train_loss_last"] = r["train_loss"][-1] if r["train_loss"] else None
    out["evals"] = eval_columns(r.get("evals", []))
    for key in ("error", "final_val_acc", "final_test_acc"):
        if out.get(key) in ("", None):
            out.pop(key, None)
    return out


EVAL_KEYS = ("step", "val_loss", "test_loss", "val_acc", "test_acc")


def eval_columns(evals: list[dict[str, Any]] | dict[str, list[Any]]) -> dict[str, list[Any]]:
    """A run's evaluations as columns (``{"step": [...], "val_loss": [...], ...}``; the
    accuracies only where the task has them); columns pass through unchanged."""
    if isinstance(evals, dict):
        return evals
    cols = {k: [e.get(k) for e in evals] for k in EVAL_KEYS}
    return {k: v for k, v in cols.items() if any(x is not None for x in v) or k == "step"}


def _read_jsonl(path: Path, key: str) -> Iterator[Result]:
    if not path.is_file():
        return
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue  # a torn line
        if isinstance(r, dict) and isinstance(r.get(key), str):
            yield r


def _append(path: Path, records: Iterable[Result]) -> None:
    lines = [json.dumps(r, separators=(",", ":")) + "\n" for r in records]
    if not lines:
        return
    from rootopt._atomic import open_append

    with open_append(path, binary=True, readable=True) as f:  # never through a planted link
        if f.seek(0, os.SEEK_END) > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":  # close a torn last line
                f.write(b"\n")
        f.write("".join(lines).encode())
        f.flush()
        os.fsync(f.fileno())


def read_sessions(log_path: Path) -> list[dict[str, Any]]:
    """The study's sessions from its log, one per session: an entry written at the start and
    one at the end; a session with no end entry was stopped (its ``end`` is None). Torn or
    foreign lines are skipped."""
    if not log_path.is_file():  # no session has run jobs here (only renders)
        return []
    sessions: dict[str, dict[str, Any]] = {}
    for line in log_path.read_text(encoding="utf-8").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if not isinstance(e, dict) or "start" not in e:
            continue
        key = str(e.get("session", e["start"]))
        if e.get("end") is not None or key not in sessions:
            sessions[key] = e
    return list(sessions.values())


def commit_of(run: Result, sessions: list[dict[str, Any]]) -> str | None:
    """The commit of the code that ran ``run``: the one its record names, else that of the
    session that started it (the last one logged before its start). One session appends to
    a study directory at a time (its lock), so a run's start lies in the session that ran it;
    a record lacks its commit when that session stopped between the worker's file and the
    log's line, and the next session imported the file."""
    if run.get("commit"):
        return str(run["commit"])
    started = run.get("started")
    if not isinstance(started, int | float):
        return None
    before = [
        s
        for s in sessions
        if s.get("commit") and isinstance(s.get("start"), int | float) and s["start"] <= started
    ]
    if not before:
        return None
    s = max(before, key=lambda s: s["start"])
    return f"{s['commit']}{'+dirty' if s.get('dirty') else ''}"


class Store:
    """The finished runs and timings of one study directory."""

    def __init__(self, out: Path, *, run_format: int) -> None:
        self.out = out
        self.format = run_format
        self.runs: dict[str, Result] = {}
        self.timing: dict[str, Result] = {}
        for r in _read_jsonl(out / RUNS, "run_id"):
            if r.get("format") == run_format:
                # records written before evaluations were stored as columns read the same
                r["evals"] = eval_columns(r.get("evals", []))
                self.runs.setdefault(r["run_id"], r)
        for r in _read_jsonl(out / TIMING, "run_id"):
            self.timing.setdefault(r["run_id"], r)
        self._import_files()

    def _import_files(self) -> None:
        """Results that workers wrote as files but the log does not hold (the parent stopped
        between the two writes, or an older study directory)."""
        runs = [
            compact(r)
            for r in _load_dir(self.out / "runs")
            if r.get("format") == self.format and r["run_id"] not in self.runs
        ]
        runs.sort(key=lambda r: (r.get("started") or 0.0, r["run_id"]))
        self.add_runs(runs)
        self.add_timings(
            [r for r in _load_dir(self.out / "timing") if r["run_id"] not in self.timing]
        )

    def add_runs(self, results: Iterable[Result], commit: str | None = None) -> list[Result]:
        new = []
        for r in results:
            c = r if "smoothness" in r or "train_loss" not in r else compact(r)
            if commit is not None and "commit" not in c:
                c = {**c, "commit": commit}
            if c["run_id"] not in self.runs:
                self.runs[c["run_id"]] = c
                new.append(c)
        _append(self.out / RUNS, new)
        return new

    def add_timings(self, results: Iterable[Result]) -> list[Result]:
        new = [r for r in results if r["run_id"] not in self.timing]
        for r in new:
            self.timing[r["run_id"]] = r
        _append(self.out / TIMING, new)
        return new

    def merge_from(self, other: Path) -> tuple[int, int]:
        """Add the runs and timings of another study directory that this one lacks; returns
        how many of each were added."""
        src = Store(other, run_format=self.format) if other.is_dir() else None
        if src is None:
            raise FileNotFoundError(f"{other} is not a directory")
        a = self.add_runs(src.runs.values())
        b = self.add_timings(src.timing.values())
        return len(a), len(b)


def _load_dir(path: Path) -> list[Result]:
    out: list[Result] = []
    if not path.is_dir():
        return out
    for f in sorted(path.glob("*.json")):
        try:
            r = json.loads(f.read_text())
        except (OSError, ValueError):
            continue  # torn or foreign: the job is redone
        if isinstance(r, dict) and r.get("run_id") == f.stem:
            out.append(r)
    return out
