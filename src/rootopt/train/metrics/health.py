"""The divergence policy (docs/training.md, "Divergence") and the counters it keeps.

A run diverges after ``run.max_nonfinite`` consecutive non-finite (skipped) steps, after
``run.max_nonfinite_total`` of them in all, or when the loss stays above
``run.loss_spike_factor`` × the median of the previous ``run.loss_spike_window`` steps for
``run.loss_spike_patience`` steps. A *trouble episode* runs from the first non-finite or
spiking step until ``run.loss_spike_window`` finite steps in a row; checkpoints written
inside one are suspect (never replace the last good one, moved aside if the run diverges).

:class:`Health` is pure bookkeeping: it reads a step's result and the rules, never the
model. Its state is saved in every checkpoint (:class:`rootopt.train.run.state.TrainState`), so a
resumed run continues an open streak or episode exactly.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rootopt.config.schema import RunConfig
    from rootopt.train.step import StepResult

# the names are those of the flat state that checkpoints held before (tests/data/loop_run_*)
_FIELDS = (
    "nonfinite_steps",
    "nonfinite_streak",
    "spike_streak",
    "recent_losses",
    "trouble_since",
    "finite_run",
)


class Health:
    """Non-finite and loss-spike counters, the open trouble episode, and the rule."""

    def __init__(self) -> None:
        self.nonfinite_steps = 0  # over the whole run
        self.nonfinite_streak = 0
        self.spike_streak = 0
        self.recent_losses: list[float] = []  # the last run.loss_spike_window finite losses
        self.trouble_since = -1  # the step an open episode began; -1: none open
        self.finite_run = 0  # finite, non-spiking steps in a row

    @property
    def healthy(self) -> bool:
        """No divergence streak open: a checkpoint written now holds good weights."""
        return self.nonfinite_streak == 0 and self.spike_streak == 0

    @property
    def in_episode(self) -> bool:
        """A checkpoint written now is suspect."""
        return self.trouble_since >= 0

    def count(self, step: int, out: StepResult) -> None:
        """Count step ``step`` (just finished) as finite or not."""
        if out.applied:
            self.nonfinite_streak = 0
            self.finite_run += 1
        else:
            self.nonfinite_steps += 1
            self.nonfinite_streak += 1
            self.finite_run = 0
            if self.trouble_since < 0:
                self.trouble_since = step

    def verdict(self, rules: RunConfig, step: int, out: StepResult) -> str:
        """Apply the rules after :meth:`count`; the reason to stop, or '' to go on."""
        r = rules
        if r.max_nonfinite and self.nonfinite_streak >= r.max_nonfinite:
            return (
                f"{self.nonfinite_streak} consecutive non-finite steps (limit run.max_nonfinite="
                f"{r.max_nonfinite}; last grad norm {out.grad_norm:g}, loss {out.loss:g})"
            )
        if r.max_nonfinite_total and self.nonfinite_steps >= r.max_nonfinite_total:
            return (
                f"{self.nonfinite_steps} non-finite steps in total (limit run.max_nonfinite_total="
                f"{r.max_nonfinite_total})"
            )
        if not out.applied:
            return ""
        # active once the median rests on a few steps (a resumed run carries its history)
        if r.loss_spike_factor and len(self.recent_losses) >= min(r.loss_spike_window, 10):
            median = statistics.median(self.recent_losses)
            spiking = out.loss > r.loss_spike_factor * median
            self.spike_streak = self.spike_streak + 1 if spiking else 0
            if spiking:
                self.finite_run = 0
                if self.trouble_since < 0:
                    self.trouble_since = step
            if self.spike_streak >= r.loss_spike_patience:
                return (
                    f"loss {out.loss:.4g} above {r.loss_spike_factor:g}× the median {median:.4g} "
                    f"of the previous {r.loss_spike_window} steps for {self.spike_streak} steps "
                    "(run.loss_spike_factor / loss_spike_patience)"
                )
        self.recent_losses.append(out.loss)
        del self.recent_losses[: -r.loss_spike_window]
        if self.trouble_since >= 0 and self.finite_run >= r.loss_spike_window:
            self.trouble_since = -1  # the episode is over: later checkpoints are good again
        return ""

    def state_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in _FIELDS}
        d["recent_losses"] = list(self.recent_losses)
        return d

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``state`` from :meth:`state_dict`, or the flat state of an older checkpoint (the
        same names among others); a name it lacks keeps its initial value."""
        fresh = Health()
        for k in _FIELDS:
            setattr(self, k, state.get(k, getattr(fresh, k)))
        self.recent_losses = list(self.recent_losses)
