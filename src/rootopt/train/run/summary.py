"""The session's result: :class:`Summary`, written to ``summary.json`` when a session starts
(``running``), and again when it ends, however it ends (docs/training.md, "The run
directory")."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rootopt._atomic import atomic_write
from rootopt.monitor import read_jsonl, strict

if TYPE_CHECKING:
    from rootopt.config import Config
    from rootopt.train.metrics.records import Clock
    from rootopt.train.preflight import Complete
    from rootopt.train.run.state import Run


@dataclass
class Summary:
    status: str  # running | completed | interrupted | max_time | diverged | failed
    steps: int  # total optimizer steps of the run
    session_steps: int  # steps this process ran
    wall_s: float
    steps_per_s: float  # this session
    tokens_per_s: float  # this session
    initial_loss: float
    final_loss: float
    val_loss: float
    nonfinite_steps: int
    checkpoint: str
    run_dir: str
    resumed_from: str
    signal: int = 0
    max_steps: int = 0
    detail: str = ""  # why the session stopped, when not completed
    # lines in metrics.jsonl when the summary was written (None: no JSONL log); `rootopt
    # report` compares it with the file to tell a complete log from a cut one
    metrics_records: int | None = None
    # a new run started from model.init_from: where from ("DIR (step N of RUN)")
    initialised_from: str = ""


def write_summary(
    run: Run,
    status: str,
    session_steps: int,
    val: dict[str, float] | None = None,
    clock: Clock | None = None,
    signum: int | None = None,
    *,
    detail: str = "",
) -> Summary:
    """The summary of this session (rank 0 writes it; every rank returns it)."""
    st = run.state
    wall = clock.since_session() if clock is not None else 0.0
    rows = read_jsonl(run.run_dir / "metrics.jsonl") if run.info.is_main else []
    losses = [r["loss"] for r in rows if isinstance(r.get("loss"), (int, float))]
    vals = [r["val_loss"] for r in rows if isinstance(r.get("val_loss"), (int, float))]
    summary = Summary(
        status=status,
        steps=st.step,
        session_steps=session_steps,
        wall_s=wall,
        steps_per_s=session_steps / wall if wall and session_steps > 0 else 0.0,
        tokens_per_s=(st.tokens - clock.tokens0) / wall if clock is not None and wall else 0.0,
        initial_loss=losses[0] if losses else float("nan"),
        final_loss=losses[-1] if losses else float("nan"),
        val_loss=(val or {}).get("val_loss", vals[-1] if vals else float("nan")),
        nonfinite_steps=st.health.nonfinite_steps,
        checkpoint=run.checkpointer.last,
        run_dir=str(run.run_dir),
        resumed_from=run.checkpointer.resumed_from,
        signal=signum if signum and signum > 0 else 0,
        max_steps=run.cfg.run.max_steps,
        detail=detail,
        metrics_records=run.monitor.records if run.cfg.monitoring.jsonl else None,
        initialised_from=run.initialised_from,
    )
    if run.info.is_main:
        text = json.dumps(strict(summary.__dict__), indent=1, allow_nan=False) + "\n"
        atomic_write(run.run_dir / "summary.json", text.encode())
    return summary


def already_complete(cfg: Config, done: Complete) -> Summary:
    """The summary of a run found complete in a directory this process cannot write."""
    nan = float("nan")
    return Summary(
        status="completed",
        steps=done.step,
        session_steps=0,
        wall_s=0.0,
        steps_per_s=0.0,
        tokens_per_s=0.0,
        initial_loss=nan,
        final_loss=nan,
        val_loss=nan,
        nonfinite_steps=0,
        checkpoint=done.checkpoint,
        run_dir=done.run_dir,
        resumed_from=done.checkpoint,
        max_steps=cfg.run.max_steps,
        detail=f"nothing was written: {done.why}",
    )
