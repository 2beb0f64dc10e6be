"""The checkpoint a run starts from (``checkpoint.resume``), chosen on rank 0 before the run
writes anything (docs/training.md, "Checkpoints and resume").

``auto`` takes the newest valid checkpoint (:func:`rootopt.train.checkpoint.catalog.search`);
the damaged ones it passes over are named, and this run's are set aside into
``<checkpoint dir>/invalid/`` once every check of the launch has passed (:meth:`Start.commit`).
``never`` refuses a directory that holds checkpoints; ``restart`` starts from none (the old
run is moved aside by the run's preflight, :mod:`rootopt.train.preflight`); a path resumes
from that checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rootopt.checkpoint import NAME, CheckpointError, CheckpointUnreadable
from rootopt.train.checkpoint import catalog
from rootopt.train.checkpoint.catalog import INVALID, Entry, Found


@dataclass
class Start:
    """What the run starts from: the checkpoint chosen (rank 0 has read it), the listing it
    was chosen from, the newer ones skipped as damaged and, of those, this run's (or those
    whose run is unknown), which :meth:`commit` sets aside."""

    entries: list[Entry]
    choice: Found | None = None
    skipped: list[tuple[Entry, str]] = field(default_factory=list)
    invalid: list[Entry] = field(default_factory=list)

    @property
    def lines(self) -> list[str]:
        """One line per skipped checkpoint (without where it is kept)."""
        return [line for _, line in self.skipped]

    def report(self, directory: Path) -> list[str]:
        """What rank 0 says about the start: each skipped checkpoint, where it is kept,
        and the chosen checkpoint's note."""
        kept = directory / INVALID
        out = [
            f"skipping invalid checkpoint: {line}"
            + (f" (kept in {kept})" if entry in self.invalid else "")
            for entry, line in self.skipped
        ]
        if self.choice is not None and self.choice.note:
            out.append(f"note: {self.choice.note}")
        return out

    def commit(self, directory: Path) -> None:
        """Set the skipped checkpoints of this run aside (rank 0, after every check)."""
        if self.invalid:
            catalog.set_aside(directory, self.invalid, INVALID)


def choose(directory: Path, mode: str, run_id: str, run_dir: Path) -> Start:
    """The start ``checkpoint.resume`` (``mode``) asks for in ``directory`` for run
    ``run_id`` ('' for a new run); reads only. One line (:class:`CheckpointError`) when it
    cannot be had."""
    entries = catalog.list_checkpoints(directory)
    if mode == "never" and entries:
        raise CheckpointError(
            f"checkpoint.resume=never, but {str(directory)!r} holds {len(entries)} "
            f"checkpoint(s) (newest {entries[-1].name}); use a new --log_dir, or "
            "checkpoint.resume=restart to move the old run aside into "
            f"{str(run_dir / 'previous')!r} and start over"
        )
    if mode == "auto":
        return _newest(directory, entries, run_id)
    if mode in ("never", "restart"):
        return Start(entries)
    return Start(entries, _explicit(Path(mode)))


def _newest(directory: Path, entries: list[Entry], run_id: str) -> Start:
    try:
        found, skipped = catalog.search(entries)
    except CheckpointUnreadable as exc:
        raise CheckpointUnreadable(
            f"cannot resume: {exc}. It may hold this run's progress, so nothing was started "
            "and nothing was moved or deleted: read it with the rootopt version that wrote it "
            "or fix the storage, or move it out of the checkpoint directory to resume from an "
            "older checkpoint"
        ) from None
    if found is not None:
        saved = found.entry.run_id or str(found.state.get("run_id", ""))
        if saved and saved != run_id:  # a new run (no run.json yet) owns no checkpoint
            raise CheckpointError(
                f"{found.entry.name} in {str(directory)!r} was written by another run (run id "
                f"{saved[:12]}); point checkpoint.dir at a directory of this run"
            )
    # set aside only this run's (or those whose run is unknown); another run's stay
    invalid = [e for e, _ in skipped if catalog.run_id_of(e) in (run_id, "")]
    return Start(entries, found, skipped, invalid)


def _explicit(path: Path) -> Found:
    if path.is_file() and not path.with_suffix(".json").exists() and not NAME.match(path.name):
        raise CheckpointError(
            f"checkpoint.resume: {str(path)!r} is not a rootopt checkpoint (one is a "
            "ckpt-<step>.pt file next to its ckpt-<step>.json sidecar, or a dcp-<step> directory)"
        )
    try:
        return catalog.read(catalog.entry_for(path))
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint.resume: {exc}") from None
