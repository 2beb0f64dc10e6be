"""A run's preflight: check everything, then write (docs/training.md, "The run directory").

:func:`check` runs on rank 0 before the run writes anything and returns the
:class:`Preflight` (what it found and decided): it takes the run directory's
lock (and the checkpoint directory's), checks that both belong to this run, chooses the
checkpoint to resume from and checks that it fits this config and this data, and reads the
corpus it would prepare. Only a new run directory and the lock files are created on the
way, and, when the run prepares its data, the staging directory the data is prepared into
(``<run dir>/.rootopt-staging``: preparing streams the corpus through the disk, and the
data's identity is known only once it is prepared; a setting that differs from the
checkpoint's is refused before it is created). A refused launch therefore leaves another
run's directory byte-identical. :func:`commit` then does the writes, in order: stale
temporary files of this run removed, the old run moved aside
(``checkpoint.resume=restart``), ``run.json``, ``owner.json``, the staged data published
into ``<run dir>/data``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rootopt import checkpoint
from rootopt._atomic import atomic_write, own_dir
from rootopt.checkpoint import CheckpointError, CheckpointUnreadable
from rootopt.config import Config, ConfigError, to_dict
from rootopt.data import (
    CLASS_CORPORA,
    STAGING,
    TEXT_CORPORA,
    Settings,
    ShardError,
    Staged,
    data_identity,
    discard,
    identity_tokenizer,
    load_manifest,
    owned_files,
    publish,
    stage,
)
from rootopt.data import tokenizer as tokenizers
from rootopt.data.preparing import check as check_settings
from rootopt.data.shards import refuse_foreign
from rootopt.train.checkpoint import Found, Start, choose, manifest_digest
from rootopt.train.checkpoint.catalog import move_run
from rootopt.train.models import resume_key
from rootopt.train.run import directory as rundir

# Files a run writes into its log dir; `checkpoint.resume=restart` moves them aside.
RUN_OUTPUTS = rundir.RUN_OUTPUTS
# The data settings a run prepares its own corpus with (data/ in the run directory).
_PREP_KEYS = ("corpus", "seq_len", "max_bytes", "samples_per_shard", "val_fraction")
# ... and those of a text corpus, with their values before they existed
_TEXT_KEYS = {"tokenizer": tokenizers.BYTES, "text_field": "text"}


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
class Preflight:
    """What rank 0's checks found and decided: the directories, the locks held, the data
    (existing or staged), the checkpoint to start from, and what :func:`commit` writes."""

    cfg: Config
    run_dir: Path
    ckpt_dir: Path
    data_dir: Path
    run_id: str
    old_run_id: str  # the run moved aside by resume=restart ("" when none)
    locks: rundir.Locks
    manifest: dict[str, Any] | None  # None while the data is still to be published
    staged: Staged | None  # the data prepared for the run directory, to publish
    start: Start  # the checkpoint to resume from, and the damaged ones passed over
    archive: bool
    move_data: bool  # restart: the old run's prepared data goes to previous/ too
    identity: dict[str, Any]  # what the run computes (rundir.identity), kept in run.json
    write_run_file: bool

    @property
    def choice(self) -> Found | None:
        return self.start.choice

    @property
    def meta(self) -> dict[str, Any]:
        """The manifest's fields the model is built from (before the data exists)."""
        source = self.manifest if self.manifest is not None else self.staged.manifest  # type: ignore[union-attr]
        return {k: v for k, v in source.items() if k != "splits"}

    def public(self) -> dict[str, Any]:
        """What every rank needs from rank 0's checks."""
        return {
            "run_dir": str(self.run_dir),
            "ckpt_dir": str(self.ckpt_dir),
            "data_dir": str(self.data_dir),
            "run_id": self.run_id,
            "meta": self.meta,
            "choice": (self.choice.entry.kind, str(self.choice.path)) if self.choice else None,
            "prepared": self.staged is None,  # the data exists (else commit publishes it)
        }


def _not_a_file(path: Path, what: str) -> None:
    if path.exists() and not path.is_dir():
        raise ConfigError([f"{what} {str(path)!r} exists and is not a directory"])


def check(
    cfg: Config, run_dir: Path, data_path: str | None, say: Callable[[str], None]
) -> Preflight:
    """Rank 0's checks before the first write; see the module docstring. On a refusal the
    locks are released and the directories this launch created are removed again."""
    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    given = data_path or cfg.data.path
    rundir.refuse_links(run_dir, ckpt_dir, own_data=not given)
    rundir.read_run_file(run_dir)  # a foreign directory is refused before the lock file
    _not_a_file(ckpt_dir, "checkpoint.dir")
    locks = rundir.Locks()
    try:
        if given:  # read under its lock: no prepare rewrites it from here on
            locks.read(Path(given))
        manifest = load_manifest(given) if given else None
        try:
            locks.take(run_dir, "run directory", "wait for it to finish, or use another --log_dir")
            locks.take(
                ckpt_dir, "checkpoint directory", "wait for it or use another checkpoint.dir"
            )
            if not given:  # the data/ of an earlier session (see rootopt.data.locking)
                locks.read(run_dir / "data")
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
    checks = _check_locked(cfg, run_dir, ckpt_dir, given, manifest, rundir.Locks(), say)
    if checks.choice is None or checks.start.skipped:
        return
    try:
        step = int(checks.choice.state["state"]["step"])
    except (KeyError, TypeError, ValueError):
        return
    if step >= cfg.run.max_steps:
        raise AlreadyComplete(Complete(str(run_dir), checks.choice.path.name, step, why))


def _check_locked(
    cfg: Config,
    run_dir: Path,
    ckpt_dir: Path,
    given: str,
    manifest: dict[str, Any] | None,
    locks: rundir.Locks,
    say: Callable[[str], None],
) -> Preflight:
    have = rundir.read_run_file(run_dir, tuple(locks.created))
    run_id = str(have["run_id"]) if have else ""
    checkpoint.check_owner(ckpt_dir, run_id)  # a new run ("") only a directory no run owns
    start = choose(ckpt_dir, cfg.checkpoint.resume, run_id, run_dir)
    archive = cfg.checkpoint.resume == "restart" and bool(
        run_id or start.entries or _outputs(run_dir)
    )
    choice = start.choice
    before = (lambda: _same_settings(cfg, choice, run_dir)) if choice is not None else None
    data_dir, staged, move_data = data_for(cfg, run_dir, given, manifest, archive, before)
    try:
        if manifest is None and staged is None:
            manifest = load_manifest(data_dir)
        identity = data_identity(manifest) if manifest is not None else staged.identity  # type: ignore[union-attr]
        if choice is not None:
            meta = manifest if manifest is not None else staged.manifest  # type: ignore[union-attr]
            _compatible(_with_vocab(cfg, meta), choice, identity, manifest)
    except BaseException:
        if staged is not None:
            _discard(staged.dir)
        raise
    new_id = uuid.uuid4().hex if archive or not run_id else run_id
    ident = rundir.identity(cfg, given or None)
    return Preflight(
        cfg=cfg,
        run_dir=run_dir,
        ckpt_dir=ckpt_dir,
        data_dir=data_dir,
        run_id=new_id,
        old_run_id=run_id if archive else "",
        locks=locks,
        manifest=manifest,
        staged=staged,
        start=start,
        archive=archive,
        move_data=move_data,
        identity=ident,
        write_run_file=have is None
        or archive
        or have.get("data_dir") != str(data_dir.resolve())
        or have.get("log_dir") != str(run_dir.resolve())
        or have.get("identity") != json.loads(json.dumps(ident)),
    )


def _outputs(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in RUN_OUTPUTS)


def settings_of(cfg: Config) -> Settings:
    """What ``rootopt train`` prepares ``data.corpus`` with."""
    d = cfg.data
    return Settings(
        corpus=d.corpus,
        seq_len=d.seq_len,
        max_bytes=d.max_bytes,
        samples_per_shard=d.samples_per_shard,
        val_fraction=d.val_fraction,
        seed=cfg.run.seed,
        tokenizer=d.tokenizer,
        text_field=d.text_field,
    )


def _prepared_with(have: dict[str, Any], cfg: Config) -> bool:
    """Whether the run's prepared data was prepared with this config's settings."""
    d = cfg.data
    want = {**{k: getattr(d, k) for k in _PREP_KEYS}, "seed": cfg.run.seed}
    if d.corpus not in (*TEXT_CORPORA, *CLASS_CORPORA):  # a path: the manifest keeps its name
        want["corpus"] = Path(d.corpus).name
    keys = [k for k in want if not (k == "max_bytes" and have.get("task") != "lm")]
    if not all(have.get(k) == want[k] for k in keys):
        return False
    if have.get("task") != "lm":
        return True
    return have.get("text_field", "text") == d.text_field and tokenizers.matches(
        tokenizers.record_of(have), d.tokenizer
    )


def data_for(
    cfg: Config,
    run_dir: Path,
    given: str,
    manifest: dict[str, Any] | None,
    archive: bool,
    before: Callable[[], None] | None = None,
) -> tuple[Path, Staged | None, bool]:
    """Where the run's shards are, and the data staged for them when they must be prepared.

    The run's own ``data/`` is reused when it was prepared with this config's settings.
    Otherwise the corpus is prepared (:func:`rootopt.data.stage`, streaming) into the run's
    staging directory, after the checks that only read (the corpus, the tokenizer, a
    ``data/`` that is not ours, then ``before``); :func:`commit` publishes it. A corpus
    error therefore stops the run before it writes anything else, and leaves no staging
    directory behind."""
    if given:
        return Path(given), None, False
    out = run_dir / "data"
    try:
        have = load_manifest(out)
    except ValueError:
        have = None
    if have is not None and _prepared_with(have, cfg):
        return out, None, False
    settings = settings_of(cfg)
    spec = check_settings(settings)
    move = archive and out.exists()
    if not move:  # refuses a data/ that holds files it did not write
        refuse_foreign(out, [], owned_files(out))
    if before is not None:
        before()
    progress = cfg.monitoring.progress_bar
    return out, stage(settings, run_dir / STAGING, progress=progress, spec=spec), move


def _discard(staging: Path) -> None:
    with contextlib.suppress(OSError, ShardError):
        discard(staging)


def abandon(checks: Preflight | None) -> None:
    """A launch stopped after its checks, before :func:`commit`: remove the data it staged."""
    if checks is not None and checks.staged is not None:
        _discard(checks.staged.dir)
        checks.staged = None


def _prep_diff(saved_cfg: dict[str, Any], cfg: Config) -> list[str]:
    """The data preparation settings that differ from a checkpoint's config, in words."""
    d_old, d_new = saved_cfg.get("data", {}), to_dict(cfg)["data"]
    diff = [
        f"data.{k}: {d_old.get(k)!r} → {d_new[k]!r}"
        for k in ("path", *_PREP_KEYS)
        if k in d_old and d_old.get(k) != d_new[k]
    ]
    diff += [
        f"data.{k}: {d_old.get(k, default)!r} → {d_new[k]!r}"
        for k, default in _TEXT_KEYS.items()
        if d_old.get(k, default) != d_new[k]
    ]
    if saved_cfg.get("run", {}).get("seed") != cfg.run.seed:
        diff.append(f"run.seed: {saved_cfg.get('run', {}).get('seed')!r} → {cfg.run.seed!r}")
    return diff


def _other_data(name: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{name} was trained on other data ({what}); resume needs the same data: restore "
        "the setting or --data_path, or use a new --log_dir or checkpoint.resume=restart"
    )


def _other_tokenizer(name: str, old: str, new: str) -> CheckpointError:
    return CheckpointError(
        f"the tokenizer differs: {name} was trained on data tokenized by {old}, this run's "
        f"data by {new}; resume needs the same tokenizer: restore data.tokenizer or "
        "--data_path, or use a new --log_dir or checkpoint.resume=restart"
    )


def _same_settings(cfg: Config, choice: Found, run_dir: Path) -> None:
    """Before preparing the run's data again for a resume: a checkpoint trained on data
    prepared into this run directory must have been prepared with these settings (one
    line naming the difference, before anything is written)."""
    state, name = choice.state, choice.path.name
    saved_cfg, saved_data = state.get("config"), state.get("data")
    if not isinstance(saved_cfg, dict) or not isinstance(saved_data, dict):
        return  # _compatible reports it
    if saved_data.get("path") != str((run_dir / "data").resolve()):
        return  # trained on data elsewhere: compared by identity once prepared
    old = saved_cfg.get("data", {}).get("tokenizer", tokenizers.BYTES)
    if old != cfg.data.tokenizer:
        raise _other_tokenizer(name, repr(old), repr(cfg.data.tokenizer))
    diff = _prep_diff(saved_cfg, cfg)
    if diff:
        raise _other_data(name, "; ".join(diff))


def _compatible(cfg: Config, choice: Found, identity: str, manifest: dict[str, Any] | None) -> None:
    """Everything that shapes the parameters and the data must match the checkpoint;
    recomputation settings may change. A mismatch is a user error (exit 2)."""
    state, name = choice.state, choice.path.name
    try:
        saved_cfg = state["config"]
        saved_data = state["data"]
    except (KeyError, TypeError):
        raise CheckpointUnreadable(f"{name}: holds no config or data record") from None
    saved_model = resume_key(saved_cfg["model"])
    wanted = resume_key(to_dict(cfg)["model"])
    diff = [
        f"model.{k}: {saved_model.get(k)!r} → {v!r}"
        for k, v in wanted.items()
        if saved_model.get(k) != v
    ]
    if cfg.model.kind == "hf" and not diff:
        from rootopt.train.models.transformers_lm import spec_changes

        diff = [f"hf config {d}" for d in spec_changes(state.get("hf_config"), cfg.model)]
    if diff:
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
        if "identity" in saved_data:
            old, new = identity_tokenizer(str(saved_data["identity"])), identity_tokenizer(identity)
            if not tokenizers.same_record(old, new):
                raise _other_tokenizer(name, tokenizers.label(old), tokenizers.label(new))
        diff = _prep_diff(saved_cfg, cfg)
        what = "; ".join(diff) or f"shards at {saved_data.get('path')!r} → another dataset"
        raise _other_data(name, what)


def _with_vocab(cfg: Config, meta: dict[str, Any]) -> Config:
    """``cfg`` with its vocabulary resolved as the run will record it."""
    from rootopt.train.models import with_vocab

    try:
        return with_vocab(cfg, meta)
    except ValueError as exc:
        raise ConfigError([str(exc)]) from None


# --------------------------------------------------------------------------- the writes


def commit(checks: Preflight) -> dict[str, Any]:
    """Rank 0's writes after every check passed; returns the data's manifest."""
    own_data = checks.data_dir == checks.run_dir / "data"
    rundir.remove_stale(
        rundir.stale_files(checks.run_dir, checks.ckpt_dir, checks.data_dir if own_data else None)
    )
    checks.start.commit(checks.ckpt_dir)
    if checks.archive:
        _archive(checks)
    if checks.write_run_file:
        data = {
            "run_id": checks.run_id,
            "data_dir": str(checks.data_dir.resolve()),
            "log_dir": str(checks.run_dir.resolve()),
            "identity": checks.identity,
        }
        atomic_write(checks.run_dir / rundir.RUN_FILE, (json.dumps(data, indent=1) + "\n").encode())
    checkpoint.claim(checks.ckpt_dir, checks.run_id, str(checks.run_dir.resolve()))
    if checks.staged is not None:
        checks.manifest = publish(checks.staged, checks.data_dir)
        checks.staged = None
    else:  # a staging directory a killed launch of this run left
        _discard(checks.run_dir / STAGING)
    assert checks.manifest is not None
    return checks.manifest


def _archive(checks: Preflight) -> Path:
    """Move the previous run's outputs, checkpoints (and, when it is prepared again, its
    data) to ``previous/<time>-<id>/``: nothing is deleted."""
    old = checks.old_run_id or "unknown"
    previous = own_dir(checks.run_dir / "previous")
    dest = previous / f"{time.strftime('%Y%m%d-%H%M%S')}-{old[:12]}"
    n = 1
    while os.path.lexists(dest):
        dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
        n += 1
    dest.mkdir()  # new: never an existing path or a link
    # shutil.move renames an entry itself (a link stays a link, never followed) and copies
    # only across file systems (a checkpoint.dir elsewhere), links again as links
    for name in RUN_OUTPUTS:
        if os.path.lexists(checks.run_dir / name):
            shutil.move(checks.run_dir / name, dest / name)
    # this run's checkpoints; another run's (a shared checkpoint.dir) are not ours to move
    move_run(checks.ckpt_dir, checks.old_run_id, dest / "checkpoints")
    if checks.move_data and os.path.lexists(checks.run_dir / "data"):
        shutil.move(checks.run_dir / "data", dest / "data")
    return dest
