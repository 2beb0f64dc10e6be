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
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rootopt._atomic import atomic_write

FORMAT_VERSION = 1
_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used."""


def _fsync_dir(path: Path) -> None:
    if os.name == "posix":
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save(directory: str | Path, step: int, payload: dict[str, Any], *, keep_last: int) -> Path:
    """Write checkpoint ``step`` atomically; keep the newest ``keep_last``; return its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    import io

    buf = io.BytesIO()
    torch.save({"format_version": FORMAT_VERSION, "step": step, **payload}, buf)
    blob = buf.getvalue()
    path = directory / f"ckpt-{step:08d}.pt"
    atomic_write(path, blob)
    meta = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "sha256": hashlib.sha256(blob).hexdigest(),
        "bytes": len(blob),
    }
    atomic_write(path.with_suffix(".json"), (json.dumps(meta) + "\n").encode())
    _fsync_dir(directory)
    for old in list_checkpoints(directory)[:-keep_last]:
        old.unlink(missing_ok=True)
        old.with_suffix(".json").unlink(missing_ok=True)
    return path


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoint files in ``directory``, oldest first (by step)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def load(path: str | Path) -> dict[str, Any]:
    """Verify ``path`` against its sidecar checksum and load it with ``weights_only=True``."""
    path = Path(path)
    side = path.with_suffix(".json")
    if not side.is_file():
        raise CheckpointError(f"{path.name}: no checksum sidecar {side.name} (incomplete write?)")
    try:
        meta = json.loads(side.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        raise CheckpointError(f"{path.name}: checksum sidecar {side.name} is unreadable") from None
    blob = path.read_bytes()
    actual = hashlib.sha256(blob).hexdigest()
    if actual != meta.get("sha256"):
        raise CheckpointError(
            f"{path.name}: sha256 mismatch (sidecar {str(meta.get('sha256'))[:12]}…, file {actual[:12]}…)"
        )
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path.name}: format version {meta.get('format_version')} (this build reads {FORMAT_VERSION})"
        )
    import io

    try:
        state: dict[str, Any] = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path.name}: cannot be loaded ({type(exc).__name__})") from None
    return state


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
    "Resumed",
    "list_checkpoints",
    "load",
    "newest_valid",
    "rng_state",
    "save",
    "set_rng_state",
]
