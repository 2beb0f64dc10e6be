"""The run directory: its default name, who may write into it, and its lock.

Policy (docs/training.md, "The run directory"): without ``--log_dir`` a run lives in
``runs/<name>-<key>``, where ``key`` is 8 hex digits of a sha256 over the resolved config
(less the keys that only steer one session, :data:`SESSION_KEYS`) and the resolved
``--data_path``. The same command from the same working directory therefore finds the same
directory again: a rerun after Ctrl-C, a kill or ``run.max_time`` resumes, and so do the
workers that ``torchrun --max-restarts`` starts again. Every rank computes the name itself
and rank 0 checks that they agree. The world size is not part of the key: a checkpoint
loads at any world size (docs/distributed.md), and an elastic restart may change it.

A directory is this run's when it is new, empty, or holds ``run.json``; anything else is
refused before a byte is written. A live run holds ``<run dir>/.lock`` (and
``<checkpoint dir>/.lock``) with ``flock``; a second process is refused without touching
them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rootopt import checkpoint
from rootopt.checkpoint import CheckpointError
from rootopt.config import Config, ConfigError, RunConfig, to_dict
from rootopt.data import STAGING, is_staging

RUN_FILE = "run.json"
# Keys that change how one session runs, not what the run computes: changing them keeps
# the default run directory (so e.g. `checkpoint.resume=restart` acts on the same run).
SESSION_KEYS: tuple[tuple[str, str], ...] = (
    ("checkpoint", "resume"),
    ("run", "max_time"),
    ("distributed", "timeout_s"),
    ("distributed", "rendezvous_timeout_s"),
    ("monitoring", "progress_bar"),
    ("monitoring", "prometheus"),
)
# Keys added after runs existed, at the value that does what runs did before them: left out
# of the key there, so that an older run's default directory stays its own.
LATER_KEYS: dict[tuple[str, str], object] = {
    ("data", "tokenizer"): "bytes",
    ("data", "text_field"): "text",
}
# Temporary files an interrupted atomic write of ours leaves in a run directory or in the
# data it prepared (rootopt._atomic: ".<name>.<random>.tmp").
_STALE_RUN = re.compile(r"^\.(run\.json|metrics\.jsonl|summary\.json)\..+\.tmp$")
_STALE_DATA = re.compile(r"^\.(manifest\.json|SHA256SUMS)\..+\.tmp$")
_DEFAULT_NAME = RunConfig().name


class RunDirError(CheckpointError):
    """The run directory (or the checkpoint directory) cannot be used: not writable, or a
    path that cannot be created (status 2, one line)."""


def identity_key(cfg: Config, data_path: str | None) -> str:
    """8 hex digits naming the run a command describes (see the module docstring)."""
    data = to_dict(cfg)
    for section, key in SESSION_KEYS:
        data[section].pop(key, None)
    for (section, key), value in LATER_KEYS.items():
        if data[section].get(key) == value:
            data[section].pop(key)
    payload = {
        "config": data,
        "data_path": str(Path(data_path).resolve()) if data_path else "",
    }
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def default_run_dir(cfg: Config, data_path: str | None, config_path: str | None) -> Path:
    """``runs/<name>-<key>``: ``name`` is ``run.name`` when set, else the config file's
    stem, else ``default``."""
    if cfg.run.name != _DEFAULT_NAME:
        name = cfg.run.name
    elif config_path:
        name = Path(config_path).stem
    else:
        name = "default"
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip(".-")[:40] or "run"
    return Path("runs") / f"{name}-{identity_key(cfg, data_path)}"


def read_run_file(run_dir: Path, created: tuple[Path, ...] = ()) -> dict[str, Any] | None:
    """``run.json`` of ``run_dir`` (None for a new or empty directory); refuses, reading
    only, a path that is not a directory or a non-empty directory that is not a run's
    (entries in ``created``, made by this launch, do not count)."""
    if not run_dir.exists():
        if run_dir.is_symlink():
            raise ConfigError([f"--log_dir {str(run_dir)!r} is a broken symbolic link"])
        return None
    if not run_dir.is_dir():
        raise ConfigError([f"--log_dir {str(run_dir)!r} exists and is not a directory"])
    path = run_dir / RUN_FILE
    if path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            data = None
        except OSError as exc:
            raise CheckpointError(f"{str(path)!r} cannot be read ({exc.strerror or exc})") from None
        if not isinstance(data, dict) or not isinstance(data.get("run_id"), str):
            raise CheckpointError(f"{str(path)!r} is not a rootopt run file (unreadable JSON)")
        return data
    try:
        names = sorted(p.name for p in run_dir.iterdir())
    except OSError as exc:
        raise ConfigError(
            [f"--log_dir {str(run_dir)!r} cannot be listed ({exc.strerror or exc})"]
        ) from None
    made = {p.name for p in created if p.parent == run_dir}
    foreign = [
        n
        for n in names
        if n != checkpoint.LOCK
        and n not in made
        and not _STALE_RUN.match(n)
        and not (n == "checkpoints" and _only_lock(run_dir / n))
        and not (n == STAGING and is_staging(run_dir / n))  # a launch killed while preparing
    ]
    if foreign:
        raise CheckpointError(
            f"--log_dir {str(run_dir)!r} is not empty ({len(foreign)} entries, e.g. "
            f"{foreign[0]!r}) and holds no {RUN_FILE}: it is not a rootopt run directory, "
            "and nothing in it is touched; use a new or empty directory"
        )
    return None


def _only_lock(directory: Path) -> bool:
    """A checkpoint directory a launch locked before it wrote anything (killed then)."""
    try:
        return directory.is_dir() and {p.name for p in directory.iterdir()} <= {checkpoint.LOCK}
    except OSError:
        return False


@dataclass
class Locks:
    """The directory locks one run holds, and the directories it created to hold them."""

    held: list[checkpoint.DirLock] = field(default_factory=list)
    created: list[Path] = field(default_factory=list)
    committed: bool = False  # the run has written into its directories

    def take(self, directory: Path, what: str, hint: str) -> None:
        """Lock ``directory`` (created when missing), or refuse with one line."""
        missing: list[Path] = []
        p = directory
        while not p.exists() and p != p.parent:
            missing.append(p)
            p = p.parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise RunDirError(
                f"{what} {str(directory)!r}: a part of the path exists and is not a directory"
            ) from None
        except OSError as exc:
            raise RunDirError(
                f"{what} {str(directory)!r} cannot be created ({exc.strerror or exc})"
            ) from None
        self.created += reversed(missing)
        lock = checkpoint.DirLock(directory)
        try:
            lock.acquire()
        except checkpoint.LockHeld as exc:
            raise CheckpointError(
                f"{what} {str(directory)!r} is in use by another training process "
                f"({exc.holder}); {hint}"
            ) from None
        except OSError as exc:
            raise RunDirError(
                f"{what} {str(directory)!r} is not writable ({exc.strerror or exc})"
            ) from None
        self.held.append(lock)

    def release(self) -> None:
        for lock in reversed(self.held):
            lock.release()
        self.held = []

    def abandon(self) -> None:
        """Release the locks; a launch refused before it wrote anything also removes the
        directories it created for them (a refused launch leaves no empty run directory
        behind). A lock file is unlinked only while still held: unlinked after its release,
        a process that had just locked it would share the directory with the next one."""
        if not self.committed:
            for directory in reversed(self.created):
                with contextlib.suppress(OSError):
                    ours = {checkpoint.LOCK} | {
                        c.name for c in self.created if c.parent == directory
                    }
                    if {p.name for p in directory.iterdir()} <= ours:
                        (directory / checkpoint.LOCK).unlink(missing_ok=True)
        self.release()
        if not self.committed:
            for directory in reversed(self.created):
                with contextlib.suppress(OSError):
                    directory.rmdir()
        self.created = []


def stale_files(run_dir: Path, ckpt_dir: Path, data_dir: Path | None) -> list[Path]:
    """Temporary files and directories that interrupted writes of this run left behind
    (removed at start, under the run's lock, by :func:`remove_stale`)."""
    from rootopt.distributed import checkpoint as dcp

    found: list[Path] = []
    if run_dir.is_dir():
        found += [p for p in run_dir.iterdir() if _STALE_RUN.match(p.name) and p.is_file()]
    found += checkpoint.stale_temporaries(ckpt_dir)
    found += dcp.stale_partials(ckpt_dir)
    if data_dir is not None and data_dir.is_dir():
        found += [p for p in data_dir.iterdir() if _STALE_DATA.match(p.name) and p.is_file()]
    return sorted(found)


def remove_stale(paths: list[Path]) -> None:
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
