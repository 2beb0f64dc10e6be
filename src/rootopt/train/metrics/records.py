"""Metric records: the open logging window, the session's clock, and the record itself.

A record's ``loss`` is the mean of the finite step losses over exactly the steps since the
previous record (``steps`` of them); the window is part of :class:`TrainState`, so it is
carried across a checkpoint and a resumed run writes the same records. ``account`` and
``divergence`` fold a finished step into the position and the health counters
(:mod:`rootopt.train.metrics.health`) and apply the divergence rule.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

from rootopt.monitor import memory_bytes

if TYPE_CHECKING:
    from rootopt.train.run.state import Run, TrainState
    from rootopt.train.step import StepResult


def account(st: TrainState, out: StepResult) -> None:
    """Fold one finished step into the position and the health counters."""
    st.step += 1
    st.health.count(st.step, out)


def divergence(run: Run, out: StepResult) -> str:
    """Apply ``run.max_nonfinite`` / ``max_nonfinite_total`` and the loss-spike rule
    (:meth:`rootopt.train.metrics.health.Health.verdict`); the reason to stop, '' to go on. Called
    after :func:`account`."""
    return run.state.health.verdict(run.cfg.run, run.state.step, out)


class Window:
    """The open logging window: the steps since the previous record."""

    def __init__(self) -> None:
        self.steps = 0
        self.finite = 0
        self.loss_sum = 0.0
        self.tokens = 0

    def add(self, out: StepResult) -> None:
        self.steps += 1
        self.tokens += out.tokens
        if out.applied:
            self.finite += 1
            self.loss_sum += out.loss

    @property
    def loss(self) -> float | None:
        """The mean finite loss of the window (None: no finite step in it)."""
        return self.loss_sum / self.finite if self.finite else None

    def close(self) -> None:
        self.steps = self.finite = self.tokens = 0
        self.loss_sum = 0.0

    def state_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "finite": self.finite,
            "loss_sum": self.loss_sum,
            "tokens": self.tokens,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.finite = int(state["steps"]), int(state["finite"])
        self.loss_sum, self.tokens = float(state["loss_sum"]), int(state["tokens"])


class Clock:
    """Wall time of this session, and where it started (step, tokens, training seconds)."""

    def __init__(self, st: TrainState) -> None:
        self.start = time.perf_counter()
        self.elapsed0, self.tokens0, self.step0 = st.elapsed, st.tokens, st.step

    def since_session(self) -> float:
        return time.perf_counter() - self.start

    def elapsed(self) -> float:
        """Training seconds over all sessions."""
        return self.elapsed0 + self.since_session()


def group_label(i: int, group: dict[str, Any]) -> str:
    return f"{i}.{group.get('algorithm', 'group')}"


def _mfu(run: Run, tokens_per_s: float | None) -> float | None:
    """The window's MFU (rank 0, which holds the peak). A window above the peak records
    none, and the first one in a session says so in ``events.jsonl``: the peak is wrong
    there (docs/monitoring.md, "Throughput and MFU")."""
    value, above = run.mfu.window(tokens_per_s, run.world_size)
    if above and run.mfu.peak is not None:
        run.monitor.event(
            "mfu_above_peak",
            step=run.state.step,
            achieved_tflops=above / 1e12,
            peak=run.mfu.peak.record(),
            detail="the model ran above the peak mfu divides by: the peak is too low "
            "(set run.peak_tflops); mfu is not recorded for such windows",
        )
    return value


def build_record(
    run: Run, out: StepResult, seconds: float, steps_here: int
) -> tuple[dict[str, Any], dict[str, dict[str, float]]]:
    """The record for the step just finished (the open window), and the per-tensor series.

    ``seconds``: wall time of the window in this session, over ``steps_here`` of its steps
    (fewer than the window's when it began in the session before a resume)."""
    st, w = run.state, run.state.window
    dt = max(seconds, 1e-9)
    memory = memory_bytes()
    tokens_per_s = w.tokens / dt if steps_here == w.steps else None
    record: dict[str, Any] = {
        "step": st.step,
        "loss": w.loss,
        "steps": w.steps,  # steps averaged into this record
        "finite_steps": w.finite,
        "lr": out.lrs[0],
        "lr_groups": {
            group_label(i, g): lr
            for i, (g, lr) in enumerate(zip(run.optimizer.param_groups, out.lrs))
        },
        "grad_norm": out.grad_norm,
        "steps_per_s": steps_here / dt,
        "tokens_per_s": tokens_per_s,
        "mfu": _mfu(run, tokens_per_s),
        "step_time_s": dt / max(steps_here, 1),
        "loss_scale": run.precision.scale,
        "nonfinite_steps": st.health.nonfinite_steps,
        "tokens": st.tokens,
        **out.stats,
        "memory_rss_bytes": memory["rss"],
    }
    labelled: dict[str, dict[str, float]] = {"rootopt_memory_bytes": memory}
    if out.ratios:
        labelled["rootopt_update_param_ratio"] = out.ratios
        vals = sorted(out.ratios.values())
        record["update_ratio_median"] = vals[len(vals) // 2]
        record["update_ratio_max"] = vals[-1]
    tel = getattr(run.optimizer, "telemetry", None) if run.telemetry else None
    if tel and out.applied:
        labelled["rootopt_root_clip_fraction"] = {
            k: float(v["clip_fraction"]) for k, v in tel.items()
        }
        labelled["rootopt_root_eps"] = {k: float(v["eps"]) for k, v in tel.items()}
        record["root_clip_fraction"] = statistics.fmean(
            labelled["rootopt_root_clip_fraction"].values()
        )
        record["root_eps_mean"] = statistics.fmean(labelled["rootopt_root_eps"].values())
        record["root_ortho_residual"] = statistics.fmean(
            float(v["ortho_residual"]) for v in tel.values()
        )
    return record, labelled
