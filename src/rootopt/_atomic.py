"""Atomic file writes shared by every layer (a leaf: imports nothing from rootopt).

Write to a temporary file in the destination's directory, fsync, then rename over the
destination, so a reader sees the old file or the new one, never a torn one. The file gets
the permissions an ordinary ``open()`` would give it (``0o666`` less the process umask):
``tempfile.mkstemp`` creates ``0o600`` files, which would make a shared dataset or run
directory unreadable to the user's group whatever their umask says.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def umask() -> int:
    """The process umask, read without changing it where the kernel reports it
    (``/proc/self/status``, Linux >= 4.7); elsewhere set and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """Mode of a new regular file under the current umask."""
    return 0o666 & ~umask()


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (the directory must exist)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            if os.name == "posix":
                os.fchmod(fh.fileno(), file_mode())
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (a no-op where directories cannot
    be opened, e.g. Windows)."""
    if os.name == "posix":
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
