"""Checkpoints of a run: ownership of the directory, saving, resuming, and stop signals.

Ownership (docs/training.md, "Checkpoints and resume"): a run has an id (``run.json`` in its
log dir). Its checkpoint directory carries ``owner.json`` with that id and is locked with
``flock`` while the run lives; another run pointed at it is refused with one line, and
pruning touches only this run's checkpoints, in the order they were written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from rootopt import checkpoint
from rootopt._atomic import atomic_write
from rootopt.checkpoint import CheckpointError
from rootopt.config import Config, to_dict
from rootopt.train.build import TrainingError
from rootopt.train.state import Run, TrainState

RUN_FILE = "run.json"
# Files a run writes into its log dir; `checkpoint.resume=restart` moves them aside.
RUN_OUTPUTS = (
    "metrics.jsonl",
    "metrics.superseded.jsonl",
    "events.jsonl",
    "summary.json",
    "loss_curve.png",
    "tensorboard",
)


# --------------------------------------------------------------------------- ownership


def run_identity(cfg: Config, run_dir: Path, ckpt_dir: Path, data_dir: Path) -> str:
    """This log dir's run id (created on first use; a new one after ``resume=restart``)."""
    path = run_dir / RUN_FILE
    have: dict[str, Any] = {}
    if path.is_file():
        try:
            loaded = json.loads(path.read_text(encoding="utf-8"))
            have = loaded if isinstance(loaded, dict) else {}
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise TrainingError(
                f"{str(path)!r} is not a rootopt run file (unreadable JSON)"
            ) from None
    run_id = str(have.get("run_id", ""))
    if cfg.checkpoint.resume == "restart" and (run_id or checkpoint.list_checkpoints(ckpt_dir)):
        _archive(run_dir, ckpt_dir, run_id or "unknown")
        run_id = ""
    if not run_id:
        run_id = uuid.uuid4().hex
    data = {
        "run_id": run_id,
        "data_dir": str(data_dir.resolve()),
        "log_dir": str(run_dir.resolve()),
    }
    if data != have:
        atomic_write(path, (json.dumps(data, indent=1) + "\n").encode())
    return run_id


def _archive(run_dir: Path, ckpt_dir: Path, old_id: str) -> Path:
    """Move the previous run's outputs and checkpoints to ``previous/<time>-<id>/`` (never delete)."""
    dest = run_dir / "previous" / f"{time.strftime('%Y%m%d-%H%M%S')}-{old_id[:12]}"
    dest.mkdir(parents=True, exist_ok=False)
    for name in RUN_OUTPUTS:
        if (run_dir / name).exists():
            shutil.move(str(run_dir / name), str(dest / name))
    have = checkpoint.owner(ckpt_dir)
    if have is not None and have.get("run_id") not in (old_id, None):
        return dest  # not ours: claim() refuses it with one line
    moved = dest / "checkpoints"
    for p in checkpoint.list_checkpoints(ckpt_dir):
        moved.mkdir(exist_ok=True)
        for f in (p, p.with_suffix(".json")):
            if f.exists():
                shutil.move(str(f), str(moved / f.name))
    (ckpt_dir / checkpoint.OWNER).unlink(missing_ok=True)
    return dest


def take_ownership(run: Run) -> None:
    """Lock the checkpoint directory for this process and check that this run owns it."""
    run.ckpt_dir.mkdir(parents=True, exist_ok=True)
    lock = checkpoint.DirLock(run.ckpt_dir)
    lock.acquire()
    run.release = lock.release
    try:
        checkpoint.claim(run.ckpt_dir, run.run_id, str(run.run_dir.resolve()))
        existing = checkpoint.list_checkpoints(run.ckpt_dir)
        if run.cfg.checkpoint.resume == "never" and existing:
            raise CheckpointError(
                f"checkpoint.resume=never, but {str(run.ckpt_dir)!r} holds {len(existing)} "
                f"checkpoint(s) of this run (newest {existing[-1].name}); use a new --log_dir, or "
                "checkpoint.resume=restart to move the old run aside into "
                f"{str(run.run_dir / 'previous')!r} and start over"
            )
    except BaseException:
        lock.release()
        raise


# --------------------------------------------------------------------------- saving


def manifest_digest(manifest: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(manifest["splits"], sort_keys=True).encode()).hexdigest()


def params_finite(run: Run) -> bool:
    """All parameters finite; at world size > 1 on every rank (FSDP2 shards differ)."""
    local = [_local(p.detach()) for p in run.model.parameters()]
    flags = [torch.isfinite(t).all() for t in local if t.numel()]
    ok = torch.stack(flags).all() if flags else torch.tensor(True)
    if run.world_size > 1:
        from rootopt.dist import collective

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
        "data": {
            "manifest_sha256": manifest_digest(run.manifest),
            "path": str(run.data_dir.resolve()),
            "rank": run.info.rank,
            "world_size": run.info.world_size,
        },
    }


def save_checkpoint(run: Run, reason: str) -> Path:
    """Write this run's checkpoint at the current step (state must be consistent).

    One process: ``ckpt-<step>.pt`` (:mod:`rootopt.checkpoint`). World size > 1 (a
    collective, every rank calls it): ``dcp-<step>/`` with torch.distributed.checkpoint
    (:mod:`rootopt.dist.checkpoint`), which loads at any world size.
    """
    name = f"ckpt-{run.state.step:08d}.pt"
    in_episode = run.state.trouble_since >= 0
    protect = run.ckpt_dir / run.good_checkpoint if in_episode and run.good_checkpoint else None
    try:
        if run.world_size > 1:
            name = f"dcp-{run.state.step:08d}"
            path = _save_dcp(run, reason, protect)
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
                keep_last=run.cfg.checkpoint.keep_last,
                run_id=run.run_id,
                protect=protect,
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
        "checkpoint", step=run.state.step, reason=reason, path=path.name, suspect=in_episode
    )
    return path


def _save_dcp(run: Run, reason: str, protect: Path | None) -> Path:
    """Collective DCP save, published atomically by rank 0 (a hidden temporary directory
    renamed into place after every rank wrote its part), then rank 0 prunes this run's
    older ``dcp-*`` checkpoints down to ``checkpoint.keep_last`` (never ``protect``)."""
    from rootopt.dist import checkpoint as dcp

    extra = {**_extra(run, reason), "run_id": _shared_run_id(run)}
    try:
        path = dcp.save(run.ckpt_dir, run.state.step, run.model, run.optimizer, extra=extra)
    except dcp.DistCheckpointError as exc:
        raise TrainingError(f"{exc}; {last_good(run)}") from None
    if run.info.is_main:
        valid = [c.path for c in dcp.list_checkpoints(run.ckpt_dir) if c.valid]
        for old in valid[: -run.cfg.checkpoint.keep_last]:
            if old != protect and _dcp_run_id(old) == run.run_id:
                shutil.rmtree(old)
    return path


def _shared_run_id(run: Run) -> str:
    """Rank 0's run id (only rank 0 owns the run's files)."""
    if run.world_size == 1:
        return run.run_id
    box = [run.run_id]
    torch.distributed.broadcast_object_list(box, src=0)
    run.run_id = str(box[0])
    return run.run_id


def _dcp_run_id(path: Path) -> str:
    from rootopt.dist import checkpoint as dcp

    try:
        extra = torch.load(path / dcp.EXTRA, weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError):
        return ""
    return str(extra.get("run_id", "")) if isinstance(extra, dict) else ""


def set_aside_suspects(run: Run) -> list[str]:
    """Move checkpoints written inside the diverging episode to ``checkpoints/diverged/``."""
    moved = []
    dest = run.ckpt_dir / "diverged"
    for name in run.suspect if run.info.is_main else []:
        if name == run.good_checkpoint:
            continue
        src = run.ckpt_dir / name
        if src.exists():
            dest.mkdir(exist_ok=True)
            extras = [] if src.is_dir() else [src.with_suffix(".json")]
            for f in (src, *extras):
                if f.exists():
                    shutil.move(str(f), str(dest / f.name))
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


def maybe_resume(run: Run, say: Callable[[str], None]) -> None:
    """Restore the newest valid checkpoint (``checkpoint.resume``), reporting corrupt ones.

    Both formats count: ``ckpt-<step>.pt`` (one process) and ``dcp-<step>/`` (world size >
    1); the newest valid one of either wins and loads at the current world size
    (docs/distributed.md, "Training under torchrun"). At world size > 1 rank 0 chooses and
    tells the others, so every rank loads the same checkpoint.
    """
    mode = run.cfg.checkpoint.resume
    if mode in ("never", "restart"):
        return
    choice: tuple[str, str] = ("", "")
    if run.info.is_main:
        choice = _choose(run, mode, say)
    if run.world_size > 1:
        box = [choice]
        torch.distributed.broadcast_object_list(box, src=0)
        choice = box[0]
    kind, name = choice
    if not kind:
        return
    path = Path(name)
    if kind == "dcp":
        from rootopt.dist import checkpoint as dcp

        try:
            _, state = dcp.load(path, run.model, run.optimizer)
        except dcp.DistCheckpointError as exc:
            raise TrainingError(f"checkpoint.resume: {exc}") from None
        _check_compatible(run, path, state)
    else:
        try:
            state = checkpoint.load(path)
        except CheckpointError as exc:
            raise TrainingError(f"checkpoint.resume: {exc}") from None
        _check_compatible(run, path, state)
        _load_single(run, path, state)
    _restore_schedule(run, state, say)
    run.precision.load_state_dict(state["scaler"])
    run.clipper.load_state_dict(state["clipper"])
    checkpoint.set_rng_state(state["rng"])
    run.state = TrainState.from_dict(state["state"])
    run.resumed_from = run.last_checkpoint = path.name
    if run.state.trouble_since < 0:
        run.good_checkpoint = path.name
    run.monitor.event("resume", step=run.state.step, path=path.name)
    if run.info.is_main:
        saved = state["data"].get("world_size", 1)
        note = f" (saved at world size {saved})" if saved != run.world_size else ""
        say(f"resumed from {path.name} at step {run.state.step}{note}")


def _choose(run: Run, mode: str, say: Callable[[str], None]) -> tuple[str, str]:
    """(format, path) of the checkpoint to resume from, or ("", "") for none; rank 0."""
    from rootopt.dist import checkpoint as dcp

    if mode != "auto":
        return ("dcp" if Path(mode).is_dir() else "pt", mode)
    found, skipped = checkpoint.newest_valid(run.ckpt_dir)
    for line in skipped:
        say(f"skipping invalid checkpoint: {line}")
        run.monitor.event("checkpoint_invalid", detail=line)
    pt_step = _pt_step(found.path) if found is not None else -1
    best: tuple[str, str] = ("pt", str(found.path)) if found is not None else ("", "")
    for c in reversed(dcp.list_checkpoints(run.ckpt_dir)):
        if c.step <= pt_step:
            break
        if not c.valid:
            say(f"skipping invalid checkpoint: {c.path.name}: {c.reason}")
            run.monitor.event("checkpoint_invalid", detail=f"{c.path.name}: {c.reason}")
            continue
        saved_run = _dcp_run_id(c.path)
        if run.run_id and saved_run and saved_run != run.run_id:
            raise CheckpointError(
                f"{c.path.name} in {str(run.ckpt_dir)!r} was written by another run (run id "
                f"{saved_run[:12]}); point checkpoint.dir at a directory of this run"
            )
        return ("dcp", str(c.path))
    if found is not None:
        saved_run = found.state.get("run_id", "")
        if run.run_id and saved_run and saved_run != run.run_id:
            raise CheckpointError(
                f"{found.path.name} in {str(run.ckpt_dir)!r} was written by another run (run id "
                f"{str(saved_run)[:12]}); point checkpoint.dir at a directory of this run"
            )
    return best


def _pt_step(path: Path) -> int:
    try:
        return int(path.stem.split("-")[-1])
    except ValueError:
        return -1


def _load_single(run: Run, path: Path, state: dict[str, Any]) -> None:
    """Model and optimizer from a one-process checkpoint, at any world size with DDP."""
    from rootopt.dist import unwrap_model

    if run.world_size > 1 and run.cfg.distributed.parallel == "fsdp":
        raise TrainingError(
            f"{path.name} was written by one process; resuming it with distributed.parallel=fsdp "
            "is not supported: resume it once with distributed.parallel=ddp (its checkpoints "
            "then load with fsdp)"
        )
    unwrap_model(run.model).load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])


def _check_compatible(run: Run, path: Path, state: dict[str, Any]) -> None:
    """Everything that shapes the parameters must match; recomputation settings may change."""
    saved_model = {
        k: v for k, v in state["config"]["model"].items() if k != "activation_checkpointing"
    }
    wanted = {k: v for k, v in to_dict(run.cfg)["model"].items() if k != "activation_checkpointing"}
    if saved_model != wanted:
        diff = [
            f"model.{k}: {saved_model.get(k)!r} → {v!r}"
            for k, v in wanted.items()
            if saved_model.get(k) != v
        ]
        raise TrainingError(
            f"{path.name} was written for a different model ({'; '.join(diff)}); "
            "use a new --log_dir or checkpoint.resume=restart"
        )
    if state["data"]["manifest_sha256"] != manifest_digest(run.manifest):
        raise TrainingError(
            f"{path.name} was written for different data shards; resume needs the same --data_path"
        )


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


class StopFlag:
    """Set by SIGTERM/SIGINT (checkpoint, then stop) or a hook."""

    def __init__(self, enabled: bool) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(ValueError):  # not the main thread: no handlers
                    self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is not None:  # second signal: give up immediately
            raise KeyboardInterrupt
        self.signal = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
