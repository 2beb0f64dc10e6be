"""Check everything, then write (docs/training.md, "The run directory").

:func:`check` runs on rank 0 before the run writes anything: it takes the run directory's
lock (and the checkpoint directory's), checks that both belong to this run, chooses the
checkpoint to resume from and checks that it fits this config and this data, and reads the
corpus it would prepare. Only a new run directory and the lock files are created on the
way. A refused launch therefore leaves another run's directory byte-identical. :func:`commit`
then does the writes, in order: stale temporary files of this run removed, the old run
moved aside (``checkpoint.resume=restart``), ``run.json``, ``owner.json``, the prepared data.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rootopt import checkpoint
from rootopt._atomic import atomic_write, own_dir
from rootopt.checkpoint import CheckpointError, CheckpointUnreadable
from rootopt.config import Config, ConfigError, to_dict
from rootopt.data import (
    CLASS_CORPORA,
    TEXT_CORPORA,
    ShardPlan,
    check_target,
    data_identity,
    load_manifest,
    write_plan,
)
from rootopt.train import ckpts, rundir

# Files a run writes into its log dir; `checkpoint.resume=restart` moves them aside.
RUN_OUTPUTS = rundir.RUN_OUTPUTS
_CKPT_NAME = re.compile(r"^ckpt-\d{8}\.pt$")
# The data settings a run prepares its own corpus with (data/ in the run directory).
_PREP_KEYS = ("corpus", "seq_len", "max_bytes", "samples_per_shard", "val_fraction")


@dataclass
class Choice:
    """The checkpoint to resume from (rank 0 has read it: ``state``)."""

    kind: str  # "pt" | "dcp"
    path: Path
    state: dict[str, Any] = field(repr=False)
    note: str = ""  # a line about it (a dcp-* written before checksums)


@dataclass(frozen=True)
class Complete:
    """A run found complete without a write (its directory is read-only)."""

    run_dir: str
    checkpoint: str
    step: int
    why: str


class AlreadyComplete(Exception):
    """The run is complete and nothing can or need be written (see :class:`Complete`)."""

    def __init__(self, done: Complete) -> None:
        self.done = done
        super().__init__(f"already complete: {done.checkpoint}")


@dataclass
class Plan:
    cfg: Config
    run_dir: Path
    ckpt_dir: Path
    data_dir: Path
    run_id: str
    old_run_id: str  # the run moved aside by resume=restart ("" when none)
    locks: rundir.Locks
    manifest: dict[str, Any] | None  # None while the data is still to be prepared
    shards: ShardPlan | None  # the data to prepare into the run directory
    choice: Choice | None
    skipped: list[str]
    invalid: list[ckpts.Entry]  # the skipped ones: set aside into checkpoints/invalid/
    archive: bool
    move_data: bool  # restart: the old run's prepared data goes to previous/ too
    identity: dict[str, Any]  # what the run computes (rundir.identity), kept in run.json
    write_run_file: bool

    @property
    def meta(self) -> dict[str, Any]:
        """The manifest's fields the model is built from (before the data exists)."""
        source = self.manifest if self.manifest is not None else self.shards.manifest  # type: ignore[union-attr]
        return {k: v for k, v in source.items() if k != "splits"}

    def public(self) -> dict[str, Any]:
        """What every rank needs from rank 0's checks."""
        return {
            "run_dir": str(self.run_dir),
            "ckpt_dir": str(self.ckpt_dir),
            "data_dir": str(self.data_dir),
            "run_id": self.run_id,
            "meta": self.meta,
            "choice": (self.choice.kind, str(self.choice.path)) if self.choice else None,
            "prepared": self.shards is None,  # the data exists (else commit prepares it)
        }


def _not_a_file(path: Path, what: str) -> None:
    if path.exists() and not path.is_dir():
        raise ConfigError([f"{what} {str(path)!r} exists and is not a directory"])


def check(cfg: Config, run_dir: Path, data_path: str | None, say: Callable[[str], None]) -> Plan:
    """Rank 0's checks before the first write; see the module docstring. On a refusal the
    locks are released and the directories this launch created are removed again."""
    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    given = data_path or cfg.data.path
    rundir.refuse_links(run_dir, ckpt_dir, own_data=not given)
    rundir.read_run_file(run_dir)  # a foreign directory is refused before the lock file
    _not_a_file(ckpt_dir, "checkpoint.dir")
    manifest = load_manifest(given) if given else None
    locks = rundir.Locks()
    try:
        try:
            locks.take(run_dir, "run directory", "wait for it to finish, or use another --log_dir")
            locks.take(
                ckpt_dir, "checkpoint directory", "wait for it or use another checkpoint.dir"
            )
        except rundir.RunDirError as exc:
            if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                _complete_without_writing(cfg, run_dir, ckpt_dir, given, manifest, say, str(exc))
            raise
        return _check_locked(cfg, run_dir, ckpt_dir, given, manifest, locks, say)
    except BaseException:
        locks.abandon()
        raise


def _complete_without_writing(
    cfg: Config,
    run_dir: Path,
    ckpt_dir: Path,
    given: str,
    manifest: dict[str, Any] | None,
    say: Callable[[str], None],
    why: str,
) -> None:
    """A directory that cannot be written (a read-only file system, no permission): run
    every check of a launch, reading only, and raise :class:`AlreadyComplete` when the
    checkpoint it would resume from already holds ``run.max_steps`` (the rerun would train
    nothing). Otherwise return, and the launch is refused as not writable."""
    plan = _check_locked(cfg, run_dir, ckpt_dir, given, manifest, rundir.Locks(), say)
    if plan.choice is None or plan.skipped:
        return
    try:
        step = int(plan.choice.state["state"]["step"])
    except (KeyError, TypeError, ValueError):
        return
    if step >= cfg.run.max_steps:
        raise AlreadyComplete(Complete(str(run_dir), plan.choice.path.name, step, why))


def _check_locked(
    cfg: Config,
    run_dir: Path,
    ckpt_dir: Path,
    given: str,
    manifest: dict[str, Any] | None,
    locks: rundir.Locks,
    say: Callable[[str], None],
) -> Plan:
    have = rundir.read_run_file(run_dir, tuple(locks.created))
    run_id = str(have["run_id"]) if have else ""
    mode = cfg.checkpoint.resume
    entries = ckpts.list_all(ckpt_dir)
    if run_id:
        checkpoint.check_owner(ckpt_dir, run_id)
    else:
        _new_run_owner(ckpt_dir)
    mine = [e for e in entries if ckpts.run_id_of(e) in (run_id, "")] if run_id else entries
    if mode == "never" and entries:
        raise CheckpointError(
            f"checkpoint.resume=never, but {str(ckpt_dir)!r} holds {len(entries)} "
            f"checkpoint(s) (newest {entries[-1].name}); use a new --log_dir, or "
            "checkpoint.resume=restart to move the old run aside into "
            f"{str(run_dir / 'previous')!r} and start over"
        )
    archive = mode == "restart" and bool(run_id or mine or _outputs(run_dir))
    choice: Choice | None = None
    skipped: list[str] = []
    invalid: list[ckpts.Entry] = []
    if mode == "auto":
        found, skipped, invalid = _newest(ckpt_dir, run_id)
        if found is not None:
            choice = Choice(found.entry.kind, found.entry.path, found.state, found.note)
    elif mode not in ("never", "restart"):
        choice = _explicit(Path(mode), run_id)
    data_dir, shards, move_data = data_for(cfg, run_dir, given, manifest, archive)
    if manifest is None and shards is None:
        manifest = load_manifest(data_dir)
    identity = data_identity(manifest) if manifest is not None else shards.identity  # type: ignore[union-attr]
    if choice is not None:
        _compatible(cfg, choice, identity, manifest)
    new_id = uuid.uuid4().hex if archive or not run_id else run_id
    ident = rundir.identity(cfg, given or None)
    return Plan(
        cfg=cfg,
        run_dir=run_dir,
        ckpt_dir=ckpt_dir,
        data_dir=data_dir,
        run_id=new_id,
        old_run_id=run_id if archive else "",
        locks=locks,
        manifest=manifest,
        shards=shards,
        choice=choice,
        skipped=skipped,
        invalid=invalid,
        archive=archive,
        move_data=move_data,
        identity=ident,
        write_run_file=have is None
        or archive
        or have.get("data_dir") != str(data_dir.resolve())
        or have.get("log_dir") != str(run_dir.resolve())
        or have.get("identity") != json.loads(json.dumps(ident)),
    )


def _new_run_owner(ckpt_dir: Path) -> None:
    """A new run may use a checkpoint directory that no run owns yet."""
    have = checkpoint.owner(ckpt_dir)
    if have is not None:
        checkpoint.check_owner(ckpt_dir, "")


def _outputs(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in RUN_OUTPUTS)


def _newest(ckpt_dir: Path, run_id: str) -> tuple[ckpts.Found | None, list[str], list[ckpts.Entry]]:
    try:
        found, skipped, invalid = ckpts.newest_readable(ckpt_dir)
    except CheckpointUnreadable as exc:
        raise CheckpointUnreadable(
            f"cannot resume: {exc}. It may hold this run's progress, so nothing was started "
            "and nothing was moved or deleted: read it with the rootopt version that wrote it "
            "or fix the storage, or move it out of the checkpoint directory to resume from an "
            "older checkpoint"
        ) from None
    if found is not None:
        saved = _saved_run_id(found.entry, found.state)
        if saved and saved != run_id:  # a new run (no run.json yet) owns no checkpoint
            raise CheckpointError(
                f"{found.entry.name} in {str(ckpt_dir)!r} was written by another run (run id "
                f"{saved[:12]}); point checkpoint.dir at a directory of this run"
            )
    return found, skipped, invalid


def _saved_run_id(entry: ckpts.Entry, state: dict[str, Any]) -> str:
    return entry.run_id or str(state.get("run_id", ""))


def _explicit(path: Path, run_id: str) -> Choice:
    if (
        path.is_file()
        and not path.with_suffix(".json").exists()
        and not _CKPT_NAME.match(path.name)
    ):
        raise CheckpointError(
            f"checkpoint.resume: {str(path)!r} is not a rootopt checkpoint (one is a "
            "ckpt-<step>.pt file next to its ckpt-<step>.json sidecar, or a dcp-<step> directory)"
        )
    entry = ckpts.entry_for(path)
    try:
        state, note = ckpts.read(entry)
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint.resume: {exc}") from None
    return Choice(entry.kind, path, state, note)


def data_for(
    cfg: Config, run_dir: Path, given: str, manifest: dict[str, Any] | None, archive: bool
) -> tuple[Path, ShardPlan | None, bool]:
    """Where the run's shards are, and what to prepare (read-only: the corpus is read and
    cut in memory, so a corpus error stops the run before it writes anything)."""
    if given:
        return Path(given), None, False
    out = run_dir / "data"
    d = cfg.data
    want = {**{k: getattr(d, k) for k in _PREP_KEYS}, "seed": cfg.run.seed}
    if d.corpus not in (*TEXT_CORPORA, *CLASS_CORPORA):  # a path: the manifest keeps its name
        want["corpus"] = Path(d.corpus).name
    try:
        have = load_manifest(out)
    except ValueError:
        have = None
    if have is not None:
        keys = [k for k in want if not (k == "max_bytes" and have.get("task") != "lm")]
        if all(have.get(k) == want[k] for k in keys):
            return out, None, False
    from rootopt.data import plan as plan_data

    shards = plan_data(
        d.corpus,
        seq_len=d.seq_len,
        max_bytes=d.max_bytes,
        samples_per_shard=d.samples_per_shard,
        val_fraction=d.val_fraction,
        seed=cfg.run.seed,
    )
    move = archive and out.exists()
    if not move:
        check_target(out, shards)  # refuses a data/ that holds files it did not write
    return out, shards, move


def _compatible(
    cfg: Config, choice: Choice, identity: str, manifest: dict[str, Any] | None
) -> None:
    """Everything that shapes the parameters and the data must match the checkpoint;
    recomputation settings may change. A mismatch is a user error (exit 2)."""
    state, name = choice.state, choice.path.name
    try:
        saved_cfg = state["config"]
        saved_data = state["data"]
    except (KeyError, TypeError):
        raise CheckpointUnreadable(f"{name}: holds no config or data record") from None
    saved_model = {k: v for k, v in saved_cfg["model"].items() if k != "activation_checkpointing"}
    wanted = {k: v for k, v in to_dict(cfg)["model"].items() if k != "activation_checkpointing"}
    if saved_model != wanted:
        diff = [
            f"model.{k}: {saved_model.get(k)!r} → {v!r}"
            for k, v in wanted.items()
            if saved_model.get(k) != v
        ]
        raise CheckpointError(
            f"{name} was written for a different model ({'; '.join(diff)}); restore those "
            "settings to resume, or use a new --log_dir or checkpoint.resume=restart"
        )
    if "identity" in saved_data:
        same = saved_data["identity"] == identity
    else:  # checkpoints written before data identities: the manifest's shard list
        same = manifest is not None and saved_data.get("manifest_sha256") == manifest_digest(
            manifest
        )
    if not same:
        d_old, d_new = saved_cfg.get("data", {}), to_dict(cfg)["data"]
        diff = [
            f"data.{k}: {d_old.get(k)!r} → {d_new[k]!r}"
            for k in ("path", *_PREP_KEYS)
            if k in d_old and d_old.get(k) != d_new[k]
        ]
        if saved_cfg.get("run", {}).get("seed") != cfg.run.seed:
            diff.append(f"run.seed: {saved_cfg.get('run', {}).get('seed')!r} → {cfg.run.seed!r}")
        what = "; ".join(diff) or f"shards at {saved_data.get('path')!r} → another dataset"
        raise CheckpointError(
            f"{name} was trained on other data ({what}); resume needs the same data: restore "
            "the setting or --data_path, or use a new --log_dir or checkpoint.resume=restart"
        )


def manifest_digest(manifest: dict[str, Any]) -> str:
    """The digest checkpoints before data identities recorded (the manifest's splits)."""
    import hashlib

    return hashlib.sha256(json.dumps(manifest["splits"], sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------- the writes


def commit(plan: Plan) -> dict[str, Any]:
    """Rank 0's writes after every check passed; returns the data's manifest."""
    own_data = plan.data_dir == plan.run_dir / "data"
    rundir.remove_stale(
        rundir.stale_files(plan.run_dir, plan.ckpt_dir, plan.data_dir if own_data else None)
    )
    if plan.invalid:
        ckpts.set_aside(plan.ckpt_dir, plan.invalid, plan.old_run_id or plan.run_id)
    if plan.archive:
        _archive(plan)
    if plan.write_run_file:
        data = {
            "run_id": plan.run_id,
            "data_dir": str(plan.data_dir.resolve()),
            "log_dir": str(plan.run_dir.resolve()),
            "identity": plan.identity,
        }
        atomic_write(plan.run_dir / rundir.RUN_FILE, (json.dumps(data, indent=1) + "\n").encode())
    checkpoint.claim(plan.ckpt_dir, plan.run_id, str(plan.run_dir.resolve()))
    if plan.shards is not None:
        plan.manifest = write_plan(plan.data_dir, plan.shards)
        plan.shards = None
    assert plan.manifest is not None
    return plan.manifest


def _archive(plan: Plan) -> Path:
    """Move the previous run's outputs, checkpoints (and, when it is prepared again, its
    data) to ``previous/<time>-<id>/``: nothing is deleted."""
    old = plan.old_run_id or "unknown"
    previous = own_dir(plan.run_dir / "previous")
    dest = previous / f"{time.strftime('%Y%m%d-%H%M%S')}-{old[:12]}"
    n = 1
    while os.path.lexists(dest):
        dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
        n += 1
    dest.mkdir()  # new: never an existing path or a link
    # shutil.move renames an entry itself (a link stays a link, never followed) and copies
    # only across file systems (a checkpoint.dir elsewhere), links again as links
    for name in RUN_OUTPUTS:
        if os.path.lexists(plan.run_dir / name):
            shutil.move(plan.run_dir / name, dest / name)
    moved = dest / "checkpoints"
    for e in ckpts.list_all(plan.ckpt_dir):
        if ckpts.run_id_of(e) not in (plan.old_run_id, ""):
            continue  # another run's (a shared checkpoint.dir): not ours to move
        if not moved.exists():
            moved.mkdir()
        for f in (e.path, e.path.with_suffix(".json")) if e.kind == "pt" else (e.path,):
            if os.path.lexists(f):
                shutil.move(f, moved / f.name)
    (plan.ckpt_dir / checkpoint.OWNER).unlink(missing_ok=True)
    if plan.move_data and os.path.lexists(plan.run_dir / "data"):
        shutil.move(plan.run_dir / "data", dest / "data")
    return dest
