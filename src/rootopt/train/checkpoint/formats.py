"""What a run's checkpoint holds, and the two formats it is written and read in.

One process writes ``ckpt-<step>.pt`` (:mod:`rootopt.checkpoint`: atomic, checksummed,
plain data); world size > 1 writes ``dcp-<step>/`` with torch.distributed.checkpoint
(:mod:`rootopt.distributed.checkpoint`: collective, checksummed, loads at any world size).
Both hold the model and optimizer tensors and the same plain-data record of everything else
(:func:`extra`), so a resume restores the run exactly whatever the format.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rootopt import checkpoint as pt
from rootopt.config import to_dict
from rootopt.data import data_identity
from rootopt.distributed import checkpoint as dcp
from rootopt.train.build import TrainingError

if TYPE_CHECKING:
    from rootopt.train.run.state import Run


def manifest_digest(manifest: dict[str, Any]) -> str:
    """The digest checkpoints before data identities recorded (the manifest's splits)."""
    return hashlib.sha256(json.dumps(manifest["splits"], sort_keys=True).encode()).hexdigest()


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


def extra(run: Run, reason: str, own: dict[str, Any]) -> dict[str, Any]:
    """Everything of a checkpoint but the model and optimizer tensors (plain data);
    ``own``: the checkpointer's state dict."""
    return {
        "reason": reason,
        "scheduler": run.scheduler.state_dict(),
        "scaler": run.precision.state_dict(),
        "clipper": run.clipper.state_dict(),
        "rng": pt.rng_state(),
        "state": run.state.to_dict(),
        "config": to_dict(run.cfg),
        **own,
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


def write(
    run: Run, directory: Path, record: dict[str, Any], *, suspect: bool, serial: int | None
) -> Path:
    """Write the run's checkpoint at its current step: ``.pt`` in one process, ``dcp-*``
    (collective: every rank calls it) at world size > 1. ``record``: :func:`extra`;
    ``serial``: rank 0's (the other ranks pass None). :class:`OSError` or
    :class:`rootopt.distributed.checkpoint.DistCheckpointError` when it cannot."""
    step = run.state.step
    if run.world_size > 1:
        meta: dict[str, Any] = {"run_id": run.checkpointer.run_id, "suspect": suspect}
        if serial is not None:
            meta["serial"] = serial
        rec = {**record, "run_id": run.checkpointer.run_id}
        return dcp.save(directory, step, run.model, run.optimizer, extra=rec, meta=meta)
    payload = {
        **record,
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
    }
    return pt.save(
        directory,
        step,
        payload,
        run_id=run.checkpointer.run_id,
        suspect=suspect,
        serial=serial or 0,
    )


def name_at(run: Run) -> str:
    """The name of the checkpoint :func:`write` writes now."""
    step = run.state.step
    return f"dcp-{step:08d}" if run.world_size > 1 else f"ckpt-{step:08d}.pt"


# --------------------------------------------------------------------------- reading


def restore(
    run: Run, kind: str, path: Path, state: dict[str, Any] | None, say: Callable[[str], None]
) -> dict[str, Any]:
    """Load a checkpoint rank 0 chose and checked into the run: ``.pt`` (one process; at
    world size > 1 with DDP every rank reads it) or ``dcp-*`` (any world size, resharded);
    then the schedule, scaler, clipper and RNG. ``state``: rank 0's already-read ``.pt``.
    Returns the checkpoint's plain-data record."""
    if kind == "dcp":
        try:  # rank 0 checked every file's sha256 before anything was read (at the start)
            _, state = dcp.load(path, run.model, run.optimizer, verified=True)
        except dcp.DistCheckpointError as exc:
            raise pt.CheckpointUnreadable(
                f"cannot resume: {exc}; nothing was moved or deleted"
            ) from None
    else:
        if state is None:
            try:
                state = pt.load(path)
            except pt.CheckpointError as exc:
                raise pt.CheckpointUnreadable(f"cannot resume: {exc}") from None
        _load_single(run, path, state)
    _restore_schedule(run, state, say)
    run.precision.load_state_dict(state["scaler"])
    run.clipper.load_state_dict(state["clipper"])
    pt.set_rng_state(state["rng"])
    return state


def _load_single(run: Run, path: Path, state: dict[str, Any]) -> None:
    """Model and optimizer from a one-process checkpoint, at any world size with DDP."""
    from rootopt.distributed import unwrap_model

    if run.world_size > 1 and run.cfg.distributed.parallel == "fsdp":
        raise pt.CheckpointError(
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
