"""Atomic, checksummed checkpoints; resume from the newest valid one.

A checkpoint is ``ckpt-<step>.pt`` (``torch.save`` of plain data: tensors, numbers, strings,
lists, dicts — loadable with ``weights_only=True``) plus ``ckpt-<step>.json`` holding its
sha256, step and format version. Both are written to a temporary file, fsync'ed and renamed
into place (the sidecar last), and the directory is fsync'ed, so a crash leaves either the
previous state or a complete new checkpoint. A checkpoint whose sidecar is missing, whose
checksum differs or which fails to load is reported and skipped.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rootopt._atomic import atomic_write, fsync_dir

FORMAT_VERSION = 1
_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used."""


def _sidecar(path: Path) -> dict[str, Any] | None:
    """A checkpoint's sidecar as a dict, or None when missing/unreadable."""
    try:
        meta = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return meta if isinstance(meta, dict) else None


def save(
    directory: str | Path,
    step: int,
    payload: dict[str, Any],
    *,
    keep_last: int,
    run_id: str = "",
    protect: Path | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically; keep this run's newest ``keep_last``; return its path.

    Each sidecar records the run id and a write serial. Pruning orders by the serial (the
    order of writing), not by the step, and only touches checkpoints whose sidecar names
    ``run_id``: a run restarted from step 0 never deletes what it has just written, and a
    directory shared by mistake never loses another run's files. ``protect`` (the last good
    checkpoint while a run is in trouble) is never pruned and does not count.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    import io

    buf = io.BytesIO()
    torch.save({"format_version": FORMAT_VERSION, "step": step, "run_id": run_id, **payload}, buf)
    blob = buf.getvalue()
    del buf
    path = directory / f"ckpt-{step:08d}.pt"
    serial = 1 + max((_serial(m) for m in _sidecars(directory).values()), default=0)
    atomic_write(path, blob)
    meta = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "sha256": hashlib.sha256(blob).hexdigest(),
        "bytes": len(blob),
        "run_id": run_id,
        "serial": serial,
    }
    atomic_write(path.with_suffix(".json"), (json.dumps(meta) + "\n").encode())
    fsync_dir(directory)
    prune(directory, keep_last=keep_last, run_id=run_id, keep=path, protect=protect)
    return path


def _serial(meta: dict[str, Any]) -> int:
    value = meta.get("serial", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _sidecars(directory: Path) -> dict[Path, dict[str, Any]]:
    out = {}
    for p in _candidates(directory):
        meta = _sidecar(p)
        if meta is not None:
            out[p] = meta
    return out


def prune(
    directory: str | Path,
    *,
    keep_last: int,
    run_id: str,
    keep: Path,
    protect: Path | None = None,
) -> list[Path]:
    """Delete this run's checkpoints beyond the newest ``keep_last`` (by write serial)."""
    mine = [
        (_serial(m), int(m.get("step", 0)), p)
        for p, m in _sidecars(Path(directory)).items()
        if m.get("run_id", "") == run_id and p not in (keep, protect)
    ]
    mine.sort()
    removed = []
    for _, _, old in mine[: max(0, len(mine) - (keep_last - 1))]:
        old.unlink(missing_ok=True)
        old.with_suffix(".json").unlink(missing_ok=True)
        removed.append(old)
    return removed


def _candidates(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return [p for p in directory.iterdir() if _NAME.match(p.name)]


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoint files in ``directory``, oldest first in the order they were written.

    The order is the sidecars' write serial (step for files without one); a file whose sidecar
    is unreadable counts as the newest, so resume reports it rather than skipping it silently.
    """
    directory = Path(directory)
    found = []
    metas = {p: _sidecar(p) for p in _candidates(directory)}
    top = max((_serial(m) for m in metas.values() if m is not None), default=0)
    for p, m in metas.items():
        step = int(_NAME.match(p.name).group(1))  # type: ignore[union-attr]
        found.append(((_serial(m) if m is not None else top + 1), step, p))
    return [p for _, _, p in sorted(found)]


def load(path: str | Path) -> dict[str, Any]:
    """Verify ``path`` against its sidecar checksum and load it with ``weights_only=True``.

    The file is mapped once: the checksum is computed over the mapping and ``torch.load``
    reads its tensors from the same (page-cached) mapping, so the checkpoint is neither read
    twice nor held twice in memory.
    """
    path = Path(path)
    side = path.with_suffix(".json")
    if not side.is_file():
        raise CheckpointError(f"{path.name}: no checksum sidecar {side.name} (incomplete write?)")
    meta = _sidecar(path)
    if meta is None:
        raise CheckpointError(f"{path.name}: checksum sidecar {side.name} is unreadable")
    try:
        with path.open("rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size == 0:
                actual = hashlib.sha256(b"").hexdigest()
            else:
                with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    actual = hashlib.sha256(mm).hexdigest()
    except OSError as exc:
        raise CheckpointError(f"{path.name}: cannot be read ({exc.strerror or exc})") from None
    if actual != meta.get("sha256"):
        raise CheckpointError(
            f"{path.name}: sha256 mismatch (sidecar {str(meta.get('sha256'))[:12]}…, file {actual[:12]}…)"
        )
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path.name}: format version {meta.get('format_version')} (this build reads {FORMAT_VERSION})"
        )
    try:
        state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise CheckpointError(f"{path.name}: cannot be loaded ({type(exc).__name__})") from None
    return state


# --------------------------------------------------------------------------- ownership

OWNER = "owner.json"
LOCK = ".lock"


class DirLock:
    """An exclusive, advisory lock on a checkpoint directory for the life of one process.

    ``fcntl.flock`` is released by the kernel when the process dies (even by SIGKILL), so a
    crashed run never leaves a stale lock behind; a second live process is refused.
    """

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK
        self._fh: Any = None

    def acquire(self) -> None:
        import fcntl

        fh = self.path.open("a+", encoding="utf-8")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            holder = fh.read().strip() or "?"
            fh.close()
            raise CheckpointError(
                f"checkpoint directory {str(self.path.parent)!r} is in use by another "
                f"training process (pid {holder}); wait for it or use another checkpoint.dir"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        self._fh = fh

    def release(self) -> None:
        if self._fh is not None:
            self._fh.close()  # closing the descriptor drops the flock
            self._fh = None


def owner(directory: str | Path) -> dict[str, Any] | None:
    """The run that owns ``directory`` (``owner.json``), or None."""
    try:
        data = json.loads((Path(directory) / OWNER).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {"run_id": "?", "log_dir": "?"}
    return data if isinstance(data, dict) else {"run_id": "?", "log_dir": "?"}


def claim(directory: str | Path, run_id: str, log_dir: str) -> None:
    """Make ``run_id`` the owner of ``directory``; refuse one owned by another run."""
    directory = Path(directory)
    have = owner(directory)
    if have is not None and have.get("run_id") != run_id:
        raise CheckpointError(
            f"checkpoint directory {str(directory)!r} belongs to another run "
            f"(run id {str(have.get('run_id'))[:12]}, log dir {str(have.get('log_dir'))!r}); "
            "point checkpoint.dir at a directory of this run"
        )
    if have is None:
        directory.mkdir(parents=True, exist_ok=True)
        data = {"run_id": run_id, "log_dir": log_dir}
        atomic_write(directory / OWNER, (json.dumps(data) + "\n").encode())


@dataclass
class Resumed:
    path: Path
    state: dict[str, Any]
    skipped: list[str]  # one line per invalid newer checkpoint


def newest_valid(directory: str | Path) -> tuple[Resumed | None, list[str]]:
    """The newest checkpoint that verifies and loads, and a line per newer one that did not."""
    skipped: list[str] = []
    for path in reversed(list_checkpoints(directory)):
        try:
            return Resumed(path, load(path), skipped), skipped
        except CheckpointError as exc:
            skipped.append(str(exc))
    return None, skipped


def rng_state() -> dict[str, Any]:
    """Every RNG the loop draws from, as tensors and plain numbers."""
    import random

    import numpy as np

    py = random.getstate()
    np_state: tuple[Any, ...] = tuple(np.random.get_state())
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [
            np_state[0],
            torch.from_numpy(np_state[1].astype("int64")),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "DirLock",
    "Resumed",
    "claim",
    "list_checkpoints",
    "load",
    "newest_valid",
    "owner",
    "prune",
    "rng_state",
    "save",
    "set_rng_state",
]
