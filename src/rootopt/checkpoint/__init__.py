"""Atomic, checksummed one-process checkpoints (``ckpt-<step>.pt``), and directory locks.

The format a run writes in one process; which checkpoint is the newest valid one, pruning
and resuming belong to the run's checkpointer (:mod:`rootopt.train.checkpoint`). A
checkpoint is ``ckpt-<step>.pt`` (``torch.save`` of plain data: tensors, numbers, strings,
lists, dicts — loadable with ``weights_only=True``) plus ``ckpt-<step>.json`` holding its
sha256, step and format version. Both are written to a temporary file, fsync'ed and renamed
into place (the sidecar last), and the directory is fsync'ed, so a crash leaves either the
previous state or a complete new checkpoint. A checkpoint whose sidecar is missing, whose
checksum differs is *corrupt* (:class:`CheckpointError`): reported and skipped. One that
this build cannot read although nothing proves it damaged — another format version, an I/O
error, a checksum-verified file that fails to load — is :class:`CheckpointUnreadable`: a
resume stops on it rather than silently falling back to an older checkpoint or to step 0.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
from pathlib import Path
from typing import Any

import torch

from rootopt._atomic import atomic_write, fsync_dir

FORMAT_VERSION = 1
NAME = re.compile(r"^ckpt-(\d{8})\.pt$")  # a checkpoint's file name (its sidecar: .json)


_STALE = re.compile(r"^\.(ckpt-\d{8}\.(pt|json)|owner\.json)\..+\.tmp$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (corrupt or incomplete, when not a subclass)."""


class CheckpointUnreadable(CheckpointError):
    """A checkpoint that may well be intact but that this build cannot read (another
    format version, an I/O error, a load error after the checksum verified)."""


def _sidecar(path: Path) -> dict[str, Any] | None:
    """A checkpoint's sidecar as a dict, or None when missing/unreadable."""
    try:
        meta = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return meta if isinstance(meta, dict) else None


def sidecar(path: str | Path) -> dict[str, Any] | None:
    """The sidecar of checkpoint ``path`` (step, sha256, run id, serial, suspect), or None."""
    return _sidecar(Path(path))


def stale_temporaries(directory: str | Path) -> list[Path]:
    """Temporary files an interrupted :func:`save` or :func:`claim` left in ``directory``
    (``.ckpt-<step>.pt.<random>.tmp`` ...). Only the owner of the directory, holding its
    lock, may remove them."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _STALE.match(p.name) and p.is_file())


def save(
    directory: str | Path,
    step: int,
    payload: dict[str, Any],
    *,
    run_id: str = "",
    suspect: bool = False,
    serial: int = 0,
) -> Path:
    """Write checkpoint ``step`` atomically; return its path.

    Its sidecar records the run id, the write ``serial`` (the order of writing, which the
    run's checkpointer gives; 0: unordered) and whether the checkpoint is ``suspect``
    (written inside a divergence episode)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    import io

    buf = io.BytesIO()
    torch.save({"format_version": FORMAT_VERSION, "step": step, "run_id": run_id, **payload}, buf)
    blob = buf.getvalue()
    del buf
    path = directory / f"ckpt-{step:08d}.pt"
    atomic_write(path, blob)
    meta = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "sha256": hashlib.sha256(blob).hexdigest(),
        "bytes": len(blob),
        "run_id": run_id,
        "serial": serial,
        "suspect": bool(suspect),
    }
    atomic_write(path.with_suffix(".json"), (json.dumps(meta) + "\n").encode())
    fsync_dir(directory)
    return path


def load(path: str | Path) -> dict[str, Any]:
    """Verify ``path`` against its sidecar checksum and load it with ``weights_only=True``.

    The file is mapped once: the checksum is computed over the mapping and ``torch.load``
    reads its tensors from the same (page-cached) mapping, so the checkpoint is neither read
    twice nor held twice in memory. Raises :class:`CheckpointError` when the checkpoint is
    proven incomplete or corrupt (no sidecar, a damaged sidecar, a checksum mismatch) and
    :class:`CheckpointUnreadable` when this build cannot read it for another reason.
    """
    path = Path(path)
    side = path.with_suffix(".json")
    try:
        raw = side.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(
            f"{path.name}: no checksum sidecar {side.name} (incomplete write)"
        ) from None
    except OSError as exc:
        raise CheckpointUnreadable(
            f"{path.name}: its sidecar {side.name} cannot be read ({exc.strerror or exc})"
        ) from None
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        meta = None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path.name}: checksum sidecar {side.name} is damaged")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointUnreadable(
            f"{path.name}: format version {meta.get('format_version')!r}, this build of "
            f"rootopt reads {FORMAT_VERSION} (written by another version)"
        )
    try:
        with path.open("rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size == 0:
                actual = hashlib.sha256(b"").hexdigest()
            else:
                with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    actual = hashlib.sha256(mm).hexdigest()
    except FileNotFoundError:
        raise CheckpointError(
            f"{path.name}: the file is missing (only its sidecar exists)"
        ) from None
    except OSError as exc:
        raise CheckpointUnreadable(f"{path.name}: cannot be read ({exc.strerror or exc})") from None
    if actual != meta.get("sha256"):
        raise CheckpointError(
            f"{path.name}: sha256 mismatch (sidecar {str(meta.get('sha256'))[:12]}…, file {actual[:12]}…)"
        )
    _refuse_non_archive(path)
    try:
        state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except OSError as exc:
        raise CheckpointUnreadable(f"{path.name}: cannot be read ({exc.strerror or exc})") from None
    except Exception as exc:
        first = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()
        first = first.splitlines()[0][:120] if first else ""
        raise CheckpointUnreadable(
            f"{path.name}: its checksum verifies but it cannot be loaded by this build "
            f"({type(exc).__name__}{': ' + first if first else ''})"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointUnreadable(f"{path.name}: holds a {type(state).__name__}, not a checkpoint")
    return state


def _refuse_non_archive(path: Path) -> None:
    """Every version of this format is a ``torch.save`` zip archive: a file that is not
    one is no checkpoint, whatever its sidecar says (:class:`CheckpointError`)."""
    try:
        with path.open("rb") as fh:
            head = fh.read(4)
    except OSError as exc:
        raise CheckpointUnreadable(f"{path.name}: cannot be read ({exc.strerror or exc})") from None
    if head != b"PK\x03\x04":
        raise CheckpointError(
            f"{path.name}: not a checkpoint (torch.save writes a zip archive; this file starts "
            f"with {head!r}), although its sidecar's checksum matches it"
        )


# --------------------------------------------------------------------------- ownership

OWNER = "owner.json"
LOCK = ".lock"


class LockHeld(CheckpointError):
    """Another live process holds the lock (``holder`` says which, as it wrote itself)."""

    def __init__(self, path: Path, holder: str) -> None:
        self.path, self.holder = path, holder
        super().__init__(f"{str(path)!r} is locked by {holder}")


class DirLock:
    """An exclusive, advisory lock on a directory for the life of one process.

    ``fcntl.flock`` is released by the kernel when the process dies (even by SIGKILL), so a
    crashed run never leaves a stale lock behind; a second live process is refused. The
    lock file holds the holder's ``pid <n> on <host>``; a refused process only reads it
    (the holder's lock file is never rewritten by a process that does not hold it).
    """

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock; :class:`LockHeld` when a live process holds it, ``OSError`` when
        the lock file cannot be created or opened (read-only or missing directory, or
        :class:`rootopt._atomic.LinkError`: the lock file is a symbolic link)."""
        import fcntl
        import socket

        from rootopt._atomic import open_lock

        fd = open_lock(self.path)  # never through a link (LinkError, an OSError)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
            finally:
                os.close(fd)
            raise LockHeld(self.path, holder or "another process") from None
        try:
            note = f"pid {os.getpid()} on {socket.gethostname()}\n".encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, note, 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def owner(directory: str | Path) -> dict[str, Any] | None:
    """The run that owns ``directory`` (``owner.json``), or None."""
    try:
        data = json.loads((Path(directory) / OWNER).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {"run_id": "?", "log_dir": "?"}
    return data if isinstance(data, dict) else {"run_id": "?", "log_dir": "?"}


def check_owner(directory: str | Path, run_id: str) -> dict[str, Any] | None:
    """Refuse (one line) a ``directory`` whose ``owner.json`` names another run; reads only.
    Returns the owner record (None when the directory has none yet)."""
    directory = Path(directory)
    have = owner(directory)
    if have is not None and have.get("run_id") != run_id:
        raise CheckpointError(
            f"checkpoint directory {str(directory)!r} belongs to another run "
            f"(run id {str(have.get('run_id'))[:12]}, log dir {str(have.get('log_dir'))!r}); "
            "point checkpoint.dir at a directory of this run"
        )
    return have


def claim(directory: str | Path, run_id: str, log_dir: str) -> None:
    """Make ``run_id`` the owner of ``directory``; refuse one owned by another run."""
    directory = Path(directory)
    have = check_owner(directory, run_id)
    if have is None:
        directory.mkdir(parents=True, exist_ok=True)
        data = {"run_id": run_id, "log_dir": log_dir}
        atomic_write(directory / OWNER, (json.dumps(data) + "\n").encode())


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
    "NAME",
    "CheckpointError",
    "CheckpointUnreadable",
    "DirLock",
    "LockHeld",
    "check_owner",
    "claim",
    "load",
    "owner",
    "rng_state",
    "save",
    "set_rng_state",
    "sidecar",
    "stale_temporaries",
]
