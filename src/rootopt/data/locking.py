"""Who writes and who reads a prepared data directory: ``flock`` on the directory itself.

``rootopt data prepare`` holds the lock exclusively from before it touches ``--out`` (its
staging directory included) until the manifest is published; a training run holds it shared
for as long as it reads the directory (``--data_path``, ``data.path``, or the ``data/`` of
its run directory). A second prepare, or a prepare into a directory a live run reads, is
therefore refused before it writes or deletes anything, and a run does not start on a
directory a prepare is rewriting (docs/data.md, "Preparing shards").

The lock is taken on a descriptor of the directory (Linux ``flock`` locks directories as it
does files), so no lock file is written into the data: two prepares of the same settings
still give byte-identical directories, and a read-only dataset is locked like any other.
``flock`` is released by the kernel when its holder dies, even by SIGKILL, so a killed
prepare or run never leaves a stale lock. Where a file system cannot lock a directory
(``flock`` fails with another error than "held") the lock is skipped: preparing and training
work there as they did before it, without this protection.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from rootopt._atomic import O_NOFOLLOW, LinkError, is_link
from rootopt.data.shards import ShardError

_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class DataInUse(ShardError):
    """The data directory is being written, or read by a live run (one line, exit 2)."""


class DataLock:
    """The lock of one data directory, held by this process until :meth:`release`."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _open(self, *, follow: bool) -> int:
        flags = os.O_RDONLY | _DIRECTORY | _CLOEXEC | (0 if follow else O_NOFOLLOW)
        try:
            return os.open(self.directory, flags)
        except OSError as exc:
            if not follow and exc.errno in (errno.ELOOP, errno.ENOTDIR) and is_link(self.directory):
                raise LinkError(self.directory, "--out") from None
            raise

    def exclusive(self, what: str = "--out") -> None:
        """Take the lock to write into the directory (which must exist, and not be a
        symbolic link: :class:`~rootopt._atomic.LinkError`); :class:`DataInUse` while a
        live prepare or run holds it. Where the file system cannot lock a directory
        (:func:`_unsupported`) it returns without one, as prepares did before the lock."""
        import fcntl

        fd = self._open(follow=False)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if _unsupported(exc):
                os.close(fd)
                return
            try:  # readers share the lock: if a shared one is granted, only readers hold it
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                holder = "read by a live training run"
            except OSError:
                holder = "being written by another rootopt data prepare"
            finally:
                os.close(fd)
            raise DataInUse(
                f"{what} {str(self.directory)!r} is {holder}; wait for it to finish, or use "
                "another directory"
            ) from None
        self._fd = fd

    def shared(self, what: str = "data directory") -> None:
        """Take the lock to read the directory (a symbolic link to it is followed: the
        data is only read); :class:`DataInUse` while a prepare writes it. Without lock
        support (:func:`_unsupported`) it returns without one."""
        import fcntl

        fd = self._open(follow=True)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if _unsupported(exc):
                return
            raise DataInUse(
                f"{what} {str(self.directory)!r} is being written by rootopt data prepare; "
                "wait for it to finish"
            ) from None
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def _unsupported(exc: OSError) -> bool:
    """``flock`` failed because the file system cannot lock this directory (e.g. NFS,
    where Linux emulates ``flock`` with byte-range locks that need a descriptor open for
    writing: EBADF), not because another process holds the lock (EWOULDBLOCK)."""
    return exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


def held_by_live_run(run_dir: Path, lock_name: str = ".lock") -> bool:
    """``run_dir`` is a rootopt run directory whose lock file a live training process holds
    (reads only: the lock file is opened read-only, never created or followed)."""
    import fcntl

    if not (run_dir / "run.json").is_file():
        return False
    try:
        fd = os.open(run_dir / lock_name, os.O_RDONLY | O_NOFOLLOW | _CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False
