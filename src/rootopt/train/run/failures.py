"""What a failure during training leaves behind, and the one line that reports it.

A step runs inside :meth:`Faults.guard`. A known failure (out of memory, damaged data, I/O,
a collective that failed or timed out, a data-loader worker that died) writes an emergency
checkpoint when the state is consistent: between steps, or while the step was still reading
and computing (``run.phase == "data"``: the model and optimizer are untouched, so the
position and the RNG go back to the start of the step). At world size > 1, or once the
update began, the last checkpoint stays the newest. Then the run stops with one line naming
what failed and what was kept. Any other exception is a bug and keeps its traceback.

A divergence (:mod:`rootopt.train.metrics.health`) sets aside the checkpoints written inside the
diverging episode and stops with :class:`Diverged` (docs/training.md, "Divergence").
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from rootopt import checkpoint
from rootopt.data import CorpusError, ShardError
from rootopt.distributed import CollectiveError, CollectiveTimeoutError
from rootopt.train.build import TrainingError
from rootopt.train.run.summary import write_summary

if TYPE_CHECKING:
    from rootopt.train.run.state import Run, TrainState

# what a step may raise that Faults.guard reports as one line (TrainingError aside)
KNOWN = (ShardError, CorpusError, OSError, torch.OutOfMemoryError, MemoryError, RuntimeError)


class Diverged(TrainingError):
    """The divergence policy stopped the run (exit status 1; the last good checkpoint is kept)."""


class Faults:
    """Guards each step: remembers where it started, and turns a known failure into an
    emergency checkpoint (when the state allows one) and one line."""

    @contextlib.contextmanager
    def guard(self, run: Run) -> Iterator[None]:
        at_start = (run.state.copy(), checkpoint.rng_state())
        try:
            yield
        except KNOWN as exc:
            if isinstance(exc, TrainingError):
                raise
            fatal(run, exc, at_start)


def diverged(run: Run, reason: str) -> NoReturn:
    """Stop the run as diverged: the event, the summary, the suspect checkpoints moved
    aside, and one line naming the last good checkpoint."""
    st = run.state
    hint = "lower optimization.base_lr"
    if run.precision.name == "fp16":
        hint += " or check mixed_precision.loss_scale"
    run.monitor.event(
        "diverged",
        step=st.step,
        reason=reason,
        precision=run.precision.name,
        checkpoint=run.checkpointer.good,
        trouble_since=st.health.trouble_since,
    )
    kept = run.checkpointer.after_divergence()
    msg = (
        f"diverged at step {st.step}: {reason}; {kept}; {hint} and rerun with "
        f"--log_dir {run.run_dir} to resume from it"
    )
    write_summary(run, "diverged", -1, detail=msg)
    raise Diverged(msg)


def fatal(run: Run, exc: BaseException, at_start: tuple[TrainState, dict[str, Any]]) -> NoReturn:
    """Write an emergency checkpoint when the state is consistent, then raise one line."""
    st = run.state
    step_no = st.step + 1 if run.phase != "between" else st.step
    kind, detail = describe(exc)
    if kind == "runtime":
        raise exc  # not a known failure: keep the traceback
    run.monitor.event(kind, step=step_no, detail=detail[:300])
    note = ""
    if run.world_size > 1:  # the other ranks may not reach a collective save
        note = f"no emergency checkpoint at world size > 1; {run.checkpointer.last_good()}"
    elif run.phase == "update":
        note = f"the step was mid-update, no emergency checkpoint; {run.checkpointer.last_good()}"
    else:
        if run.phase == "data":  # roll back to the start of the unfinished step
            run.state = at_start[0]
            checkpoint.set_rng_state(at_start[1])
        run.phase = "between"
        note = run.checkpointer.emergency(run)
    if kind == "oom":
        b = run.cfg.data.batch_size
        msg = (
            f"out of memory at step {step_no} ({detail}; batch_size={b}); reduce "
            "data.batch_size (use optimization.grad_accum_steps to keep the global batch) or set "
            f"model.activation_checkpointing=true; {note}"
        )
    elif kind == "worker":
        msg = (
            f"{detail} (at step {step_no}); each of the data.num_workers="
            f"{run.cfg.data.num_workers} workers holds decoded shards in memory: lower "
            f"data.num_workers, or look for the out-of-memory killer in the system log; {note}"
        )
    else:
        msg = f"{detail} (at step {step_no}); {note}"
    if isinstance(exc, (ShardError, CorpusError)):
        raise ShardError(msg) from None
    raise TrainingError(msg) from None


_WORKER = re.compile(r"^Caught (\w+) in DataLoader worker process (\d+)\.")
_CPU_OOM = ("DefaultCPUAllocator: can't allocate memory", "not enough memory")


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def one_line(exc: BaseException) -> str:
    """``exc`` as one line for the summary's detail."""
    return " ".join(str(exc).split("\n")).strip()[:500] or type(exc).__name__


def _from_worker(text: str) -> str:
    """The original error of a data-loader worker, without the traceback torch's message
    carries (``Caught ShardError in DataLoader worker process 1. Original Traceback ...``)."""
    m = _WORKER.match(text)
    if not m or "Original Traceback" not in text:
        return first_line(text)
    last = [line for line in text.strip().splitlines() if line.strip()][-1].strip()
    last = re.sub(r"^[\w.]+: ", "", last, count=1)  # "rootopt.data.shards.ShardError: ..."
    return f"{last} (in data-loader worker {m.group(2)})"


def describe(exc: BaseException) -> tuple[str, str]:
    """The failure's kind (the event's name; ``runtime``: not a known failure) and one line."""
    text = str(exc)
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and any(s in text for s in _CPU_OOM)
    ):
        line = first_line(text) or "out of memory"
        line = re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", line)
        return "oom", line[:160]
    if isinstance(exc, (ShardError, CorpusError)):
        return "data_error", _from_worker(text)
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        return "io_error", f"I/O error: {exc.strerror or exc}{where}"
    # rootopt.distributed's errors name rank, operation and timeout; the kind is the exception's
    # type (decided from the elapsed time there), never its text
    if isinstance(exc, CollectiveTimeoutError):
        return "timeout", first_line(text)
    if isinstance(exc, (CollectiveError, torch.distributed.DistError)):
        return "collective", first_line(text)
    if isinstance(exc, RuntimeError) and text.startswith("DataLoader worker"):
        return "worker", f"a data-loader worker died ({first_line(text)})"
    if _WORKER.match(text):
        return "runtime", text
    return "runtime", first_line(text) or type(exc).__name__
