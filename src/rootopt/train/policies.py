"""The loop's policies: each decides when it acts and keeps its own state.

After every step the loop hands the step's result to each policy in turn
(:func:`rootopt.train.loop.train`):

- :class:`Stop`: before a step, whether to take it (``run.max_steps``, a signal,
  ``Hooks.after_step``, ``run.max_time``; at world size > 1 the ranks vote and stop together).
- health (:mod:`rootopt.train.metrics.health`): counts the step, applies the divergence rule.
- :class:`Log`: the metric record every ``run.log_every`` steps, histograms, the progress bar.
- :class:`Evaluate`: validation every ``run.eval_every`` steps and at the end.
- the checkpointer (:class:`rootopt.train.checkpoint.Checkpointer`, the run's own): a
  checkpoint every ``checkpoint.every`` steps, never inside a divergence streak, and the
  final one.
- faults (:mod:`rootopt.train.run.failures`): what a failed step leaves behind.

What a resumed run must continue (the health counters, the open logging window) is part of
:class:`~rootopt.train.run.state.TrainState` and saved in every checkpoint; the rest (the clock, a
signal, a deferred checkpoint) belongs to one session.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rootopt.train.metrics.records import Clock, build_record
from rootopt.train.run.agree import broadcast
from rootopt.train.run.failures import Faults
from rootopt.train.run.signals import StopFlag
from rootopt.train.run.state import Hooks, Run
from rootopt.train.step import StepResult

if TYPE_CHECKING:
    from rootopt.config.schema import RunConfig

Evaluation = Callable[..., "dict[str, float] | None"]  # rootopt.train.step.evaluate


class Stop:
    """Whether the loop takes another step.

    ``run.max_time`` limits one session (a job's time slot); a rerun continues from the
    checkpoint the stop writes. A signal (SIGTERM, SIGINT) or ``Hooks.after_step`` returning
    True stops after the current step, with a checkpoint. At world size > 1 each rank votes
    in the next step's loss reduction (``run.vote``) and every rank stops after that step.
    """

    def __init__(self, run: Run, clock: Clock, hooks: Hooks) -> None:
        self.max_steps, self.max_time = run.cfg.run.max_steps, run.cfg.run.max_time
        self.clock, self.hook = clock, hooks.after_step
        self.flag = StopFlag(run.cfg.checkpoint.on_signal)
        self.agreed = ""  # world size > 1: the status the ranks voted for

    @property
    def signal(self) -> int | None:
        """The signal that stopped the run (-1: a hook or another rank), or None."""
        return self.flag.signal

    def before_step(self, run: Run) -> str:
        """Why the loop stops now, or '' to take the next step."""
        if run.state.step >= self.max_steps:
            return "completed"
        # at least one step per session, so that every rerun makes progress (and the
        # checkpoint the stop promises exists) even with a tiny run.max_time
        out_of_time = bool(
            self.max_time
            and run.state.step > self.clock.step0
            and self.clock.since_session() >= self.max_time
        )
        if run.world_size == 1:
            if self.flag.signal is not None:
                return "interrupted"
            return "max_time" if out_of_time else ""
        if self.agreed:
            return self.agreed
        run.vote = (float(self.flag.signal is not None), float(out_of_time))
        return ""

    def after_step(self, run: Run, out: StepResult) -> None:
        """The ranks' votes in this step, then ``Hooks.after_step``."""
        if out.stop[0]:
            self.agreed, self.flag.signal = "interrupted", self.flag.signal or -1
        elif out.stop[1]:
            self.agreed = "max_time"
        if self.hook is not None and self.hook(run.state.step):
            self.flag.signal = self.flag.signal or -1  # as SIGTERM: checkpoint, then stop

    def close(self) -> None:
        self.flag.restore()


class Log:
    """What each step tells the monitor: the grad-norm gauge or a non-finite event; the
    record of the open window every ``run.log_every`` steps, at the last step and when the
    run diverges; histograms every ``monitoring.histogram_every`` steps; the progress bar.

    Host synchronisation happens at log steps only: :func:`rootopt.train.step.train_step`
    reads the log-step statistics when :meth:`due` says so.
    """

    def __init__(self, run: Run, clock: Clock) -> None:
        self.every, self.last = run.cfg.run.log_every, run.cfg.run.max_steps
        self.histogram_every = run.cfg.monitoring.histogram_every
        self.bar = _progress_bar(run)
        self.since, self.steps = clock.start, 0  # the open window's part in this session

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.last

    def after_step(self, run: Run, out: StepResult, *, diverging: bool = False) -> None:
        st, mon = run.state, run.monitor
        st.window.add(out)
        self.steps += 1
        if out.applied:
            mon.grad_norm(out.grad_norm)
        else:
            mon.nonfinite_step()
            mon.event(
                "nonfinite_step",
                step=st.step,
                grad_norm=out.grad_norm,
                loss=out.loss,
                loss_scale=run.precision.scale,
            )
        if self.due(st.step) or diverging:
            record, labelled = build_record(run, out, time.perf_counter() - self.since, self.steps)
            mon.log(record, labelled)
            st.window.close()
            self.since, self.steps = time.perf_counter(), 0
            if self.bar is not None:
                loss = record["loss"]
                self.bar.set_postfix(
                    loss=f"{loss:.3f}" if loss is not None else "nan",
                    lr=f"{record['lr']:.1e}",
                    refresh=False,
                )
        if diverging:  # the run stops with this record
            return
        if self.histogram_every and st.step % self.histogram_every == 0:
            mon.histograms(st.step, run.model)
        if self.bar is not None:
            self.bar.update(1)

    @staticmethod
    def recover(run: Run) -> None:
        """At a session's start: the record of a log step whose write failed (the emergency
        checkpoint holds its window), marked ``recovered``."""
        st, r = run.state, run.cfg.run
        if st.window.steps and (st.step % r.log_every == 0 or st.step == r.max_steps):
            run.monitor.log(
                {
                    "step": st.step,
                    "loss": st.window.loss,
                    "steps": st.window.steps,
                    "finite_steps": st.window.finite,
                    "nonfinite_steps": st.health.nonfinite_steps,
                    "tokens": st.tokens,
                    "recovered": True,
                }
            )
            st.window.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _progress_bar(run: Run) -> Any:
    if not (run.info.is_main and run.cfg.monitoring.progress_bar):
        return None
    from tqdm import tqdm

    return tqdm(
        total=run.cfg.run.max_steps,
        initial=run.state.step,
        unit="step",
        dynamic_ncols=True,
        file=sys.stderr,
    )


class Evaluate:
    """Validation every ``run.eval_every`` steps before the last, and at the last step.

    ``evaluate`` is :func:`rootopt.train.step.evaluate` (given, so that a caller can wrap
    it). Every rank evaluates when rank 0's log says an evaluation is due. ``token_bytes``:
    the UTF-8 bytes each token id stands for, for ``val_bits_per_byte`` (an int64 tensor on
    the device, :func:`rootopt.data.tokenizer.byte_lengths_of`); None when the data does
    not count them.
    """

    def __init__(self, rules: RunConfig, evaluate: Evaluation, token_bytes: Any = None) -> None:
        self.every, self.last = rules.eval_every, rules.max_steps
        self.evaluate = evaluate
        self.token_bytes = token_bytes

    def due(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0 and step < self.last)

    def after_step(self, run: Run) -> None:
        if self.due(run.state.step):
            self._log(run, self.evaluate(run, token_bytes=self.token_bytes))

    def redo(self, run: Run) -> None:
        """A resumed run evaluates first when the session it continues stopped at an
        evaluation step without writing that step's validation record (e.g. the validation
        data failed there and an emergency checkpoint was written)."""
        step, mon = run.state.step, run.monitor
        due = bool(
            run.checkpointer.resumed_from
            and mon.enabled
            and run.cfg.monitoring.jsonl
            and step > 0
            and self.due(step)
            and step not in mon.val_steps
        )
        if broadcast(run.info, due, "evaluation due"):
            self._log(run, self.evaluate(run, token_bytes=self.token_bytes))

    def final(self, run: Run, interrupt: Callable[[], bool] | None) -> dict[str, float] | None:
        """The evaluation of the last step unless it has a validation record already
        (rank 0 knows; every rank evaluates): its values, ``{}`` when none, or None when
        ``interrupt()`` stopped it."""
        mon = run.monitor
        due = not (mon.enabled and run.cfg.monitoring.jsonl and run.state.step in mon.val_steps)
        if not broadcast(run.info, due, "final evaluation due"):
            return {}
        got = self.evaluate(run, interrupt=interrupt, token_bytes=self.token_bytes)
        if got:
            self._log(run, got)
        return got

    @staticmethod
    def _log(run: Run, val: dict[str, float] | None) -> None:
        if val:
            run.monitor.log({"step": run.state.step, **val})


@dataclass
class Policies:
    """One session's policies, started together (the clock, signal handlers, progress bar);
    the run's checkpointer is the checkpoint policy (``run.checkpointer``)."""

    clock: Clock
    stop: Stop
    log: Log
    evaluate: Evaluate
    faults: Faults
    hooks: Hooks

    @classmethod
    def start(cls, run: Run, hooks: Hooks) -> Policies:
        clock = Clock(run.state)
        return cls(
            clock=clock,
            stop=Stop(run, clock, hooks),
            log=Log(run, clock),
            evaluate=run.evaluation,
            faults=Faults(),
            hooks=hooks,
        )

    def close(self) -> None:
        self.stop.close()
        self.log.close()
