"""Process-group helpers: start from the launcher's environment, describe the world, and
run collectives under a timeout that turns a hung peer into one clear error line.

Everything works without a process group: :func:`world` then reports rank 0 of 1 and the
optimizer falls back to the plain single-process step (docs/distributed.md).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

import torch
import torch.distributed as dist

Backend = Literal["auto", "gloo", "nccl"]

# The environment torchrun (and the Kubeflow PyTorchJob operator) sets for every worker.
_ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class CollectiveError(RuntimeError):
    """A collective failed on this rank; the message names the rank and the operation."""


class CollectiveTimeoutError(CollectiveError):
    """A collective did not complete within the process group's timeout."""


class RendezvousError(CollectiveError):
    """The process group could not be formed (a peer never joined, a wrong address)."""


@dataclass(frozen=True)
class WorldInfo:
    """Where this process sits: global rank/world, the rank on its node, and its node."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str | None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def node_rank(self) -> int:
        return self.rank // max(self.local_world_size, 1)


# Default timeout of collectives issued through :func:`collective`; set by init_distributed.
_TIMEOUT_S: float = 1800.0


def resolve_backend(backend: Backend, device: torch.device | str | None = None) -> str:
    """``auto`` → ``nccl`` when the device is CUDA (or, with no device given, when CUDA is
    available), ``gloo`` otherwise. ``nccl`` without CUDA is a user error."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"distributed.backend: {backend!r} is unknown; choose auto, gloo or nccl")
    dev_type = torch.device(device).type if device is not None else None
    cuda = torch.cuda.is_available() if dev_type is None else dev_type == "cuda"
    if backend == "auto":
        return "nccl" if cuda else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("distributed.backend: nccl needs a CUDA device; use gloo or auto on CPU")
    return backend


def launched_by_torchrun() -> bool:
    """True when the launcher's rendezvous environment is present."""
    return all(k in os.environ for k in _ENV_KEYS)


# The store the process group was formed on (kept for failure reports, see claim_failure).
_STORE: Any = None
_FAILURE_KEY = "rootopt/failure"


def init_distributed(
    *,
    backend: Backend = "auto",
    init_method: str = "env://",
    timeout_s: float = 1800.0,
    device: torch.device | str | None = None,
    rank: int = -1,
    world_size: int = -1,
    rendezvous_timeout_s: float | None = None,
) -> WorldInfo:
    """Start the default process group from torchrun's environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), once.

    Without that environment and with ``init_method='env://'`` nothing is started and the
    world is rank 0 of 1. ``timeout_s`` is the process group's collective timeout and the
    default of :func:`collective`. ``rendezvous_timeout_s`` (default ``timeout_s``) bounds
    the wait for every rank to join: a missing peer ends in one
    :class:`RendezvousError` line after it instead of a silent wait for the collective
    timeout. On NCCL the process binds ``cuda:LOCAL_RANK`` first. With another
    ``init_method`` (``tcp://host:port``, ``file://...``) the group starts with the given
    ``rank`` and ``world_size`` (the launcher's ``RANK``/``WORLD_SIZE`` win when set).
    """
    global _TIMEOUT_S, _STORE
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"distributed.timeout_s: must be > 0, got {timeout_s!r}")
    rdzv_s = float(timeout_s if rendezvous_timeout_s is None else rendezvous_timeout_s)
    if not rdzv_s > 0:
        raise ValueError(f"distributed.rendezvous_timeout_s: must be > 0, got {rdzv_s!r}")
    _TIMEOUT_S = float(timeout_s)
    if dist.is_available() and dist.is_initialized():
        return world()
    if init_method == "env://" and not launched_by_torchrun():
        return world()
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of PyTorch")
    name = resolve_backend(backend, device)
    if name == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if init_method != "env://" and "WORLD_SIZE" in os.environ:
        rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
    if init_method == "env://":
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=float(timeout_s))
    address = _tcp_address(init_method)
    if address is None:  # file:// and other init methods: torch's own rendezvous
        dist.init_process_group(
            backend=name,
            init_method=init_method,
            timeout=timeout,
            rank=rank,
            world_size=world_size,
        )
        return world()
    with _quiet_native_stderr() as captured:
        try:
            base, store = _rendezvous_store(address, rank, world_size, rdzv_s)
            dist.init_process_group(
                backend=name, store=store, rank=rank, world_size=world_size, timeout=timeout
            )
        except (RuntimeError, TimeoutError, ValueError) as exc:
            captured.discard()
            raise _rendezvous_failure(exc, address, rank, world_size, rdzv_s) from None
    # from here on the store serves the process group: its waits follow the collective timeout
    base.set_timeout(timeout)
    _STORE = store
    return world()


def _tcp_address(init_method: str) -> tuple[str, int] | None:
    """``(host, port)`` of an ``env://`` (from ``MASTER_ADDR``/``MASTER_PORT``) or
    ``tcp://host:port`` rendezvous; None for other init methods."""
    if init_method == "env://":
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if init_method.startswith("tcp://"):
        host, _, port = init_method[len("tcp://") :].rpartition(":")
        try:
            return host.strip("[]"), int(port.split("?")[0])
        except ValueError:
            raise ValueError(
                f"distributed.init_method: {init_method!r} is not tcp://HOST:PORT"
            ) from None
    return None


def _rendezvous_store(
    address: tuple[str, int], rank: int, size: int, timeout_s: float
) -> tuple[Any, Any]:
    """The TCP store every rank joins, and the prefixed view the process group keys into.

    Under torchrun the launcher's agent hosts the store (``TORCHELASTIC_USE_AGENT_STORE``)
    and each rank connects as a client; otherwise rank 0 hosts it and waits for every rank,
    both under ``timeout_s``. After ``torchrun --max-restarts`` restarts the workers the
    agent's store may still hold the previous attempt's keys (seen with ``--standalone``:
    gloo's mesh set-up then read a dead worker's address and hung or was refused), so each
    attempt keys its process group under ``rootopt/attempt_<TORCHELASTIC_RESTART_COUNT>``.
    """
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = dist.TCPStore(  # type: ignore[attr-defined]
        address[0],
        address[1],
        size,
        is_master=not agent and rank == 0,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=not agent,
        multi_tenant=not agent,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"rootopt/attempt_{attempt}", base)  # type: ignore[attr-defined]
    return base, store


def _rendezvous_failure(
    exc: BaseException, address: tuple[str, int], rank: int, size: int, timeout_s: float
) -> RendezvousError:
    text = _first_line(exc)
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    where = f"{address[0]}:{address[1]}"
    if joined:
        detail = f"{joined.group(1)} of {joined.group(2)} processes joined"
    elif "timed out" in text.lower() or "timeout" in text.lower():
        detail = f"no rank 0 answered at {where}"
    else:
        detail = text[:160]
    return RendezvousError(
        f"rank {rank}/{size}: the process group did not form within {timeout_s:g} s "
        f"(distributed.rendezvous_timeout_s): {detail}; start every rank with the same "
        "MASTER_ADDR/MASTER_PORT (torchrun --nproc_per_node=N starts them for you)"
    )


class _Captured:
    def __init__(self) -> None:
        self.keep = True

    def discard(self) -> None:
        self.keep = False


@contextlib.contextmanager
def _quiet_native_stderr() -> Iterator[_Captured]:
    """Hold back what native code writes to file descriptor 2 while the group forms.

    c10d logs every failed connection attempt and timeout with a C++ stack trace straight
    to stderr (about 40 lines). When the rendezvous fails, the one line of
    :class:`RendezvousError` replaces them; when it succeeds, whatever was written is passed
    on unchanged."""
    captured = _Captured()
    try:
        saved = os.dup(2)
    except OSError:  # no usable stderr: nothing to hold back
        yield captured
        return
    sys.stderr.flush()
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if captured.keep:
                tmp.seek(0)
                data = tmp.read()
                if data:
                    os.write(2, data)


def claim_failure(line: str) -> bool:
    """Whether this rank is the first to report a failure of the job (an atomic
    compare-and-set in the rendezvous store). A rank that fails because a peer failed
    first (its collective broke) then stays silent instead of printing a second line
    about the same failure; several survivors of a dead peer print one line between them.
    True when there is no store to ask (one process, or ``file://`` init)."""
    if _STORE is None:
        return True
    try:
        got = _STORE.compare_set(_FAILURE_KEY, "", line)
    except Exception:  # the store's host is gone: say it rather than nothing
        return True
    return bytes(got).decode("utf-8", "replace") == line


def report_to_launcher(line: str, code: int) -> None:
    """Write ``line`` where torchrun's failure report reads a worker's error
    (``TORCHELASTIC_ERROR_FILE``), so the report names the cause instead of a link to its
    docs. torchrun itself still exits with status 1 whatever the worker's status was (it
    re-raises its ``ChildFailedError``); the report lists each worker's own exit code."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": {
            "message": line,
            "errorCode": code,
            "extraInfo": {"timestamp": str(int(time.time()))},
        }
    }
    with contextlib.suppress(OSError), open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh)


def world(group: dist.ProcessGroup | None = None) -> WorldInfo:
    """Rank and world of ``group`` (the default group); rank 0 of 1 without one."""
    if not (dist.is_available() and dist.is_initialized()):
        return WorldInfo(0, 1, 0, 1, None)
    rank = dist.get_rank(group)
    size = dist.get_world_size(group)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    local_rank = int(os.environ.get("LOCAL_RANK", rank % max(local_world, 1)))
    return WorldInfo(rank, size, local_rank, local_world, str(dist.get_backend(group)))


def shutdown() -> None:
    """Wait for every rank (so no peer still has a collective in flight towards this
    one), then destroy the default process group, if one is running."""
    if dist.is_available() and dist.is_initialized():
        collective("barrier before shutdown", dist.barrier)
        dist.destroy_process_group()


def finish(code: int = 0) -> NoReturn:
    """End a distributed worker: :func:`shutdown`, flush stdio and logging, then leave
    through ``os._exit(code)``.

    Why not a normal return: after the process group is destroyed, the interpreter's
    own exit (C++ static destructors) aborts now and then with ``terminate called
    without an active exception`` (SIGABRT, no Python frame) on torch 2.13 with gloo:
    seen once in about 130 launches of the three-rank parity script under load, after every
    rank had written its results, and once in CI. torchrun reports a SIGABRT worker as a failed
    run, and restarts a finished run under ``--max-restarts``. Nothing is lost by
    skipping the interpreter's clean-up: callers close and fsync what they own first
    (docs/distributed.md, "Ending a run")."""
    try:
        shutdown()
    except Exception as exc:  # a peer died after the work was done: say so, keep `code`
        print(_first_line(exc), file=sys.stderr)
    finally:
        exit_now(code)


def exit_now(code: int) -> NoReturn:
    """Flush stdio and logging, then end the process through ``os._exit(code)``, without
    the interpreter's clean-up (see :func:`finish` and :func:`abort` for why)."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


# Seconds this process has spent issuing and waiting for collectives started by
# start_collective/collective (a running total; differences time a span, e.g.
# StepStats.comm_seconds). One process drives one step at a time, so no lock.
_BLOCKED_S = 0.0


def blocked_seconds() -> float:
    """Seconds this process has spent so far inside :func:`collective`,
    :func:`start_collective` and :meth:`PendingCollective.wait`: issuing collectives and
    waiting for them, not compute they overlap (a running total; subtract two readings)."""
    return _BLOCKED_S


def _add_blocked(seconds: float) -> None:
    global _BLOCKED_S
    _BLOCKED_S += seconds


class PendingCollective:
    """A collective in flight; :meth:`wait` applies the timeout rules of
    :func:`collective`."""

    def __init__(self, name: str, work: Any, limit: float, rank: int, size: int) -> None:
        self.name = name
        self.work = work
        self.limit = limit
        self.rank = rank
        self.size = size
        self.start = time.monotonic()
        self.keep: tuple[Any, ...] = ()  # tensors the collective reads until it completes

    def wait(self) -> None:
        if self.work is None:
            return
        # measured from the wait, so that overlapped compute does not count
        begin = time.monotonic()
        try:
            self.work.wait(datetime.timedelta(seconds=self.limit))
        except Exception as exc:
            raise _failure(
                self.name, exc, time.monotonic() - begin, self.limit, self.rank, self.size
            ) from exc
        finally:
            _add_blocked(time.monotonic() - begin)
            self.work = None
            self.keep = ()


def _failure(
    name: str, exc: BaseException, elapsed: float, limit: float, rank: int, size: int
) -> CollectiveError:
    if elapsed >= 0.99 * limit:
        return CollectiveTimeoutError(
            f"rank {rank}/{size}: collective {name!r} did not complete within {limit:g} s "
            "(distributed.timeout_s); a peer rank is hung or has died"
        )
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return CollectiveError(
        f"rank {rank}/{size}: collective {name!r} failed after {elapsed:.1f} s: {first}"
    )


def describe_failure(name: str, exc: BaseException, elapsed: float) -> CollectiveError:
    """:class:`CollectiveError` for a collective ``name`` that raised ``exc`` after
    ``elapsed`` seconds under the process group's timeout (e.g. DDP's gradient all-reduce
    inside ``backward``); timeout vs other failure follows from the elapsed time."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return _failure(name, exc, elapsed, _TIMEOUT_S, rank, size)


def start_collective(
    name: str,
    fn: Callable[..., Any],
    /,
    *args: Any,
    timeout_s: float | None = None,
    group: dist.ProcessGroup | None = None,
    **kwargs: Any,
) -> PendingCollective:
    """Start ``fn(*args, async_op=True, group=group, **kwargs)``; wait on the result."""
    limit = _TIMEOUT_S if timeout_s is None else float(timeout_s)
    rank = dist.get_rank(group)
    size = dist.get_world_size(group)
    start = time.monotonic()
    try:
        work = fn(*args, async_op=True, group=group, **kwargs)
    except Exception as exc:
        raise _failure(name, exc, time.monotonic() - start, limit, rank, size) from exc
    finally:
        _add_blocked(time.monotonic() - start)
    return PendingCollective(name, work, limit, rank, size)


def collective(
    name: str,
    fn: Callable[..., Any],
    /,
    *args: Any,
    timeout_s: float | None = None,
    group: dist.ProcessGroup | None = None,
    **kwargs: Any,
) -> None:
    """Run collective ``fn(*args, async_op=True, group=group, **kwargs)`` and wait for it
    with ``Work.wait(timeout)``, torch.distributed's own timeout mechanism.

    When the wait gives up after the timeout, one :class:`CollectiveTimeoutError` line
    names this rank, the operation ``name`` and the timeout (a peer rank is hung or gone);
    any other failure becomes a :class:`CollectiveError` naming rank and operation. Which
    of the two it is follows from the elapsed time, not from the exception's text.
    """
    start_collective(name, fn, *args, timeout_s=timeout_s, group=group, **kwargs).wait()


def abort(exc: BaseException, code: int = 1) -> NoReturn:
    """Print ``exc`` as one line on stderr and end the process at once.

    After a collective timed out the process group still has an operation in flight and
    cannot be shut down cleanly (destroying it may block or abort), so a rank that lost
    its peers leaves through ``os._exit``; torchrun then stops (or restarts) the others.
    """
    print(_first_line(exc), file=sys.stderr)
    exit_now(code)
