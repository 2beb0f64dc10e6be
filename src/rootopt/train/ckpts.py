"""A run's checkpoints in both formats, in the order they were written.

``ckpt-<step>.pt`` (one process, :mod:`rootopt.checkpoint`) and ``dcp-<step>/`` (world
size > 1, :mod:`rootopt.distributed.checkpoint`) share one write serial, so a run that changed its
world size is listed, resumed and pruned as one sequence. Each checkpoint records the run
that wrote it and whether it is *suspect* (written inside a divergence episode,
docs/training.md "Divergence").
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rootopt import checkpoint
from rootopt.checkpoint import CheckpointError, CheckpointUnreadable
from rootopt.distributed import checkpoint as dcp


@dataclass(frozen=True)
class Entry:
    kind: str  # "pt" | "dcp"
    path: Path
    step: int
    serial: int
    run_id: str  # "" when not recorded where it can be read cheaply
    suspect: bool
    current_format: bool  # this build's format version (False: never pruned)

    @property
    def name(self) -> str:
        return self.path.name


def list_all(ckpt_dir: Path) -> list[Entry]:
    """Every checkpoint of either format in ``ckpt_dir``, oldest written first.

    Order: the write serial, then the step (a checkpoint without a readable serial counts
    as the newest ``.pt`` — so resume reports it rather than skipping it silently — or, for
    ``dcp-*`` written before serials existed, as the oldest)."""
    out: list[Entry] = []
    pts = checkpoint.list_checkpoints(ckpt_dir)
    metas = {p: checkpoint.sidecar(p) for p in pts}
    top = max((_int(m.get("serial")) for m in metas.values() if m is not None), default=0)
    for p in pts:
        m = metas[p]
        step = int(p.stem.split("-")[1])
        if m is None:
            out.append(Entry("pt", p, step, top + 1, "", False, True))
        else:
            out.append(
                Entry(
                    "pt",
                    p,
                    step,
                    _int(m.get("serial")),
                    str(m.get("run_id", "")),
                    bool(m.get("suspect", False)),
                    m.get("format_version") == checkpoint.FORMAT_VERSION,
                )
            )
    for c in dcp.list_checkpoints(ckpt_dir):
        meta = c.meta
        out.append(
            Entry(
                "dcp",
                c.path,
                c.step,
                _int(meta.get("serial")),
                str(meta.get("run_id", "")),
                bool(meta.get("suspect", False)),
                c.valid or c.corrupt,
            )
        )
    return sorted(out, key=lambda e: (e.serial, e.step, e.kind))


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def next_serial(ckpt_dir: Path) -> int:
    return 1 + max((e.serial for e in list_all(ckpt_dir)), default=0)


def run_id_of(entry: Entry) -> str:
    """The run id an entry records; older ``dcp-*`` keep it in ``extra.pt`` only."""
    if entry.run_id or entry.kind == "pt":
        return entry.run_id
    try:
        extra = torch.load(entry.path / dcp.EXTRA, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError):
        return ""
    return str(extra.get("run_id", "")) if isinstance(extra, dict) else ""


@dataclass
class Found:
    entry: Entry
    state: dict[str, Any]  # .pt: the whole checkpoint; dcp: its extra.pt
    note: str = ""  # a line to print about it (a dcp-* without checksums)


def newest_readable(ckpt_dir: Path) -> tuple[Found | None, list[str], list[Entry]]:
    """The newest checkpoint that verifies, one line per newer corrupt one, and those
    corrupt ones (set aside by the run that skips them: :func:`set_aside`).

    A newer checkpoint that cannot be read for a reason other than proven corruption
    (another format version, an I/O error, a load error) raises
    :class:`CheckpointUnreadable`: resuming from an older one, or from step 0, would throw
    away the progress it may hold, and pruning might then delete it."""
    skipped: list[str] = []
    bad: list[Entry] = []
    for entry in reversed(list_all(ckpt_dir)):
        try:
            state, note = read(entry)
            return Found(entry, state, note), skipped, bad
        except CheckpointUnreadable:
            raise
        except CheckpointError as exc:
            skipped.append(str(exc))
            bad.append(entry)
    return None, skipped, bad


def read(entry: Entry) -> tuple[dict[str, Any], str]:
    """Verify and read one checkpoint (``.pt``: all of it; ``dcp``: every file against
    its sha256, its metadata through the safe unpickler, then ``extra.pt``), and a note
    ('' or the line for a ``dcp-*`` written before checksums). :class:`CheckpointError`
    when corrupt, :class:`CheckpointUnreadable` when this build cannot read it."""
    if entry.kind == "pt":
        return checkpoint.load(entry.path), ""
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
    return extra, note


INVALID = "invalid"


def set_aside(ckpt_dir: Path, entries: list[Entry]) -> list[str]:
    """Move checkpoints a resume skipped as corrupt into ``<ckpt_dir>/invalid/`` (kept,
    never pruned, and out of the way of the step the run will write again; a name taken
    there gets a suffix). Returns the names moved."""
    from rootopt._atomic import own_dir

    moved = []
    for e in entries:
        if not os.path.lexists(e.path):
            continue
        dest = own_dir(ckpt_dir / INVALID)
        for f in (e.path, e.path.with_suffix(".json")) if e.kind == "pt" else (e.path,):
            if os.path.lexists(f):
                target = dest / f.name
                n = 1
                while os.path.lexists(target):
                    target = dest / f"{f.name}.{n}"
                    n += 1
                shutil.move(f, target)
        moved.append(e.name)
    return moved


def entry_for(path: Path) -> Entry:
    """An :class:`Entry` for an explicit ``checkpoint.resume`` path."""
    for e in list_all(path.parent):
        if e.path.resolve() == path.resolve():
            return e
    kind = "dcp" if path.is_dir() else "pt"
    step = -1
    with contextlib.suppress(IndexError, ValueError):
        step = int(path.name.split("-")[1].split(".")[0])
    return Entry(kind, path, step, 0, "", False, True)


def prune(ckpt_dir: Path, *, run_id: str, keep_last: int, keep: Path) -> list[Path]:
    """Delete this run's checkpoints (both formats) beyond the newest ``keep_last`` by
    write order. Never deleted: ``keep`` (just written), the newest checkpoint that is not
    suspect (the last good one while a divergence episode is open), checkpoints of another
    run, and checkpoints this build cannot read (another format version)."""
    mine = [e for e in list_all(ckpt_dir) if e.current_format and run_id_of(e) == run_id]
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


def good_and_suspect(ckpt_dir: Path, run_id: str, upto: Path) -> tuple[str, list[str]]:
    """After resuming from ``upto``: the newest good checkpoint at or before it and the
    suspect ones written after that good one (up to ``upto``)."""
    mine = [e for e in list_all(ckpt_dir) if run_id_of(e) in (run_id, "")]
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
