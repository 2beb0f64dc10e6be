"""A checkpoint directory as data: one listing of both formats, one "newest valid" rule,
one prune rule, and the moves that set checkpoints aside.

``ckpt-<step>.pt`` (one process, :mod:`rootopt.checkpoint`) and ``dcp-<step>/`` (world size
> 1, :mod:`rootopt.distributed.checkpoint`) share one write serial, so a run that changed its
world size is listed, resumed and pruned as one sequence. Each checkpoint's sidecar (``.pt``)
or marker (``dcp-*``) records the run that wrote it, the serial and whether it is *suspect*
(written inside a divergence episode, docs/training.md "Divergence"). A checkpoint whose
sidecar or marker cannot be read counts as the newest in either format: the search for the
newest valid one then reports it (and a resume sets it aside) instead of passing over it, and
pruning, which deletes only what a readable record names as this run's, never touches it.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rootopt import checkpoint as pt
from rootopt._atomic import own_dir
from rootopt.checkpoint import CheckpointError, CheckpointUnreadable
from rootopt.distributed import checkpoint as dcp

INVALID = "invalid"  # checkpoints a resume skipped as damaged (kept, never pruned)
DIVERGED = "diverged"  # checkpoints written inside a diverging episode
_STEP = re.compile(r"^(?:ckpt|dcp)-(\d{8})")


@dataclass(frozen=True)
class Entry:
    """One checkpoint of either format. ``meta``: its sidecar (``.pt``) or marker
    (``dcp-*``), None when it cannot be read; ``info``: a ``dcp-*``'s inspection."""

    kind: str  # "pt" | "dcp"
    path: Path
    step: int
    serial: int
    meta: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    info: dcp.CheckpointInfo | None = field(default=None, repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def run_id(self) -> str:
        """The run its record names ('' when it names none or cannot be read)."""
        return str((self.meta or {}).get("run_id", ""))

    @property
    def suspect(self) -> bool:
        return bool((self.meta or {}).get("suspect", False))

    @property
    def current(self) -> bool:
        """Its record reads and is of this build's format version."""
        if self.meta is None:
            return False
        if self.kind == "pt":
            return self.meta.get("format_version") == pt.FORMAT_VERSION
        return self.meta.get("format") == dcp.FORMAT and (
            self.meta.get("format_version") == dcp.FORMAT_VERSION
        )

    @property
    def valid(self) -> bool:
        """Complete as far as its record tells (the bytes are checked by :func:`read`)."""
        if self.kind == "pt":
            return self.current
        return self.info is not None and self.info.valid

    @property
    def reason(self) -> str:
        """Why it is not :attr:`valid` ('' when it is)."""
        if self.valid:
            return ""
        if self.info is not None:
            return self.info.reason
        return "sidecar unreadable" if self.meta is None else "another format version"


def step_of(name: str) -> int:
    """The step in a checkpoint name (``ckpt-00000040.pt``, ``dcp-00000040``), else -1."""
    m = _STEP.match(name)
    return int(m.group(1)) if m else -1


def _serial(meta: dict[str, Any] | None) -> int:
    value = (meta or {}).get("serial", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _found(directory: Path) -> list[Entry]:
    out: list[Entry] = []
    names = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    for name in names:
        path = directory / name
        if pt.NAME.match(name):
            meta = pt.sidecar(path)
            out.append(Entry("pt", path, step_of(name), _serial(meta), meta))
        elif dcp.NAME.match(name):
            info = dcp.inspect(path)
            meta = info.meta or None
            out.append(Entry("dcp", path, info.step, _serial(meta), meta, info))
    return out


def list_checkpoints(directory: str | Path) -> list[Entry]:
    """Every checkpoint of either format in ``directory``, oldest written first: by write
    serial, then step. One whose sidecar or marker cannot be read counts as the newest
    (see the module docstring); one written before serials existed, as the oldest."""
    found = _found(Path(directory))
    top = max((e.serial for e in found if e.meta is not None), default=0)
    placed = [e if e.meta is not None else _with_serial(e, top + 1) for e in found]
    return sorted(placed, key=lambda e: (e.serial, e.step, e.kind))


def _with_serial(entry: Entry, serial: int) -> Entry:
    return Entry(entry.kind, entry.path, entry.step, serial, entry.meta, entry.info)


def next_serial(directory: Path) -> int:
    return 1 + max((e.serial for e in list_checkpoints(directory)), default=0)


def run_id_of(entry: Entry) -> str:
    """The run an entry records; a ``dcp-*`` marker written before it named the run keeps
    it in ``extra.pt`` only. Without a readable record: '' (the run is unknown)."""
    if entry.run_id or entry.kind == "pt" or entry.meta is None:
        return entry.run_id
    try:
        extra = torch.load(entry.path / dcp.EXTRA, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError):
        return ""
    return str(extra.get("run_id", "")) if isinstance(extra, dict) else ""


# --------------------------------------------------------------------------- reading


@dataclass
class Found:
    """The checkpoint a search chose, read and verified."""

    entry: Entry
    state: dict[str, Any] = field(repr=False)  # .pt: the whole checkpoint; dcp: its extra.pt
    note: str = ""  # a line to print about it (a dcp-* without checksums)

    @property
    def path(self) -> Path:
        return self.entry.path


def read(entry: Entry) -> Found:
    """Verify and read one checkpoint (``.pt``: all of it; ``dcp``: every file against
    its sha256, its metadata through the safe unpickler, then ``extra.pt``).
    :class:`CheckpointError` when corrupt, :class:`CheckpointUnreadable` when this build
    cannot read it."""
    if entry.kind == "pt":
        return Found(entry, pt.load(entry.path))
    try:
        info = dcp.checked(entry.path)
        extra = dcp.read_extra(entry.path)
    except dcp.DistCheckpointError as exc:
        cls = CheckpointError if exc.corrupt else CheckpointUnreadable
        raise cls(str(exc)) from None
    note = ""
    if not info.checksummed:
        note = (
            f"{entry.name} was written before checkpoints carried checksums: its files "
            "cannot be checked for damage (it is read without running code from it)"
        )
    return Found(entry, extra, note)


def search(entries: list[Entry]) -> tuple[Found | None, list[tuple[Entry, str]]]:
    """The rule for "newest valid": the newest of ``entries`` (a listing) that verifies,
    read, and each newer one skipped as corrupt with the line that says why.

    A newer checkpoint that cannot be read for a reason other than proven corruption
    (another format version, an I/O error, a load error) raises
    :class:`CheckpointUnreadable`: resuming from an older one, or from step 0, would throw
    away the progress it may hold, and pruning might then delete it."""
    passed: list[tuple[Entry, str]] = []
    for entry in reversed(entries):
        try:
            return read(entry), passed
        except CheckpointUnreadable:
            raise
        except CheckpointError as exc:
            passed.append((entry, str(exc)))
    return None, passed


def newest_valid(directory: str | Path) -> tuple[Found | None, list[str]]:
    """:func:`search` over the checkpoints in ``directory``: the newest valid one (or None)
    and one line per newer one skipped as corrupt."""
    found, passed = search(list_checkpoints(directory))
    return found, [line for _, line in passed]


def entry_for(path: Path) -> Entry:
    """An :class:`Entry` for an explicit ``checkpoint.resume`` path."""
    for e in list_checkpoints(path.parent):
        if e.path.resolve() == path.resolve():
            return e
    kind = "dcp" if path.is_dir() else "pt"
    return Entry(kind, path, step_of(path.name), 0, {})


# --------------------------------------------------------------------------- pruning and moving


def prune(
    directory: str | Path, *, run_id: str, keep_last: int, keep: Path | None = None
) -> list[Path]:
    """Delete this run's checkpoints (both formats) beyond the newest ``keep_last`` by
    write order; return their paths. Deleted only: a checkpoint whose readable record
    (sidecar or marker, this build's format version) names ``run_id``. Never deleted:
    ``keep`` (just written), the newest one that is not suspect (the last good one while a
    divergence episode is open), another run's, and one whose record cannot be read."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    mine = [e for e in list_checkpoints(directory) if e.current and run_id_of(e) == run_id]
    good = [e for e in mine if not e.suspect]
    last_good = good[-1].path if good else None
    candidates = [e for e in mine if e.path not in (keep, last_good)]
    removed = []
    for e in candidates[: max(0, len(candidates) - (keep_last - 1))]:
        if e.kind == "pt":
            e.path.unlink(missing_ok=True)
            e.path.with_suffix(".json").unlink(missing_ok=True)
        else:
            shutil.rmtree(e.path, ignore_errors=True)
        removed.append(e.path)
    return removed


def _files(entry: Entry) -> tuple[Path, ...]:
    return (entry.path, entry.path.with_suffix(".json")) if entry.kind == "pt" else (entry.path,)


def set_aside(directory: Path, entries: list[Entry], into: str) -> list[str]:
    """Move ``entries`` into ``<directory>/<into>/`` (kept, never pruned, and out of the way
    of the step the run will write again; a name taken there gets a suffix: nothing set
    aside earlier is replaced). Returns the names moved."""
    moved = []
    for e in entries:
        if not os.path.lexists(e.path):
            continue
        dest = own_dir(directory / into)  # never a link to somewhere else
        for f in _files(e):
            if os.path.lexists(f):
                target = dest / f.name
                n = 1
                while os.path.lexists(target):
                    target = dest / f"{f.name}.{n}"
                    n += 1
                shutil.move(f, target)  # renames the entry itself: a link stays a link
        moved.append(e.name)
    return moved


def move_run(directory: Path, run_id: str, dest: Path) -> None:
    """Move the checkpoints of run ``run_id`` (and those whose run is unknown) into
    ``dest`` (created when there are any), and the directory's owner record: a run moved
    aside by ``checkpoint.resume=restart``. Another run's stay."""
    for e in list_checkpoints(directory):
        if run_id_of(e) not in (run_id, ""):
            continue
        if not dest.exists():
            dest.mkdir()
        for f in _files(e):
            if os.path.lexists(f):
                shutil.move(f, dest / f.name)
    (directory / pt.OWNER).unlink(missing_ok=True)


def good_and_suspect(directory: Path, run_id: str, upto: Path) -> tuple[str, list[str]]:
    """After resuming from ``upto``: the newest good checkpoint at or before it and the
    suspect ones written after that good one (up to ``upto``)."""
    mine = [e for e in list_checkpoints(directory) if run_id_of(e) in (run_id, "")]
    names = [e.path for e in mine]
    if upto not in names:
        return upto.name, []
    before = mine[: names.index(upto) + 1]
    good = [e for e in before if not e.suspect]
    if not good:
        return "", [e.name for e in before if e.suspect]
    g = good[-1]
    after = before[before.index(g) + 1 :]
    return g.name, [e.name for e in after if e.suspect]
