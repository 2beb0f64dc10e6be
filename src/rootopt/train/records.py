"""Metric records and the divergence policy.

A record's ``loss`` is the mean of the finite step losses over exactly the steps since the
previous record (``steps`` of them); the window is part of :class:`TrainState`, so it is
carried across a checkpoint and a resumed run writes the same records.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from rootopt.monitor import memory_bytes
from rootopt.train.build import TrainingError
from rootopt.train.mfu import mfu
from rootopt.train.state import Run, TrainState
from rootopt.train.step import StepResult


class Diverged(TrainingError):
    """The divergence policy stopped the run (exit status 1; the last good checkpoint is kept)."""


def account(st: TrainState, out: StepResult) -> None:
    """Fold one finished step into the counters and the open logging window."""
    st.step += 1
    st.window_steps += 1
    st.window_tokens += out.tokens
    if out.applied:
        st.window_finite += 1
        st.window_loss_sum += out.loss
        st.nonfinite_streak = 0
        st.finite_run += 1
    else:
        st.nonfinite_steps += 1
        st.nonfinite_streak += 1
        st.finite_run = 0
        if st.trouble_since < 0:
            st.trouble_since = st.step


def divergence(run: Run, out: StepResult) -> str:
    """Apply ``run.max_nonfinite`` / ``max_nonfinite_total`` and the loss-spike rule.

    Returns the reason to stop ('' to go on). Called after :func:`account`.
    """
    r, st = run.cfg.run, run.state
    if r.max_nonfinite and st.nonfinite_streak >= r.max_nonfinite:
        return (
            f"{st.nonfinite_streak} consecutive non-finite steps (limit run.max_nonfinite="
            f"{r.max_nonfinite}; last grad norm {out.grad_norm:g}, loss {out.loss:g})"
        )
    if r.max_nonfinite_total and st.nonfinite_steps >= r.max_nonfinite_total:
        return (
            f"{st.nonfinite_steps} non-finite steps in total (limit run.max_nonfinite_total="
            f"{r.max_nonfinite_total})"
        )
    if not out.applied:
        return ""
    # active once the median rests on a few steps (a resumed run carries its history)
    if r.loss_spike_factor and len(st.recent_losses) >= min(r.loss_spike_window, 10):
        median = statistics.median(st.recent_losses)
        spiking = out.loss > r.loss_spike_factor * median
        st.spike_streak = st.spike_streak + 1 if spiking else 0
        if spiking:
            st.finite_run = 0
            if st.trouble_since < 0:
                st.trouble_since = st.step
        if st.spike_streak >= r.loss_spike_patience:
            return (
                f"loss {out.loss:.4g} above {r.loss_spike_factor:g}× the median {median:.4g} of the "
                f"previous {r.loss_spike_window} steps for {st.spike_streak} steps "
                "(run.loss_spike_factor / loss_spike_patience)"
            )
    st.recent_losses.append(out.loss)
    del st.recent_losses[: -r.loss_spike_window]
    if st.trouble_since >= 0 and st.finite_run >= r.loss_spike_window:
        st.trouble_since = -1  # the episode is over: later checkpoints are good again
    return ""


def healthy(st: TrainState) -> bool:
    """No divergence streak open: a checkpoint written now holds good weights."""
    return st.nonfinite_streak == 0 and st.spike_streak == 0


class Clock:
    """Wall time of this session and of the open logging window."""

    def __init__(self, st: TrainState) -> None:
        self.session = self.window = time.perf_counter()
        self.steps = 0  # steps of this session in the open window
        self.elapsed0, self.tokens0, self.step0 = st.elapsed, st.tokens, st.step

    def since_session(self) -> float:
        return time.perf_counter() - self.session


def group_label(i: int, group: dict[str, Any]) -> str:
    return f"{i}.{group.get('algorithm', 'group')}"


def build_record(
    run: Run, out: StepResult, clock: Clock
) -> tuple[dict[str, Any], dict[str, dict[str, float]]]:
    """The record for the step just finished (the open window), and the per-tensor series."""
    st = run.state
    now = time.perf_counter()
    dt = max(now - clock.window, 1e-9)
    steps_here = max(clock.steps, 1)
    memory = memory_bytes()
    tokens_per_s = st.window_tokens / dt if clock.steps == st.window_steps else None
    record: dict[str, Any] = {
        "step": st.step,
        "loss": st.window_loss_sum / st.window_finite if st.window_finite else None,
        "steps": st.window_steps,  # steps averaged into this record
        "finite_steps": st.window_finite,
        "lr": out.lrs[0],
        "lr_groups": {
            group_label(i, g): lr
            for i, (g, lr) in enumerate(zip(run.optimizer.param_groups, out.lrs))
        },
        "grad_norm": out.grad_norm,
        "steps_per_s": clock.steps / dt,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu(run.flops_per_token, tokens_per_s, run.world_size, run.peak)
        if run.peak is not None
        else None,
        "step_time_s": dt / steps_here,
        "loss_scale": run.precision.scale,
        "nonfinite_steps": st.nonfinite_steps,
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


def close_window(st: TrainState, clock: Clock) -> None:
    """Start a new logging window (after its record was written)."""
    st.window_steps = st.window_finite = st.window_tokens = 0
    st.window_loss_sum = 0.0
    clock.window, clock.steps = time.perf_counter(), 0
