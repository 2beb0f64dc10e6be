"""Checkpoints of a run: saving, pruning, resuming, and stop signals.

Ownership and the choice of the checkpoint to resume from are checked before the run
writes anything (:mod:`rootopt.train.plan`); here the run saves (``ckpt-<step>.pt`` in one
process, ``dcp-<step>/`` at world size > 1, one write serial for both), prunes its own
checkpoints of both formats in the order they were written (:func:`rootopt.train.ckpts.prune`),
and loads the chosen checkpoint into the model and optimizer.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from rootopt import checkpoint
from rootopt._atomic import own_dir
from rootopt.config import to_dict
from rootopt.data import data_identity
from rootopt.train import ckpts
from rootopt.train.build import TrainingError
from rootopt.train.plan import manifest_digest
from rootopt.train.state import Run, TrainState

# --------------------------------------------------------------------------- saving


def params_finite(run: Run) -> bool:
    """All parameters finite; at world size > 1 on every rank (FSDP2 shards differ)."""
    local = [_local(p.detach()) for p in run.model.parameters()]
    flags = [torch.isfinite(t).all() for t in local if t.numel()]
    ok = torch.stack(flags).all() if flags else torch.tensor(True)
    if run.world_size > 1:
        from rootopt.distributed import collective

        bad = (~ok).to(torch.int32).reshape(1).to(run.device)
        collective("all_reduce parameters finite", torch.distributed.all_reduce, bad)
        return int(bad.item()) == 0
    return bool(ok)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _extra(run: Run, reason: str) -> dict[str, Any]:
    """Everything of a checkpoint but the model and optimizer tensors (plain data)."""
    return {
        "reason": reason,
        "scheduler": run.scheduler.state_dict(),
        "scaler": run.precision.state_dict(),
        "clipper": run.clipper.state_dict(),
        "rng": checkpoint.rng_state(),
        "state": run.state.to_dict(),
        "config": to_dict(run.cfg),
        "good_checkpoint": run.good_checkpoint,
        # kind hf: the transformers config the model was built from (export, resume checks)
        **_hf_record(run),
        "data": {
            "identity": data_identity(run.manifest),
            "manifest_sha256": manifest_digest(run.manifest),
            "path": str(run.data_dir.resolve()),
            "rank": run.info.rank,
            "world_size": run.info.world_size,
        },
    }


def _hf_record(run: Run) -> dict[str, Any]:
    from rootopt.distributed import unwrap_model

    spec = getattr(unwrap_model(run.model), "spec", None)
    return {"hf_config": spec} if isinstance(spec, dict) else {}


def save_checkpoint(run: Run, reason: str) -> Path:
    """Write this run's checkpoint at the current step (state must be consistent).

    One process: ``ckpt-<step>.pt`` (:mod:`rootopt.checkpoint`). World size > 1 (a
    collective, every rank calls it): ``dcp-<step>/`` with torch.distributed.checkpoint
    (:mod:`rootopt.distributed.checkpoint`), which loads at any world size. Then rank 0 prunes
    this run's checkpoints of both formats down to ``checkpoint.keep_last``.
    """
    name = f"ckpt-{run.state.step:08d}.pt"
    in_episode = run.state.health.in_episode
    started = time.perf_counter()
    try:
        if run.world_size > 1:
            name = f"dcp-{run.state.step:08d}"
            path = _save_dcp(run, reason, in_episode)
        else:
            payload = {
                **_extra(run, reason),
                "model": run.model.state_dict(),
                "optimizer": run.optimizer.state_dict(),
            }
            path = checkpoint.save(
                run.ckpt_dir,
                run.state.step,
                payload,
                keep_last=None,
                run_id=run.run_id,
                suspect=in_episode,
                serial=ckpts.next_serial(run.ckpt_dir),
            )
        if run.info.is_main:
            ckpts.prune(
                run.ckpt_dir, run_id=run.run_id, keep_last=run.cfg.checkpoint.keep_last, keep=path
            )
    except OSError as exc:
        raise TrainingError(
            f"cannot write checkpoint {name} in {str(run.ckpt_dir)!r}: {exc.strerror or exc}; "
            f"{last_good(run)}"
        ) from None
    run.last_checkpoint = path.name
    if in_episode:
        run.suspect.append(path.name)
    else:
        run.good_checkpoint, run.suspect = path.name, []
    run.monitor.event(
        "checkpoint",
        step=run.state.step,
        reason=reason,
        path=path.name,
        suspect=in_episode,
        seconds=round(time.perf_counter() - started, 4),  # write + prune (docs/training.md)
    )
    return path


def _save_dcp(run: Run, reason: str, suspect: bool) -> Path:
    """Collective DCP save, published atomically by rank 0 (a hidden temporary directory
    renamed into place after every rank wrote its part)."""
    from rootopt.distributed import checkpoint as dcp

    extra = {**_extra(run, reason), "run_id": run.run_id}
    meta = {"run_id": run.run_id, "suspect": suspect}
    if run.info.is_main:
        meta["serial"] = ckpts.next_serial(run.ckpt_dir)
    try:
        return dcp.save(
            run.ckpt_dir, run.state.step, run.model, run.optimizer, extra=extra, meta=meta
        )
    except dcp.DistCheckpointError as exc:
        raise TrainingError(f"{exc}; {last_good(run)}") from None


def set_aside_suspects(run: Run) -> list[str]:
    """Move checkpoints written inside the diverging episode to ``checkpoints/diverged/``."""
    moved = []
    dest = run.ckpt_dir / "diverged"
    for name in run.suspect if run.info.is_main else []:
        if name == run.good_checkpoint:
            continue
        src = run.ckpt_dir / name
        if os.path.lexists(src):
            own_dir(dest)  # never a link to somewhere else
            extras = [] if src.is_dir() else [src.with_suffix(".json")]
            for f in (src, *extras):
                if os.path.lexists(f):
                    shutil.move(f, dest / f.name)
            moved.append(name)
    run.suspect = []
    run.last_checkpoint = run.good_checkpoint
    return moved


def last_good(run: Run) -> str:
    if run.last_checkpoint:
        return f"last checkpoint {run.last_checkpoint} is intact; rerun to resume from it"
    return "no checkpoint of this run was written yet"


def last_good_after_divergence(run: Run) -> str:
    moved = set_aside_suspects(run)
    note = ""
    if moved:
        note = (
            f" ({', '.join(moved)} written after the trouble began: moved to checkpoints/diverged/)"
        )
    if run.good_checkpoint:
        return f"last good checkpoint {run.good_checkpoint} is kept{note}"
    return f"no good checkpoint of this run was written yet{note}"


# --------------------------------------------------------------------------- resuming


def resume(
    run: Run,
    choice: tuple[str, str] | None,
    state: dict[str, Any] | None,
    say: Callable[[str], None],
) -> None:
    """Load the checkpoint rank 0 chose and checked (:mod:`rootopt.train.plan`): ``.pt``
    (one process; at world size > 1 with DDP every rank reads it) or ``dcp-*`` (any world
    size, resharded). ``state`` is rank 0's already-read ``.pt`` checkpoint."""
    if choice is None:
        return
    kind, name = choice
    path = Path(name)
    if kind == "dcp":
        from rootopt.distributed import checkpoint as dcp

        try:  # rank 0 checked every file's sha256 before anything was read (plan.check)
            _, state = dcp.load(path, run.model, run.optimizer, verified=True)
        except dcp.DistCheckpointError as exc:
            raise checkpoint.CheckpointUnreadable(
                f"cannot resume: {exc}; nothing was moved or deleted"
            ) from None
    else:
        if state is None:
            try:
                state = checkpoint.load(path)
            except checkpoint.CheckpointError as exc:
                raise checkpoint.CheckpointUnreadable(f"cannot resume: {exc}") from None
        _load_single(run, path, state)
    _restore_schedule(run, state, say)
    run.precision.load_state_dict(state["scaler"])
    run.clipper.load_state_dict(state["clipper"])
    checkpoint.set_rng_state(state["rng"])
    # where the run is: the position and the state of the policies that carry over (health,
    # the open logging window); a checkpoint of the flat counters of before loads too
    run.state = TrainState.from_dict(state["state"])
    run.resumed_from = run.last_checkpoint = path.name
    run.good_checkpoint, run.suspect = ckpts.good_and_suspect(run.ckpt_dir, run.run_id, path)
    if run.info.is_main:
        saved = state["data"].get("world_size", 1)
        note = f" (saved at world size {saved})" if saved != run.world_size else ""
        say(f"resumed from {path.name} at step {run.state.step}{note}")


def _load_single(run: Run, path: Path, state: dict[str, Any]) -> None:
    """Model and optimizer from a one-process checkpoint, at any world size with DDP."""
    from rootopt.distributed import unwrap_model

    if run.world_size > 1 and run.cfg.distributed.parallel == "fsdp":
        raise checkpoint.CheckpointError(
            f"{path.name} was written by one process; resuming it with distributed.parallel=fsdp "
            "is not supported: resume it once with distributed.parallel=ddp (its checkpoints "
            "then load with fsdp)"
        )
    unwrap_model(run.model).load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])


def _restore_schedule(run: Run, state: dict[str, Any], say: Callable[[str], None]) -> None:
    """Restore the schedule's position, keeping *this* config's schedule and base lr.

    LambdaLR's state holds the multiplier's fields and the base lrs of the config that wrote
    the checkpoint. The rerun's config wins (docs/training.md): a larger ``run.max_steps``
    decays over the new length and a changed ``base_lr`` applies, from the very next step
    (each group's lr is recomputed now, not one step later). An unchanged config gives
    identical values, so the resume stays exact.
    """
    sched = run.scheduler
    fields = [dict(fn.__dict__) for fn in sched.lr_lambdas]
    base_lrs = list(sched.base_lrs)
    sched.load_state_dict(state["scheduler"])
    for fn, f in zip(sched.lr_lambdas, fields):
        fn.__dict__.update(f)
    old_base = list(sched.base_lrs)
    sched.base_lrs = base_lrs
    groups = run.optimizer.param_groups
    if len(groups) != len(base_lrs):
        raise TrainingError("the checkpoint's optimizer has a different number of param groups")
    for g, base, fn in zip(groups, base_lrs, sched.lr_lambdas):
        g["initial_lr"] = base
        g["lr"] = base * fn(sched.last_epoch)
    sched._last_lr = [float(g["lr"]) for g in groups]  # type: ignore[attr-defined]
    if old_base != base_lrs:
        say(
            f"optimization.base_lr changed since the checkpoint ({old_base[0]:g} → "
            f"{base_lrs[0]:g} for group 0); the new value applies from the next step"
        )
        run.monitor.event("base_lr_changed", old=old_base, new=base_lrs, step=run.state.step)


# --------------------------------------------------------------------------- signals


@contextlib.contextmanager
def interruptible(enabled: bool = True) -> Any:
    """While the run is set up: SIGINT and SIGTERM raise :class:`Interrupted` at once (the
    set-up writes atomically, so stopping anywhere loses nothing), and the command line
    reports it as one line with status 130 / 143."""
    from rootopt.train.agree import Interrupted

    def handle(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signum)

    previous: dict[signal.Signals, Any] = {}
    if enabled:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread: no handlers
                previous[sig] = signal.signal(sig, handle)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class StopFlag:
    """Set by SIGTERM/SIGINT (checkpoint, then stop) or a hook.

    A second signal gives up at once (``KeyboardInterrupt``), except under torchrun: a
    Ctrl-C in the terminal reaches the workers directly *and* through the launcher, which
    forwards it; torchrun itself escalates to SIGKILL when the workers take too long.
    """

    def __init__(self, enabled: bool) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(ValueError):  # not the main thread: no handlers
                    self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is not None:  # second signal: give up immediately
            if "TORCHELASTIC_RUN_ID" in os.environ:
                return
            raise KeyboardInterrupt
        self.signal = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
