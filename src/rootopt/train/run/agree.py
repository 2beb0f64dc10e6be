"""One verdict per failure across ranks: who prints it, and with which exit status.

Before the loop starts, each phase of the set-up runs on every rank (or on rank 0 alone)
and the outcomes are gathered: when any rank failed, every rank stops with that failure's
exit status and only rank 0 prints it, prefixed with the failing rank when it was another
one (docs/distributed.md, "Failures and timeouts"). In one process a phase simply runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from rootopt._atomic import LinkError
from rootopt.checkpoint import CheckpointError
from rootopt.config import ConfigError
from rootopt.data import CorpusError, ShardError, ShardWriteError
from rootopt.distributed import CollectiveError
from rootopt.train.build import ProcessInfo, TrainingError

T = TypeVar("T")


class JobError(Exception):
    """A failure decided for the whole job: every rank leaves with ``code``; the rank with
    ``speak`` prints ``lines`` (the others stay silent)."""

    def __init__(self, code: int, lines: list[str], *, speak: bool) -> None:
        self.code, self.lines, self.speak = code, lines, speak
        super().__init__("; ".join(lines))


class Interrupted(BaseException):
    """SIGINT or SIGTERM while the run is being set up (before the loop's own handling)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signum)


def exit_status(exc: BaseException) -> tuple[int, list[str]] | None:
    """``(status, lines)`` for a failure the command line reports as one line per problem:
    2 for a user error (config, data, a directory that is not this run's), 1 for a runtime
    failure; None for anything else (a bug, which keeps its traceback)."""
    if isinstance(exc, JobError):
        return exc.code, exc.lines
    if isinstance(exc, ConfigError):
        return 2, [f"config error: {line}" for line in exc.problems]
    if isinstance(exc, ShardWriteError):  # a full or read-only disk while preparing data
        return 1, [_one_line(exc)]
    if isinstance(exc, (ShardError, CorpusError, CheckpointError)):
        return 2, [_one_line(exc)]
    if isinstance(exc, (TrainingError, CollectiveError)):
        return 1, [_one_line(exc)]
    if isinstance(exc, LinkError):  # a link planted where the run writes: refused
        return 2, [_one_line(exc)]
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        return 1, [f"I/O error: {exc.strerror or exc}{where}"]
    return None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split("\n")).strip()
    return text or type(exc).__name__


def agreed(info: ProcessInfo, fn: Callable[[], T], *, what: str) -> T:
    """Run ``fn`` on this rank; at world size > 1 gather every rank's outcome and turn any
    failure into the same :class:`JobError` on every rank (rank 0 speaks)."""
    if info.world_size == 1:
        return fn()
    value: Any = None
    mine: tuple[int, list[str], bool] | None = None
    error: BaseException | None = None
    try:
        value = fn()
    except (KeyboardInterrupt, Interrupted):
        raise  # every rank got the signal: no gathering, each one leaves (main speaks once)
    except Exception as exc:
        error = exc
        known = exit_status(exc)
        mine = (known[0], known[1], False) if known else (1, [_one_line(exc)], True)
    outcomes = gather(info, mine, what)
    failed = [(rank, o) for rank, o in enumerate(outcomes) if o is not None]
    if not failed:
        return value  # type: ignore[no-any-return]
    rank, (code, lines, bug) = failed[0]
    if bug and rank == info.rank and error is not None:
        raise error  # an unexpected error keeps its traceback, on the rank that had it
    if rank != 0:
        lines = [f"rank {rank}/{info.world_size}: {line}" for line in lines]
    raise JobError(code, lines, speak=info.rank == 0 and not bug)


def gather(info: ProcessInfo, obj: Any, what: str) -> list[Any]:
    """``all_gather_object`` under the process group's timeout, as one failure line."""
    import time

    import torch.distributed as dist

    from rootopt.distributed import describe_failure

    out: list[Any] = [None] * info.world_size
    start = time.monotonic()
    try:
        dist.all_gather_object(out, obj)
    except RuntimeError as exc:
        raise describe_failure(f"all_gather ({what})", exc, time.monotonic() - start) from exc
    return out


def broadcast(info: ProcessInfo, obj: Any, what: str) -> Any:
    """Rank 0's ``obj`` on every rank (``broadcast_object_list``), as one failure line."""
    if info.world_size == 1:
        return obj
    import time

    import torch.distributed as dist

    from rootopt.distributed import describe_failure

    box = [obj]
    start = time.monotonic()
    try:
        dist.broadcast_object_list(box, src=0)
    except RuntimeError as exc:
        raise describe_failure(f"broadcast ({what})", exc, time.monotonic() - start) from exc
    return box[0]
