"""Atomic, link-safe file writes shared by every layer (a leaf: imports nothing from rootopt).

Write to a temporary file in the destination's directory, fsync, then rename over the
destination, so a reader sees the old file or the new one, never a torn one. The file gets
the permissions an ordinary ``open()`` would give it (``0o666`` less the process umask):
``tempfile.mkstemp`` creates ``0o600`` files, which would make a shared dataset or run
directory unreadable to the user's group whatever their umask says.

No write here follows a symbolic link at its final path component (docs/operations.md,
"What a run trusts"): a replaced file is a new file renamed over the path (a link there is
replaced, its target untouched); an appended or locked file is opened with ``O_NOFOLLOW``;
a directory is created or checked with :func:`own_dir`, which refuses a link; a directory
staged elsewhere is published with :func:`publish_dir`, a rename that never follows one.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import IO, Any

# 0 where the platform has no O_NOFOLLOW (Windows: no symbolic links to plant by default)
O_NOFOLLOW: int = getattr(os, "O_NOFOLLOW", 0)


class LinkError(OSError):
    """A path the caller owns is a symbolic link: refused, nothing written through it."""

    def __init__(self, path: Path | str, what: str = "") -> None:
        path = Path(path)
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        self.path, self.target = path, target
        name = f"{what} {str(path)!r}" if what else repr(str(path))
        super().__init__(
            errno.ELOOP,
            f"{name} is a symbolic link (to {target!r}); rootopt writes only files and "
            "directories of its own and never through a link: remove the link"
            + (" or pass its target" if what.startswith("--") else ""),
            str(path),
        )

    def __str__(self) -> str:
        return str(self.strerror)


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


def is_link(path: Path | str) -> bool:
    """``path`` itself is a symbolic link (a dangling one too)."""
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False


def refuse_link(path: Path | str, what: str = "") -> None:
    """Raise :class:`LinkError` when ``path`` is a symbolic link (reads only)."""
    if is_link(path):
        raise LinkError(path, what)


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (the directory must exist). A symbolic
    link at ``path`` is replaced by the new file, never written through. An error names
    ``path`` (``OSError.filename``), so a full disk says where it happened."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise _named(exc, path) from None
    try:
        with os.fdopen(fd, "wb") as fh:
            if os.name == "posix":
                os.fchmod(fh.fileno(), file_mode())
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise _named(exc, path) from None
        raise


def _named(exc: OSError, path: Path) -> OSError:
    """``exc`` with ``path`` as its file name when it has none (``os.write``/``fsync``)."""
    if exc.filename is not None or exc.errno is None:
        return exc
    return OSError(exc.errno, exc.strerror, str(path))  # the errno's own subclass


def _nofollow(path: str, flags: int) -> int:
    return os.open(path, flags | O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), file_mode())


def open_append(path: Path, *, binary: bool = False, readable: bool = False) -> IO[Any]:
    """``path`` opened for appending (created when missing; ``readable``: for reading as
    well) without following a symbolic link at it: a link raises :class:`LinkError`,
    nothing is written."""
    mode = "a+" if readable else "a"
    try:
        if binary:
            return open(path, mode + "b", opener=_nofollow)
        return open(path, mode, encoding="utf-8", opener=_nofollow)
    except OSError as exc:
        if exc.errno == errno.ELOOP and is_link(path):
            raise LinkError(path) from None
        raise


def open_lock(path: Path) -> int:
    """A descriptor of lock file ``path`` (read-write, created when missing) that never
    follows a symbolic link: a link raises :class:`LinkError`."""
    try:
        return _nofollow(str(path), os.O_RDWR | os.O_CREAT)
    except OSError as exc:
        if exc.errno == errno.ELOOP and is_link(path):
            raise LinkError(path) from None
        raise


def own_dir(path: Path, what: str = "", *, parents: bool = True) -> Path:
    """Create directory ``path`` when missing and return it; refuse (:class:`LinkError`)
    when it is a symbolic link, and ``FileExistsError`` when it is not a directory."""
    path = Path(path)
    refuse_link(path, what)
    path.mkdir(parents=parents, exist_ok=True)
    refuse_link(path, what)  # a link planted between the check and mkdir
    return path


def staging_dir(parent: Path, name: str) -> Path:
    """A new, empty directory ``.<name>.<random>.tmp`` in ``parent`` (never an existing
    path, never through a link) with an ordinary directory's permissions, to fill and then
    publish with :func:`publish_dir`."""
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{name}.", suffix=".tmp"))
    if os.name == "posix":
        os.chmod(tmp, 0o777 & ~umask())
    return tmp


def publish_dir(tmp: Path, final: Path) -> None:
    """Rename the filled directory ``tmp`` to ``final`` (missing, or an empty directory)
    and make the rename durable. A symbolic link at ``final`` is refused
    (:class:`LinkError`); ``rename(2)`` never follows one either."""
    refuse_link(final)
    os.rename(tmp, final)
    fsync_dir(Path(final).parent)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (a no-op where directories cannot
    be opened, e.g. Windows)."""
    if os.name == "posix":
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
