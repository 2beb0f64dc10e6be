"""Resharding checkpoints with ``torch.distributed.checkpoint`` (DCP), checked and safe.

The format a run writes at world size > 1; which checkpoint is the newest valid one, pruning
and resuming belong to the run's checkpointer (:mod:`rootopt.train.checkpoint`).

A checkpoint is a directory ``dcp-<step:08d>/`` holding DCP's files (model and optimizer
state by parameter name, sharded tensors as ``DTensor``), ``extra.pt`` (rank 0's opaque
dict: scheduler, scaler, data position, RNG; plain data, loadable with
``weights_only=True``) and ``rootopt.json``, the marker (format, step, world size at save,
and the sha256 and size of every other file). It is written into a hidden temporary
directory next to it; once the collective save has returned, each rank hashes the data
files it wrote, rank 0 gathers their checksums, hashes the rest and writes the marker last,
atomically, and renames the directory into place after every rank has
finished, so a reader sees a complete checkpoint or none. Because the optimizer state is
per parameter, created eagerly and never depends on ownership
(:class:`rootopt.distributed.DistributedROOT`), a checkpoint saved at world size N loads at
any world size M. The directory must be visible to every rank (a shared filesystem when
ranks are on several machines).

Every read goes through :func:`checked` (the marker, then every file against its sha256,
before a byte of the state is read) and :class:`CheckedReader`: DCP's ``.metadata`` is a
pickle, which torch's own reader loads with plain :mod:`pickle` (code in it runs); here it
is unpickled by :class:`MetadataUnpickler`, which admits only the metadata format's own
types, and the non-tensor values are loaded with ``torch.load(weights_only=True)``
(:class:`SafeLoadPlanner`). A checkpoint written before checksums existed (no ``files`` in
its marker) is read the same safe way; its bytes cannot be checked (docs/training.md,
"Checkpoints and resume").
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.optim import Optimizer

from rootopt._atomic import atomic_write, fsync_dir, own_dir, refuse_link
from rootopt.distributed.group import describe_failure, world
from rootopt.distributed.model import unwrap_model

FORMAT = "rootopt-dcp"
FORMAT_VERSION = 1
MARKER = "rootopt.json"
EXTRA = "extra.pt"
METADATA = ".metadata"
FILES = "files"  # the marker's {name: {"sha256": hex, "bytes": n}} of every other file
NAME = re.compile(r"^dcp-(\d{8})$")  # a checkpoint directory's name
_PARTIAL = re.compile(r"^\.dcp-\d{8}\.partial-[0-9a-f]{12}$")
# the data files DCP's FileSystemWriter names (`__<rank>_<n>.distcp`)
_DATA = re.compile(r"^__\d+_\d+\.distcp$")
_HASH_CHUNK = 1 << 22


class DistCheckpointError(ValueError):
    """A checkpoint directory that cannot be used (the message says why); ``corrupt``:
    proven damaged or incomplete (a checksum, a size, a missing file), not merely
    unreadable by this build."""

    def __init__(self, message: str, *, corrupt: bool = False) -> None:
        self.corrupt = corrupt
        super().__init__(message)


@dataclass(frozen=True)
class CheckpointInfo:
    """``valid``: complete and of this format. An invalid one is ``corrupt`` when it is
    provably damaged or incomplete (a missing or garbled marker, a missing file); otherwise
    (another format version, an I/O error) this build merely cannot read it.
    ``checksummed``: its marker lists every file's sha256 (written since checksums exist)."""

    path: Path
    step: int
    valid: bool
    reason: str = ""
    corrupt: bool = True
    meta: dict[str, Any] = field(default_factory=dict)  # the marker (rootopt.json)

    @property
    def checksummed(self) -> bool:
        return isinstance(self.meta.get(FILES), dict) and bool(self.meta[FILES])


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


def _collective(what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, a collective step of a save or load: a peer that died, a
    broken connection or a failure DCP gathered from another rank (its
    ``CheckpointException`` is a ``BaseException``, which would escape every handler)
    becomes one :class:`rootopt.distributed.CollectiveError` line naming this rank."""
    from torch.distributed.checkpoint.api import CheckpointException

    start = time.monotonic()
    try:
        return fn(*args, **kwargs)
    except (CheckpointException, RuntimeError) as exc:
        if not _active():
            raise
        raise describe_failure(what, _first_cause(exc), time.monotonic() - start) from None


def _first_cause(exc: BaseException) -> BaseException:
    """The first rank's own error inside DCP's ``CheckpointException`` (else ``exc``)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]  # (exception, stack summary) per failed rank
        if isinstance(first, tuple) and first and isinstance(first[0], BaseException):
            return first[0]
        if isinstance(first, BaseException):
            return first
    return exc


def _barrier(what: str) -> None:
    if _active():
        _collective(what, dist.barrier)


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"dcp-{step:08d}"


def file_digest(path: Path) -> tuple[str, int]:
    """sha256 (hex) and size of ``path``, read in chunks (never whole in memory)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


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

    ``meta`` (plain JSON, rank 0's) is stored in the marker next to the format, the step
    and the checksums, where listing and pruning can read it without loading ``extra.pt``.
    A failed collective (a peer died during the save) raises
    :class:`rootopt.distributed.CollectiveError`; the hidden temporary directory it leaves
    is removed by the next run that owns the directory."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be an integer >= 0, got {step!r}")
    directory = Path(directory)
    final = checkpoint_path(directory, step)
    info = world()
    plan: tuple[str, str] = ("", "")
    if info.rank == 0:
        if os.path.lexists(final):
            plan = ("", f"checkpoint {final} already exists; refusing to overwrite it")
        else:
            try:
                own_dir(directory, "checkpoint directory")
                tmp = directory / f".{final.name}.partial-{uuid.uuid4().hex[:12]}"
                tmp.mkdir()  # new: never an existing path or a link
                plan = (str(tmp), "")
            except OSError as exc:
                plan = ("", f"cannot create checkpoint {final.name} in {str(directory)!r}: {exc}")
    tmp_name, error = _broadcast(plan)
    if error:
        raise DistCheckpointError(error)
    tmp_dir = Path(tmp_name)
    inner = unwrap_model(model)
    model_sd, optim_sd = get_state_dict(inner, optimizer)
    _collective(
        f"checkpoint save ({final.name})",
        dcp_save,
        {"model": model_sd, "optim": optim_sd},
        checkpoint_id=tmp_dir,
    )
    # each rank hashes the data files it wrote (DCP names them __<rank>_<n>.distcp), so the
    # checksums cost 1/W of the checkpoint's bytes per rank; rank 0 gathers them
    mine: dict[str, dict[str, Any]] = {}
    for p in sorted(tmp_dir.glob(f"__{info.rank}_*.distcp")):
        digest, size = file_digest(p)
        mine[p.name] = {"sha256": digest, "bytes": size}
    listed: list[Any] = [mine]
    if _active():
        listed = [None] * info.world_size
        _collective(f"checkpoint checksums ({final.name})", dist.all_gather_object, listed, mine)
    if info.rank == 0:
        # dcp_save has returned on rank 0: every rank's files are written (DCP gathered
        # their write results before writing .metadata)
        buf_path = tmp_dir / EXTRA
        torch.save(dict(extra or {}), buf_path)
        with open(buf_path, "rb") as fh:
            os.fsync(fh.fileno())
        files = {name: rec for part in listed for name, rec in (part or {}).items()}
        for p in sorted(tmp_dir.iterdir()):
            if p.name not in files:  # .metadata, extra.pt, a file of another name
                digest, size = file_digest(p)
                files[p.name] = {"sha256": digest, "bytes": size}
        files = dict(sorted(files.items()))
        marker = {
            **(meta or {}),
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": step,
            "world_size": info.world_size,
            FILES: files,
        }
        atomic_write(tmp_dir / MARKER, json.dumps(marker, indent=1).encode())  # last
        fsync_dir(tmp_dir)
    # every rank's shards are on disk before the rename publishes them
    _barrier(f"checkpoint save ({final.name})")
    if info.rank == 0:
        refuse_link(final)
        os.rename(tmp_dir, final)  # never follows a link: a link there fails (ENOTDIR)
        fsync_dir(directory)
    _barrier(f"checkpoint publish ({final.name})")
    return final


def inspect(path: str | Path) -> CheckpointInfo:
    """Whether ``path`` is a complete checkpoint of this format, and its step (reads the
    marker only; :func:`verify` checks the files' bytes)."""
    path = Path(path)
    m = NAME.match(path.name)
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
    files = meta.get(FILES)
    if files is not None and not _valid_listing(files):
        return CheckpointInfo(path, step, False, f"{MARKER}: its file list is damaged", meta=meta)
    if not (path / METADATA).is_file() or not (path / EXTRA).is_file():
        return CheckpointInfo(path, step, False, "DCP metadata or extra.pt missing", meta=meta)
    return CheckpointInfo(path, step, True, meta=meta)


def _valid_listing(files: Any) -> bool:
    return (
        isinstance(files, dict)
        and {METADATA, EXTRA} <= set(files)
        and all(
            isinstance(name, str)
            and "/" not in name
            and name not in ("", ".", "..")
            and isinstance(rec, dict)
            and isinstance(rec.get("sha256"), str)
            and isinstance(rec.get("bytes"), int)
            for name, rec in files.items()
        )
    )


def verify(path: str | Path) -> CheckpointInfo:
    """:func:`inspect`, then every file listed in the marker against its size and sha256
    (the whole checkpoint is read once). Raises :class:`DistCheckpointError` (``corrupt``
    when proven damaged: a missing or truncated file, a checksum mismatch; not corrupt
    for an I/O error or another format version). A checkpoint without a file list (written
    before checksums) passes with ``checksummed`` False: only its names can be checked."""
    info = inspect(path)
    if not info.valid:
        raise DistCheckpointError(f"{info.path.name}: {info.reason}", corrupt=info.corrupt)
    if not info.checksummed:
        return info
    for name, rec in sorted(info.meta[FILES].items()):
        f = info.path / name
        try:
            if f.is_symlink():
                raise DistCheckpointError(
                    f"{info.path.name}: {name} is a symbolic link", corrupt=True
                )
            digest, size = file_digest(f)
        except FileNotFoundError:
            raise DistCheckpointError(
                f"{info.path.name}: {name} is missing (listed in {MARKER})", corrupt=True
            ) from None
        except OSError as exc:
            raise DistCheckpointError(
                f"{info.path.name}: {name} cannot be read ({exc.strerror or exc})"
            ) from None
        if size != rec["bytes"]:
            raise DistCheckpointError(
                f"{info.path.name}: {name} is {size} bytes, {MARKER} says {rec['bytes']} "
                "(truncated or rewritten)",
                corrupt=True,
            )
        if digest != rec["sha256"]:
            raise DistCheckpointError(
                f"{info.path.name}: {name} sha256 mismatch ({MARKER} {rec['sha256'][:12]}…, "
                f"file {digest[:12]}…)",
                corrupt=True,
            )
    return info


def checked(path: str | Path, *, verified: bool = False) -> CheckpointInfo:
    """The checkpoint at ``path`` after :func:`verify` (or :func:`inspect` alone when the
    caller has just verified it: ``verified``), its ``.metadata`` read safely and every
    file it names checked to be one of the checkpoint's own files."""
    return _checked(path, verified)[0]


def _checked(path: str | Path, verified: bool) -> tuple[CheckpointInfo, Metadata]:
    """:func:`checked`, and the ``.metadata`` it read (:func:`load` uses it: read once)."""
    info = verify(path) if not verified else inspect(path)
    if not info.valid:
        raise DistCheckpointError(f"{info.path.name}: {info.reason}", corrupt=info.corrupt)
    return info, read_metadata(info.path, info)


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


# --------------------------------------------------------------------------- safe reading


def _metadata_types() -> dict[tuple[str, str], Any]:
    """Every global DCP's ``.metadata`` pickle names (torch 2.x): its dataclasses, the
    file-system reader's storage record, ``torch.Size``, dtypes and layouts (by name), the
    memory-format enum and the checkpoint's path. Nothing that runs code."""
    import pathlib

    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as md

    allowed: dict[tuple[str, str], Any] = {}
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    ):
        if hasattr(md, name):
            allowed[(md.__name__, name)] = getattr(md, name)
    allowed[(fs.__name__, "_StorageInfo")] = fs._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # type: ignore[attr-defined]
    for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
        allowed[("pathlib", name)] = getattr(pathlib, name)
    allowed[("collections", "OrderedDict")] = __import__("collections").OrderedDict
    return allowed


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` admitting only the types of :func:`_metadata_types`:
    any other global (``os.system``, ``builtins.eval``, a ``__reduce__`` gadget) is refused
    before it is looked up, so unpickling cannot run code; persistent ids are refused."""

    _allowed: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        if MetadataUnpickler._allowed is None:
            MetadataUnpickler._allowed = _metadata_types()
        try:
            return MetadataUnpickler._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"{module}.{name} is not a type of the DCP metadata format"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not part of the DCP metadata format")


def read_metadata(path: Path, info: CheckpointInfo | None = None) -> Metadata:
    """``.metadata`` of checkpoint ``path``, unpickled by :class:`MetadataUnpickler` and
    checked: a :class:`Metadata` whose every storage record names one of the checkpoint's
    own data files (listed in its marker; for a checkpoint without a list, a
    ``__<rank>_<n>.distcp`` name in the directory), never a path elsewhere."""
    name = path.name
    try:
        with open(path / METADATA, "rb") as fh:
            meta = MetadataUnpickler(fh).load()
    except OSError as exc:
        raise DistCheckpointError(
            f"{name}: {METADATA} cannot be read ({exc.strerror or exc})"
        ) from None
    except (
        pickle.UnpicklingError,
        EOFError,
        AttributeError,
        ValueError,
        TypeError,
        IndexError,
        KeyError,
    ) as exc:
        raise DistCheckpointError(
            f"{name}: {METADATA} is not DCP metadata this build reads safely ({_first(exc)})",
            corrupt=True,
        ) from None
    if not isinstance(meta, Metadata) or not isinstance(meta.storage_data, dict):
        raise DistCheckpointError(f"{name}: {METADATA} holds no DCP metadata", corrupt=True)
    listed = set((info.meta.get(FILES) or {}) if info is not None else {})
    for record in meta.storage_data.values():
        rel = getattr(record, "relative_path", None)
        ok = isinstance(rel, str) and _DATA.match(rel) is not None
        ok = ok and (rel in listed if listed else (path / str(rel)).is_file())
        if not ok:
            raise DistCheckpointError(
                f"{name}: {METADATA} names {str(rel)[:60]!r}, not a data file of this checkpoint",
                corrupt=True,
            )
    return meta


def _first(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0][:120] if text else ""
    return f"{type(exc).__name__}{': ' + first if first else ''}"


class CheckedReader(FileSystemReader):
    """DCP's file-system reader with :func:`read_metadata` in place of plain ``pickle``
    (the tensors are read by torch with ``weights_only=True`` already)."""

    def __init__(self, info: CheckpointInfo) -> None:
        super().__init__(info.path)
        self._info = info

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # a rank-local metadata file: never written here
            raise DistCheckpointError(f"{self._info.path.name}: rank-local metadata is not read")
        from torch.distributed.checkpoint.metadata import StorageMeta

        meta = read_metadata(self._info.path, self._info)
        storage = getattr(meta, "storage_meta", None) or StorageMeta()
        storage.load_id = self.load_id  # as torch's reader does
        meta.storage_meta = storage
        return meta


def _safe_bytes(value: io.BytesIO) -> io.BytesIO:
    """A non-tensor value re-serialised from ``torch.load(weights_only=True)``: DCP's
    planner loads it with ``weights_only=False``, which would run code it holds."""
    try:
        obj = torch.load(value, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL (\S+)", str(exc))
        what = found.group(1) if found else "a type torch.load(weights_only=True) refuses"
        raise DistCheckpointError(
            f"a value in the checkpoint names {what}, which is not loaded (it could run code)",
            corrupt=True,
        ) from None
    out = io.BytesIO()
    torch.save(obj, out)
    out.seek(0)
    return out


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner whose non-tensor values load with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        super().load_bytes(read_item, _safe_bytes(value))


class _SafeFullPlanner(_EmptyStateDictLoadPlanner):
    """Rebuilds the whole saved state from the metadata (one process), values safely;
    with ``keys``, only those top-level entries (e.g. ``{"model"}``)."""

    def __init__(self, keys: set[str] | None = None) -> None:
        super().__init__(keys=keys)  # type: ignore[no-untyped-call]

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        super().load_bytes(read_item, _safe_bytes(value))


def read_full_state(
    path: str | Path, *, verified: bool = False, keys: set[str] | None = None
) -> dict[str, Any]:
    """The whole saved state of checkpoint ``path`` in this process, without a process
    group: ``{"model": {name: full tensor}, "optim": {...}}`` (the sharded tensors
    assembled), read through :func:`checked`; ``keys`` limits it to those entries. For
    tools that read a checkpoint outside training (e.g. an export); it holds every tensor
    it reads in memory at once."""
    # the loader torch's own dcp_to_torch_save uses: the public load() copies back only
    # the keys its input already holds, and here the input is empty
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    info = checked(path, verified=verified)
    from torch.distributed.checkpoint.api import CheckpointException

    state: dict[str, Any] = {}
    try:
        _load_state_dict(
            state,
            storage_reader=CheckedReader(info),
            planner=_SafeFullPlanner(keys),
            no_dist=True,
        )
    except (Exception, CheckpointException) as exc:
        raise _load_error(info.path, exc) from None
    return state


def _load_error(path: Path, exc: BaseException) -> DistCheckpointError:
    """One line for a failed DCP load; a refusal of ours inside it keeps its own words."""
    cause = _first_cause(exc)
    if isinstance(cause, DistCheckpointError):
        return DistCheckpointError(f"{path.name}: {cause}", corrupt=cause.corrupt)
    return DistCheckpointError(f"cannot load checkpoint {path}: {_first(cause)}")


def load(
    path: str | Path, model: nn.Module, optimizer: Optimizer, *, verified: bool = False
) -> tuple[int, dict[str, Any]]:
    """Load checkpoint ``path`` into ``model`` and ``optimizer`` at the current world
    size (any); collective. Returns ``(step, extra)``. Every file is checked against its
    sha256 first (:func:`checked`; ``verified``: the caller has just done so, e.g. rank 0
    before a resume), then read safely (:class:`CheckedReader`, :class:`SafeLoadPlanner`)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    try:
        ck, meta = _checked(path, verified)
    except DistCheckpointError as exc:
        raise DistCheckpointError(
            f"cannot load checkpoint {path}: {exc}", corrupt=exc.corrupt
        ) from None
    inner = unwrap_model(model)
    model_sd, optim_sd = get_state_dict(inner, optimizer)
    _as_saved_groups(optim_sd, meta)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        # dcp_load fills the tensors of these dicts in place (resharding as needed)
        dcp_load(
            {"model": model_sd, "optim": optim_sd},
            storage_reader=CheckedReader(ck),
            planner=SafeLoadPlanner(),
        )
    except (Exception, CheckpointException) as exc:
        raise _load_error(ck.path, exc) from None
    set_state_dict(inner, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return ck.step, read_extra(ck.path)


def _as_saved_groups(optim_sd: dict[str, Any], meta: Metadata) -> None:
    """Param-group keys added since a checkpoint was saved are not asked of it: ROOT's
    ``ns_auto`` (a group without it keeps the earlier rule for ``ns_dtype="auto"``,
    rootopt.optim._options.group_ns_dtype)."""
    from rootopt.optim._options import NS_AUTO_KEY

    saved = meta.state_dict_metadata
    for i, group in enumerate(optim_sd.get("param_groups", [])):
        if isinstance(group, dict) and f"optim.param_groups.{i}.{NS_AUTO_KEY}" not in saved:
            group.pop(NS_AUTO_KEY, None)


def load_full_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) state dict from checkpoint ``path``, in this process
    alone (no process group; ``rootopt export``): :func:`read_full_state` limited to the
    model, so the optimizer state stays on disk. :class:`DistCheckpointError` when it
    cannot be read or holds no model tensors."""
    model = read_full_state(path, keys={"model"}).get("model")
    if (
        not isinstance(model, dict)
        or not model
        or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items())
    ):
        raise DistCheckpointError(f"cannot read checkpoint {Path(path)}: it holds no model tensors")
    return model
