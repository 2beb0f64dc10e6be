"""The run's :class:`Checkpointer` (torchtitan's ``CheckpointManager`` is the shape): it owns
the checkpoint directory and both formats, when a checkpoint is written (``checkpoint.every``,
deferred while a divergence streak is open, the final one, the emergency one), which ones are
kept, the last good one, and the resume (docs/training.md, "Checkpoints and resume" and
"Divergence"). ``rootopt export`` and ``rootopt diagnose`` read a run through it too
(:meth:`Checkpointer.of_run`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.optim import Optimizer

from rootopt.checkpoint import CheckpointError, CheckpointUnreadable
from rootopt.distributed import checkpoint as dcp
from rootopt.train.build import TrainingError
from rootopt.train.checkpoint import catalog, formats
from rootopt.train.checkpoint.catalog import DIVERGED, Found, step_of
from rootopt.train.run.state import TrainState

if TYPE_CHECKING:
    import torch

    from rootopt.config import Config
    from rootopt.train.metrics.records import Clock
    from rootopt.train.run.state import Run


class Checkpointer:
    """One run's checkpoints in ``directory``.

    Its state: ``last`` (the newest checkpoint of this run written or resumed from),
    ``good`` (the newest written outside a trouble episode), ``suspect`` (those written
    inside the open episode, moved to ``diverged/`` if the run diverges) and
    ``resumed_from``; :meth:`state_dict` is what each checkpoint records of it. Writing
    calls are collective at world size > 1 (every rank calls them; rank 0 prunes)."""

    def __init__(
        self,
        directory: Path,
        *,
        run_id: str = "",
        every: int = 0,
        keep_last: int = 1,
        last_step: int = 0,
        is_main: bool = True,
        skipped: list[str] | None = None,
    ) -> None:
        self.directory, self.run_id, self.is_main = directory, run_id, is_main
        self.every, self.keep_last, self.last_step = every, keep_last, last_step
        self.last = ""
        self.good = ""
        self.suspect: list[str] = []
        self.resumed_from = ""
        self.due = False  # a periodic checkpoint waits for the first healthy step
        self._skipped = list(skipped or [])  # rank 0: the damaged ones the start passed over

    @classmethod
    def for_run(
        cls, cfg: Config, directory: Path, run_id: str, is_main: bool, skipped: list[str]
    ) -> Checkpointer:
        """The checkpointer of a training run with config ``cfg`` (``skipped``: rank 0's
        lines about the damaged checkpoints the start passed over)."""
        c = cfg.checkpoint
        return cls(
            directory,
            run_id=run_id,
            every=c.every,
            keep_last=c.keep_last,
            last_step=cfg.run.max_steps,
            is_main=is_main,
            skipped=skipped,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"good_checkpoint": self.good}

    def holds(self, step: int) -> bool:
        """Whether the newest checkpoint of this run holds ``step``."""
        return step_of(self.last) == step

    # ----------------------------------------------------------------------- writing

    def after_step(self, run: Run, clock: Clock) -> None:
        """A checkpoint every ``checkpoint.every`` steps before the last; one that falls due
        while a divergence streak is open waits for the first healthy step (never a bad
        one). The last step's checkpoint (or the stop's) is :meth:`final`."""
        st = run.state
        st.elapsed = clock.elapsed()
        self.due = self.due or st.step % self.every == 0
        if self.due and st.step < self.last_step and st.health.healthy:
            self._save_finite(run, "periodic")
            self.due = False

    def final(self, run: Run, status: str, clock: Clock) -> None:
        """The checkpoint a session ends with, unless one holds this step already."""
        st = run.state
        st.elapsed = clock.elapsed()
        if st.step > 0 and not self.holds(st.step):
            self._save_finite(run, status if status != "completed" else "final")

    def _save_finite(self, run: Run, reason: str) -> None:
        """Never a checkpoint of parameters that are not finite: the run diverged."""
        if not formats.params_finite(run):
            from rootopt.train.run.failures import diverged

            diverged(run, "parameters became non-finite")
        self.save(run, reason)

    def save(self, run: Run, reason: str) -> Path:
        """Write this run's checkpoint at the current step (the state must be consistent):
        ``ckpt-<step>.pt`` in one process, ``dcp-<step>/`` at world size > 1 (collective);
        then rank 0 prunes this run's checkpoints of both formats to ``checkpoint.keep_last``
        (:func:`rootopt.train.checkpoint.catalog.prune`)."""
        in_episode = run.state.health.in_episode
        started = time.perf_counter()
        try:
            serial = catalog.next_serial(self.directory) if self.is_main else None
            record = formats.extra(run, reason, self.state_dict())
            path = formats.write(run, self.directory, record, suspect=in_episode, serial=serial)
            if self.is_main:
                catalog.prune(
                    self.directory, run_id=self.run_id, keep_last=self.keep_last, keep=path
                )
        except OSError as exc:
            raise TrainingError(
                f"cannot write checkpoint {formats.name_at(run)} in {str(self.directory)!r}: "
                f"{exc.strerror or exc}; {self.last_good()}"
            ) from None
        except dcp.DistCheckpointError as exc:
            raise TrainingError(f"{exc}; {self.last_good()}") from None
        self.last = path.name
        if in_episode:
            self.suspect.append(path.name)
        else:
            self.good, self.suspect = path.name, []
        run.monitor.event(
            "checkpoint",
            step=run.state.step,
            reason=reason,
            path=path.name,
            suspect=in_episode,
            seconds=round(time.perf_counter() - started, 4),  # write + prune (docs/training.md)
        )
        return path

    def emergency(self, run: Run) -> str:
        """Save the consistent state of a failed run (one process, between steps), unless a
        checkpoint holds it already or a divergence streak is open; what was kept, as a note."""
        from rootopt.train.run.failures import first_line

        st = run.state
        if self.last and self.holds(st.step):
            return f"checkpoint {self.last} holds step {st.step}; rerun to resume"
        if st.step == 0:
            return "no step was completed, nothing to save"
        if not (st.health.healthy and formats.params_finite(run)):
            return f"a divergence streak is open, no emergency checkpoint; {self.last_good()}"
        try:
            path = self.save(run, "emergency")
        except (TrainingError, OSError, RuntimeError, MemoryError) as err:
            why = first_line(str(err)).split(";")[0]
            return f"emergency checkpoint failed ({why}); {self.last_good()}"
        return f"emergency checkpoint {path.name} written; rerun to resume"

    def last_good(self) -> str:
        """What a failed run keeps, as a note."""
        if self.last:
            return f"last checkpoint {self.last} is intact; rerun to resume from it"
        return "no checkpoint of this run was written yet"

    def after_divergence(self) -> str:
        """The run diverged: the checkpoints written inside the episode go to
        ``<checkpoint dir>/diverged/`` (rank 0), so a resume continues from the last good
        one; what is kept, as a note."""
        moved: list[str] = []
        names = set(self.suspect) - {self.good}
        if self.is_main and names:
            listed = catalog.list_checkpoints(self.directory)
            moved = catalog.set_aside(
                self.directory, [e for e in listed if e.name in names], DIVERGED
            )
        self.suspect, self.last = [], self.good
        note = ""
        if moved:
            note = f" ({', '.join(moved)} written after the trouble began: moved to checkpoints/diverged/)"
        if self.good:
            return f"last good checkpoint {self.good} is kept{note}"
        return f"no good checkpoint of this run was written yet{note}"

    # ----------------------------------------------------------------------- resuming

    def load(
        self,
        run: Run,
        choice: tuple[str, str] | None,
        state: dict[str, Any] | None,
        say: Callable[[str], None],
    ) -> None:
        """Resume ``run`` from the checkpoint rank 0 chose and checked at the start
        (:mod:`rootopt.train.checkpoint.start`; ``choice``: its kind and path, on every
        rank; ``state``: rank 0's already-read ``.pt``), and record the damaged ones the
        start passed over (``checkpoint_invalid`` events)."""
        for line in self._skipped:
            run.monitor.event("checkpoint_invalid", detail=line)
        if choice is None:
            return
        kind, name = choice
        path = Path(name)
        state = formats.restore(run, kind, path, state, say)
        # where the run is: the position and the state of the policies that carry over
        # (health, the open logging window); a checkpoint of the flat counters of before loads too
        run.state = TrainState.from_dict(state["state"])
        self.resumed_from = self.last = path.name
        self.good, self.suspect = catalog.good_and_suspect(self.directory, self.run_id, path)
        if self.is_main:
            saved = state["data"].get("world_size", 1)
            note = f" (saved at world size {saved})" if saved != run.world_size else ""
            say(f"resumed from {path.name} at step {run.state.step}{note}")

    # ----------------------------------------------------------------------- reading a run

    @classmethod
    def of_run(cls, run_dir: Path) -> Checkpointer:
        """The checkpointer of the run in ``run_dir``, to read it (``rootopt export``,
        ``rootopt diagnose``): ``checkpoint.dir`` of its ``config.yaml``, else
        ``<run_dir>/checkpoints``."""
        try:
            import yaml

            cfg = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
            d = cfg["checkpoint"]["dir"]
        except (OSError, ValueError, KeyError, TypeError, ImportError, AttributeError):
            d = ""
        return cls(Path(d) if isinstance(d, str) and d else run_dir / "checkpoints")

    def newest(self, say: Callable[[str], None]) -> tuple[Found | None, list[str]]:
        """The newest valid checkpoint (None when there is none), saying which newer ones
        it skipped and why, as training does; and those lines. Reads only.
        :class:`CheckpointUnreadable` when a newer one cannot be read by this build."""
        found, lines = catalog.newest_valid(self.directory)
        for line in lines:
            say(f"skipping invalid checkpoint: {line}")
        return found, lines

    def model_state(self, found: Found) -> dict[str, torch.Tensor]:
        """The model's full state dict in this process (a ``dcp-*`` resharded to whole
        tensors, its optimizer state left on disk); :class:`CheckpointError` when none."""
        if found.entry.kind == "pt":
            weights = found.state.get("model")
            if not isinstance(weights, dict):
                raise CheckpointError(f"{found.entry.name} holds no model weights")
            return weights
        try:
            return dcp.load_full_model_state(found.path)
        except dcp.DistCheckpointError as exc:
            raise (CheckpointError if exc.corrupt else CheckpointUnreadable)(str(exc)) from None

    def load_into(self, found: Found, model: nn.Module, optimizer: Optimizer) -> None:
        """Load ``found`` (read and verified by :meth:`newest`) into a model and optimizer
        in this process, whatever the world size that wrote it."""
        if found.entry.kind == "pt":
            model.load_state_dict(found.state["model"])
            optimizer.load_state_dict(found.state["optimizer"])
            return
        try:
            dcp.load(found.path, model, optimizer, verified=True)
        except dcp.DistCheckpointError as exc:
            raise (CheckpointError if exc.corrupt else CheckpointUnreadable)(str(exc)) from None
