"""Resharding checkpoints with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory ``dcp-<step:08d>/`` holding DCP's files (model and optimizer
state by parameter name, sharded tensors as ``DTensor``), ``extra.pt`` (rank 0's opaque
dict: scheduler, scaler, data position, RNG; plain data, loadable with
``weights_only=True``) and ``rootopt.json`` (format, step, world size at save). It is
written into a hidden temporary directory next to it and renamed into place only after
every rank has finished, so a reader sees a complete checkpoint or none. Because the
optimizer state is per parameter, created eagerly and never depends on ownership
(:class:`rootopt.distributed.DistributedROOT`), a checkpoint saved at world size N loads at any
world size M. The directory must be visible to every rank (a shared filesystem when
ranks are on several machines).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from rootopt._atomic import atomic_write, fsync_dir
from rootopt.distributed.group import world
from rootopt.distributed.model import unwrap_model

FORMAT = "rootopt-dcp"
FORMAT_VERSION = 1
MARKER = "rootopt.json"
EXTRA = "extra.pt"
_NAME = re.compile(r"^dcp-(\d{8})$")
_PARTIAL = re.compile(r"^\.dcp-\d{8}\.partial-[0-9a-f]{12}$")


class DistCheckpointError(ValueError):
    """A checkpoint directory that cannot be used (the message says why)."""


@dataclass(frozen=True)
class CheckpointInfo:
    """``valid``: complete and of this format. An invalid one is ``corrupt`` when it is
    provably damaged or incomplete (a missing or garbled marker, a missing file); otherwise
    (another format version, an I/O error) this build merely cannot read it."""

    path: Path
    step: int
    valid: bool
    reason: str = ""
    corrupt: bool = True
    meta: dict[str, Any] = field(default_factory=dict)  # the marker (rootopt.json)


def stale_partials(directory: str | Path) -> list[Path]:
    """Hidden temporary directories of saves that never completed (the process died
    before the rename published them). Only the directory's owner, holding its lock,
    may remove them."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _PARTIAL.match(p.name) and p.is_dir())


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def _broadcast(obj: Any) -> Any:
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier() -> None:
    if _active():
        dist.barrier()


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"dcp-{step:08d}"


def save(
    directory: str | Path,
    step: int,
    model: nn.Module,
    optimizer: Optimizer,
    *,
    extra: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Save model + optimizer (+ ``extra``) as checkpoint ``step``; collective (call on
    every rank). Refuses to overwrite an existing checkpoint. Returns its path.

    ``meta`` (plain JSON, rank 0's) is stored in the marker next to the format and step,
    where listing and pruning can read it without loading ``extra.pt``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be an integer >= 0, got {step!r}")
    directory = Path(directory)
    final = checkpoint_path(directory, step)
    info = world()
    plan: tuple[str, str] = ("", "")
    if info.rank == 0:
        if final.exists():
            plan = ("", f"checkpoint {final} already exists; refusing to overwrite it")
        else:
            directory.mkdir(parents=True, exist_ok=True)
            tmp = directory / f".{final.name}.partial-{uuid.uuid4().hex[:12]}"
            tmp.mkdir()
            plan = (str(tmp), "")
    tmp_name, error = _broadcast(plan)
    if error:
        raise DistCheckpointError(error)
    tmp_dir = Path(tmp_name)
    inner = unwrap_model(model)
    model_sd, optim_sd = get_state_dict(inner, optimizer)
    dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_dir)
    if info.rank == 0:
        buf_path = tmp_dir / EXTRA
        torch.save(dict(extra or {}), buf_path)
        with open(buf_path, "rb") as fh:
            os.fsync(fh.fileno())
        marker = {
            **(meta or {}),
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": step,
            "world_size": info.world_size,
        }
        atomic_write(tmp_dir / MARKER, json.dumps(marker, indent=1).encode())
        fsync_dir(tmp_dir)
    _barrier()  # every rank's shards are on disk before the rename publishes them
    if info.rank == 0:
        os.rename(tmp_dir, final)
        fsync_dir(directory)
    _barrier()
    return final


def inspect(path: str | Path) -> CheckpointInfo:
    """Whether ``path`` is a complete checkpoint of this format, and its step."""
    path = Path(path)
    m = _NAME.match(path.name)
    step = int(m.group(1)) if m else -1
    if not path.is_dir():
        return CheckpointInfo(path, step, False, "not a directory")
    if m is None:
        return CheckpointInfo(path, step, False, "name is not dcp-<8-digit step>")
    try:
        raw = (path / MARKER).read_bytes()
    except FileNotFoundError:
        return CheckpointInfo(path, step, False, f"{MARKER} unreadable (missing)")
    except OSError as exc:
        reason = f"{MARKER} cannot be read ({exc.strerror or exc})"
        return CheckpointInfo(path, step, False, reason, corrupt=False)
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        return CheckpointInfo(path, step, False, f"{MARKER} unreadable ({exc.__class__.__name__})")
    if not isinstance(meta, dict):
        return CheckpointInfo(path, step, False, f"{MARKER} is not a JSON object")
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        reason = (
            f"format {meta.get('format')!r} version {meta.get('format_version')!r}; this build "
            f"of rootopt reads {FORMAT!r} version {FORMAT_VERSION} (written by another version)"
        )
        return CheckpointInfo(path, step, False, reason, corrupt=False, meta=meta)
    if meta.get("step") != step:
        return CheckpointInfo(
            path, step, False, f"{MARKER} says step {meta.get('step')}", meta=meta
        )
    if not (path / ".metadata").is_file() or not (path / EXTRA).is_file():
        return CheckpointInfo(path, step, False, "DCP metadata or extra.pt missing", meta=meta)
    return CheckpointInfo(path, step, True, meta=meta)


def read_extra(path: str | Path) -> dict[str, Any]:
    """``extra.pt`` of checkpoint ``path`` (plain data, loaded with ``weights_only=True``);
    :class:`DistCheckpointError` when it cannot be loaded."""
    path = Path(path)
    try:
        extra = torch.load(path / EXTRA, map_location="cpu", weights_only=True)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ""
        raise DistCheckpointError(
            f"{path.name}: {EXTRA} cannot be loaded by this build "
            f"({type(exc).__name__}{': ' + first if first else ''})"
        ) from None
    if not isinstance(extra, dict):
        raise DistCheckpointError(f"{path.name}: {EXTRA} holds a {type(extra).__name__}")
    return extra


def list_checkpoints(directory: str | Path) -> list[CheckpointInfo]:
    """Every ``dcp-*`` directory under ``directory``, oldest first, with its validity."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [inspect(p) for p in directory.iterdir() if _NAME.match(p.name)]
    return sorted(found, key=lambda c: c.step)


def latest(directory: str | Path) -> Path | None:
    """The newest valid checkpoint (invalid or partial ones are skipped), or None."""
    valid = [c for c in list_checkpoints(directory) if c.valid]
    return valid[-1].path if valid else None


def load(path: str | Path, model: nn.Module, optimizer: Optimizer) -> tuple[int, dict[str, Any]]:
    """Load checkpoint ``path`` into ``model`` and ``optimizer`` at the current world
    size (any); collective. Returns ``(step, extra)``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    ck = inspect(path)
    if not ck.valid:
        raise DistCheckpointError(f"cannot load checkpoint {ck.path}: {ck.reason}")
    inner = unwrap_model(model)
    model_sd, optim_sd = get_state_dict(inner, optimizer)
    try:
        # dcp_load fills the tensors of these dicts in place (resharding as needed)
        dcp_load({"model": model_sd, "optim": optim_sd}, checkpoint_id=ck.path)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        raise DistCheckpointError(
            f"cannot load checkpoint {ck.path}: {type(exc).__name__}{': ' + first if first else ''}"
        ) from None
    set_state_dict(inner, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return ck.step, read_extra(ck.path)


def load_full_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) state dict from checkpoint ``path``, in this process
    alone (no process group; e.g. ``rootopt export``). The tensors are read whole, as
    torch's own ``dcp_to_torch_save`` reads them, but only the model's: the optimizer
    state stays on disk. :class:`DistCheckpointError` when it cannot be read."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    ck = inspect(path)
    if not ck.valid:
        raise DistCheckpointError(f"cannot read checkpoint {ck.path}: {ck.reason}")
    state: dict[str, Any] = {}
    try:
        _load_state_dict(
            state,
            storage_reader=FileSystemReader(ck.path),
            planner=_EmptyStateDictLoadPlanner(keys={"model"}),  # type: ignore[no-untyped-call]
            no_dist=True,
        )
    except Exception as exc:
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        raise DistCheckpointError(
            f"cannot read checkpoint {ck.path}: {type(exc).__name__}{': ' + first if first else ''}"
        ) from None
    model = state.get("model")
    if not isinstance(model, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items()
    ):
        raise DistCheckpointError(f"cannot read checkpoint {ck.path}: it holds no model tensors")
    return model


def prune(directory: str | Path, keep_last: int) -> list[Path]:
    """Remove all but the newest ``keep_last`` valid checkpoints; only directories that
    this module wrote (name pattern and marker) are ever removed. Rank 0 only."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    if world().rank != 0:
        return []
    valid = [c for c in list_checkpoints(directory) if c.valid]
    gone = [c.path for c in valid[:-keep_last]]
    for p in gone:
        shutil.rmtree(p)
    return gone
