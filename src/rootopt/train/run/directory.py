"""The run directory: its default name, who may write into it, and its lock.

Policy (docs/training.md, "The run directory"): without ``--log_dir`` a run lives in
``runs/<name>-<key>``, where ``key`` is 8 hex digits of a sha256 over what the run computes
(:func:`identity`: the resolved config less the keys that only say how it is observed,
hosted, checkpointed or resumed, :data:`NOT_IDENTITY`, and the resolved data path). The
same command from the same working directory therefore finds the same directory again: a
rerun after Ctrl-C, a kill or ``run.max_time`` resumes, and so do the workers that
``torchrun --max-restarts`` starts again, also with another ``data.num_workers``,
``checkpoint.keep_last`` or monitoring setting. Every rank computes the name itself and
rank 0 checks that they agree. The world size is not part of the key: a checkpoint loads at
any world size (docs/distributed.md), and an elastic restart may change it. A new default
directory next to runs of the same name with other settings is announced with the keys that
differ (:func:`other_runs_note`).

A directory is this run's when it is new, empty, or holds ``run.json``; anything else is
refused before a byte is written, and so is a symbolic link at any path the run writes
(:func:`refuse_links`). A live run holds ``<run dir>/.lock`` (and ``<checkpoint dir>/.lock``)
with ``flock``; a second process is refused without touching them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rootopt import checkpoint
from rootopt._atomic import LinkError, atomic_write, is_link, own_dir
from rootopt.checkpoint import CheckpointError
from rootopt.config import Config, ConfigError, RunConfig, to_dict
from rootopt.data import STAGING, is_staging
from rootopt.data.locking import DataLock

RUN_FILE = "run.json"
# The run directory's copy of the tokenizer's files, written when a run starts, so an
# export does not depend on the data directory staying where it was.
TOKENIZER_DIR = "tokenizer"
# Files a run writes into its log dir; `checkpoint.resume=restart` moves them aside.
RUN_OUTPUTS = (
    "metrics.jsonl",
    "metrics.superseded.jsonl",
    "events.jsonl",
    "summary.json",
    "loss_curve.png",
    "tensorboard",
    "config.yaml",
    "env.json",
    "routing.txt",
    TOKENIZER_DIR,  # the tokenizer's files (rootopt export reads them)
    RUN_FILE,
)
# Every other path a run writes, appends, moves or prunes: in its log dir (its lock, the
# old runs set aside by `restart`; the data it prepares, checked when it prepares it) and
# in its checkpoint directory (its lock and owner, checkpoints set aside after a divergence
# or a failed check).
RUN_PATHS = (*RUN_OUTPUTS, checkpoint.LOCK, "previous")
CKPT_PATHS = (checkpoint.LOCK, checkpoint.OWNER, "diverged", "invalid")
_CKPT_ENTRY = re.compile(r"^(ckpt-\d{8}\.(pt|json)|dcp-\d{8})$")
# What does NOT name a run: keys that change how a run is observed, hosted, checkpointed
# or resumed, not the numbers it computes (tests/test_integrity.py trains with each one
# changed and compares the parameters bit for bit). Every other key, and so every key
# added later, is part of the identity. "*": the whole section.
NOT_IDENTITY: dict[str, tuple[str, ...]] = {
    "run": ("name", "max_time", "log_every", "eval_every", "eval_batches", "peak_tflops"),
    "distributed": (
        "init_method",
        "rank",
        "world_size",  # a checkpoint loads at any world size; an elastic restart changes it
        "timeout_s",
        "rendezvous_timeout_s",
    ),
    "data": ("num_workers", "verify_checksums"),  # workers get whole batches of indices
    "checkpoint": ("*",),
    "monitoring": ("*",),
}
# The data settings that only say how a run prepares its own corpus (unused with
# --data_path / data.path: the shards are given).
_PREP_ONLY = (
    "corpus",
    "max_bytes",
    "samples_per_shard",
    "val_fraction",
    "tokenizer",
    "text_field",
)
# Temporary files an interrupted atomic write of ours leaves in a run directory or in the
# data it prepared (rootopt._atomic: ".<name>.<random>.tmp"): of every file the run
# writes there whole (RUN_OUTPUTS: config.yaml, env.json, routing.txt, loss_curve.png,
# ...; metrics.jsonl when a resume drops the records after its checkpoint), and any in
# its tokenizer/ copy, where every file is the run's.
_STALE_RUN = re.compile(
    r"^\.(" + "|".join(re.escape(n) for n in RUN_OUTPUTS if "." in n) + r")\.[A-Za-z0-9_]+\.tmp$"
)
_STALE_TOKENIZER = re.compile(r"^\..+\.[A-Za-z0-9_]+\.tmp$")
_STALE_DATA = re.compile(r"^\.(manifest\.json|SHA256SUMS)\..+\.tmp$")
_DEFAULT_NAME = RunConfig().name


class RunDirError(CheckpointError):
    """The run directory (or the checkpoint directory) cannot be used: not writable, or a
    path that cannot be created (status 2, one line). ``errno``: the OS error's, if any."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        self.errno = errno
        super().__init__(message)


def identity(cfg: Config, data_path: str | None) -> dict[str, Any]:
    """What a run computes, as flat ``section.key -> value`` pairs (plus ``data_path``):
    the resolved config less :data:`NOT_IDENTITY`, with a device, backend or autocast
    dtype equal to what ``auto`` resolves to on this machine written as ``auto``, the
    autocast settings dropped when autocast is off, and the corpus settings dropped when
    the shards are given."""
    import torch

    data = to_dict(cfg)
    given = data_path or cfg.data.path
    where = str(Path(given).resolve()) if given else ""
    device = cfg.run.device
    cuda = torch.cuda.is_available()
    resolved_device = _device(cfg)
    if device == ("cuda" if cuda else "cpu"):
        data["run"]["device"] = "auto"
    if cfg.distributed.backend == ("nccl" if resolved_device == "cuda" else "gloo"):
        data["distributed"]["backend"] = "auto"
    if cfg.optimization.ns_dtype == _auto_ns_dtype(resolved_device):
        data["optimization"]["ns_dtype"] = "auto"
    mp = data["mixed_precision"]
    if not mp["enabled"]:
        data["mixed_precision"] = {"enabled": False}
    elif mp["dtype"] == ("fp16" if resolved_device == "cuda" else "bf16"):
        mp["dtype"] = "auto"
    data["data"].pop("path", None)  # named by data_path below, resolved
    _model_as_before(data, byte_data=cfg.data.tokenizer == "bytes")
    if given:
        for key in _PREP_ONLY:
            data["data"].pop(key, None)
    flat: dict[str, Any] = {}
    for section, values in data.items():
        skip = NOT_IDENTITY.get(section, ())
        if "*" in skip:
            continue
        for key, value in _flatten(values):
            if key.split(".")[0] not in skip:
                flat[f"{section}.{key}"] = value
    flat["data_path"] = where
    return flat


def _auto_ns_dtype(device: str) -> str:
    """What ``optimization.ns_dtype: auto`` resolves to for ROOT on ``device`` here."""
    import torch

    from rootopt.optim._options import ns_dtype_name

    return ns_dtype_name("auto", torch.device(device))


def _model_as_before(data: dict[str, Any], *, byte_data: bool) -> None:
    """The model keys added with ``model.kind=hf`` as runs named them before: no
    ``hf_config`` / ``init_from`` when empty (unused), and ``vocab_size: 0`` (the
    tokenizer's) as the earlier default 256 under ``data.tokenizer: bytes``, what byte
    tokens resolve it to (:func:`rootopt.train.models.resolve_vocab`). Given shards of
    another tokenizer are named by ``data_path``; an explicit 256 on them is refused
    before a run exists, so the two never name one run."""
    model = data["model"]
    for key in ("hf_config", "init_from"):
        if model.get(key) == "":
            model.pop(key)
    if model.get("vocab_size") == 0 and byte_data:
        model["vocab_size"] = 256


def _flatten(values: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in values.items():
        if isinstance(value, dict):
            out += _flatten(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def identity_key(cfg: Config, data_path: str | None) -> str:
    """8 hex digits naming the run a command describes (see the module docstring)."""
    text = json.dumps(identity(cfg, data_path), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


# The keys the first release left out of the key; a run directory it named is still found
# (see default_run_dir).
_LEGACY_SESSION_KEYS: tuple[tuple[str, str], ...] = (
    ("checkpoint", "resume"),
    ("run", "max_time"),
    ("distributed", "timeout_s"),
    ("distributed", "rendezvous_timeout_s"),
    ("distributed", "ddp_design"),
    ("distributed", "fsdp_design"),
    ("monitoring", "progress_bar"),
    ("monitoring", "prometheus"),
)
# Keys added later, left out of that key at the value that does what runs did before them.
_LEGACY_LATER_KEYS: dict[tuple[str, str], object] = {
    ("data", "tokenizer"): "bytes",
    ("data", "text_field"): "text",
    ("run", "peak_tflops"): 0.0,
}


# Defaults that changed since that key: (section, key) -> (today's default, the earlier one).
# A config at today's default is written with the earlier default, so the run an earlier
# version started with the same command is found again.
_LEGACY_CHANGED_DEFAULTS: dict[tuple[str, str], tuple[object, object]] = {
    ("checkpoint", "every"): (100, 1000),
}


def legacy_identity_key(cfg: Config, data_path: str | None) -> str:
    """The key earlier versions named a default run directory with (the whole config
    less a few session keys), to find such a run again after an upgrade."""
    data = to_dict(cfg)
    for section, key in _LEGACY_SESSION_KEYS:
        data[section].pop(key, None)
    for (section, key), value in _LEGACY_LATER_KEYS.items():
        if data[section].get(key) == value:
            data[section].pop(key)
    from rootopt.optim._options import EARLIER_AUTO

    if _ns_dtype_of(cfg) == EARLIER_AUTO.get(_device(cfg), "float32"):
        # before optimization.ns_dtype existed ROOT ran "auto" as it resolved then: a config
        # whose iteration dtype is that one computes what such a run computed
        data["optimization"].pop("ns_dtype")
    for (section, key), (now, before) in _LEGACY_CHANGED_DEFAULTS.items():
        if data[section].get(key) == now:
            data[section][key] = before
    # byte tokens were the only tokens: the vocabulary was always the data's 256
    _model_as_before(data, byte_data=True)
    payload = {
        "config": data,
        "data_path": str(Path(data_path).resolve()) if data_path else "",
    }
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _run_name(cfg: Config, config_path: str | None) -> str:
    if cfg.run.name != _DEFAULT_NAME:
        name = cfg.run.name
    elif config_path:
        name = Path(config_path).stem
    else:
        name = "default"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip(".-")[:40] or "run"


def default_run_dir(cfg: Config, data_path: str | None, config_path: str | None) -> Path:
    """``runs/<name>-<key>``: ``name`` is ``run.name`` when set, else the config file's
    stem, else ``default``. When that directory does not exist but the one an earlier
    version's key named does (a run directory, ``run.json``), that one is the run."""
    name = _run_name(cfg, config_path)
    path = Path("runs") / f"{name}-{identity_key(cfg, data_path)}"
    if not os.path.lexists(path):
        for key in _earlier_keys(cfg, data_path):
            old = Path("runs") / f"{name}-{key}"
            if (old / RUN_FILE).is_file() and not old.is_symlink():
                return old
    return path


def _device(cfg: Config) -> str:
    import torch

    device = cfg.run.device
    return "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"


def _ns_dtype_of(cfg: Config) -> str:
    """The iteration dtype ROOT runs with under ``cfg`` here (``auto`` resolved)."""
    value = cfg.optimization.ns_dtype
    return _auto_ns_dtype(_device(cfg)) if value == "auto" else value


def _earlier_keys(cfg: Config, data_path: str | None) -> list[str]:
    """Keys earlier versions gave a run computing what ``cfg`` computes: with the iteration
    dtype written out (before ``auto`` was the default and named as such), and the first
    release's (:func:`legacy_identity_key`)."""
    ident = identity(cfg, data_path)
    ident["optimization.ns_dtype"] = _ns_dtype_of(cfg)
    text = json.dumps(ident, sort_keys=True, default=str)
    return [hashlib.sha256(text.encode()).hexdigest()[:8], legacy_identity_key(cfg, data_path)]


def other_runs_note(
    cfg: Config, data_path: str | None, config_path: str | None, run_dir: Path
) -> str:
    """One line when ``run_dir`` (a default directory) is new while runs of the same
    name exist with another key: the closest one and the keys that differ ('' otherwise).
    Reads only."""
    if os.path.lexists(run_dir) or not run_dir.parent.is_dir():
        return ""
    name = _run_name(cfg, config_path)
    mine = identity(cfg, data_path)
    pattern = re.compile(rf"^{re.escape(name)}-[0-9a-f]{{8}}$")
    found: list[tuple[int, float, str, list[str]]] = []
    with contextlib.suppress(OSError):
        for other in run_dir.parent.iterdir():
            if not pattern.match(other.name) or other == run_dir:
                continue
            theirs = recorded_identity(other)
            if theirs is None:
                continue
            keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            if keys:
                mtime = (other / RUN_FILE).stat().st_mtime
                found.append((len(keys), -mtime, str(other), keys))
    if not found:
        return ""
    n, _, other_dir, keys = min(found)
    shown = ", ".join(keys[:6]) + (f" and {n - 6} more" if n > 6 else "")
    return (
        f"a run named {name!r} exists in {other_dir} with other settings ({shown}); this "
        f"starts a new run in {run_dir}. To continue that one, pass --log_dir {other_dir}"
    )


def recorded_identity(run_dir: Path) -> dict[str, Any] | None:
    """The identity a run recorded in its ``run.json`` (or, for a run written before it
    did, the one of its ``config.yaml``); None when neither can be read."""
    try:
        data = json.loads((run_dir / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    ident = data.get("identity")
    if isinstance(ident, dict):
        return ident
    from rootopt.config import load_config

    try:
        cfg = load_config(run_dir / "config.yaml")
    except (ConfigError, OSError):
        return None
    data_dir = str(data.get("data_dir", ""))
    own = data_dir in (
        str((run_dir / "data").resolve()),
        str(Path(str(data.get("log_dir"))) / "data"),
    )
    return identity(cfg, None if own else data_dir or None)


def refuse_links(run_dir: Path, ckpt_dir: Path, own_data: bool) -> None:
    """Refuse, reading only, a run whose directories, or any path in them that the run
    writes, appends, moves or prunes, is a symbolic link (:data:`RUN_PATHS`, the files in
    ``tokenizer/``, :data:`CKPT_PATHS`, the checkpoints). Each write also refuses or replaces a link on its
    own (:mod:`rootopt._atomic`); this check makes the refusal come before the first write."""
    from rootopt._atomic import refuse_link

    try:
        refuse_link(run_dir, "--log_dir")
        refuse_link(ckpt_dir, "checkpoint directory")
        names = [*RUN_PATHS, "data", STAGING] if own_data else RUN_PATHS
        for name in names:
            refuse_link(run_dir / name)
        tok = run_dir / "tokenizer"  # every file in it is rewritten or kept as the run's own
        if tok.is_dir():
            for p in sorted(tok.iterdir()):
                refuse_link(p)
        for name in CKPT_PATHS:
            refuse_link(ckpt_dir / name)
        if ckpt_dir.is_dir():
            for p in ckpt_dir.iterdir():
                if _CKPT_ENTRY.match(p.name) and is_link(p):
                    raise LinkError(p)
    except LinkError as exc:
        raise RunDirError(str(exc)) from None


def read_run_file(run_dir: Path, created: tuple[Path, ...] = ()) -> dict[str, Any] | None:
    """``run.json`` of ``run_dir`` (None for a new or empty directory); refuses, reading
    only, a path that is not a directory or a non-empty directory that is not a run's
    (entries in ``created``, made by this launch, do not count)."""
    if not run_dir.exists():
        if run_dir.is_symlink():
            raise ConfigError([f"--log_dir {str(run_dir)!r} is a broken symbolic link"])
        return None
    if not run_dir.is_dir():
        raise ConfigError([f"--log_dir {str(run_dir)!r} exists and is not a directory"])
    path = run_dir / RUN_FILE
    if path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            data = None
        except OSError as exc:
            raise CheckpointError(f"{str(path)!r} cannot be read ({exc.strerror or exc})") from None
        if not isinstance(data, dict) or not isinstance(data.get("run_id"), str):
            raise CheckpointError(f"{str(path)!r} is not a rootopt run file (unreadable JSON)")
        return data
    try:
        names = sorted(p.name for p in run_dir.iterdir())
    except OSError as exc:
        raise ConfigError(
            [f"--log_dir {str(run_dir)!r} cannot be listed ({exc.strerror or exc})"]
        ) from None
    made = {p.name for p in created if p.parent == run_dir}
    foreign = [
        n
        for n in names
        if n != checkpoint.LOCK
        and n not in made
        and not _STALE_RUN.match(n)
        and not (n == "checkpoints" and _only_lock(run_dir / n))
        and not (n == STAGING and is_staging(run_dir / n))  # a launch killed while preparing
    ]
    if foreign:
        raise CheckpointError(
            f"--log_dir {str(run_dir)!r} is not empty ({len(foreign)} entries, e.g. "
            f"{foreign[0]!r}) and holds no {RUN_FILE}: it is not a rootopt run directory, "
            "and nothing in it is touched; use a new or empty directory"
        )
    return None


def _only_lock(directory: Path) -> bool:
    """A checkpoint directory a launch locked before it wrote anything (killed then)."""
    try:
        return directory.is_dir() and {p.name for p in directory.iterdir()} <= {checkpoint.LOCK}
    except OSError:
        return False


@dataclass
class Locks:
    """The directory locks one run holds, and the directories it created to hold them."""

    held: list[checkpoint.DirLock] = field(default_factory=list)
    created: list[Path] = field(default_factory=list)
    committed: bool = False  # the run has written into its directories
    # the data directory the run reads, locked shared (rootopt.data.locking): no
    # `rootopt data prepare` rewrites it while the run lives
    reading: list[DataLock] = field(default_factory=list)

    def read(self, directory: Path) -> None:
        """Lock the data directory ``directory`` for reading (when it is one), or refuse
        with one line while a prepare writes it."""
        if not directory.is_dir():
            return
        lock = DataLock(directory)
        try:
            lock.shared()
        except OSError as exc:
            raise RunDirError(
                f"data directory {str(directory)!r} cannot be opened ({exc.strerror or exc})",
                exc.errno,
            ) from None
        self.reading.append(lock)

    def take(self, directory: Path, what: str, hint: str) -> None:
        """Lock ``directory`` (created when missing), or refuse with one line."""
        missing: list[Path] = []
        p = directory
        while not p.exists() and p != p.parent:
            missing.append(p)
            p = p.parent
        try:
            own_dir(directory, what)
        except LinkError as exc:
            raise RunDirError(str(exc)) from None
        except FileExistsError:
            raise RunDirError(
                f"{what} {str(directory)!r}: a part of the path exists and is not a directory"
            ) from None
        except OSError as exc:
            raise RunDirError(
                f"{what} {str(directory)!r} cannot be created ({exc.strerror or exc})", exc.errno
            ) from None
        self.created += reversed(missing)
        lock = checkpoint.DirLock(directory)
        try:
            lock.acquire()
        except checkpoint.LockHeld as exc:
            raise CheckpointError(
                f"{what} {str(directory)!r} is in use by another training process "
                f"({exc.holder}); {hint}"
            ) from None
        except LinkError as exc:
            raise RunDirError(str(exc)) from None
        except OSError as exc:
            raise RunDirError(
                f"{what} {str(directory)!r} is not writable ({exc.strerror or exc})", exc.errno
            ) from None
        self.held.append(lock)

    def release(self) -> None:
        for lock in reversed(self.held):
            lock.release()
        for reader in self.reading:
            reader.release()
        self.held, self.reading = [], []

    def abandon(self) -> None:
        """Release the locks; a launch refused before it wrote anything also removes the
        directories it created for them (a refused launch leaves no empty run directory
        behind). A lock file is unlinked only while still held: unlinked after its release,
        a process that had just locked it would share the directory with the next one."""
        if not self.committed:
            for directory in reversed(self.created):
                with contextlib.suppress(OSError):
                    ours = {checkpoint.LOCK} | {
                        c.name for c in self.created if c.parent == directory
                    }
                    if {p.name for p in directory.iterdir()} <= ours:
                        (directory / checkpoint.LOCK).unlink(missing_ok=True)
        self.release()
        if not self.committed:
            for directory in reversed(self.created):
                with contextlib.suppress(OSError):
                    directory.rmdir()
        self.created = []


def stale_files(run_dir: Path, ckpt_dir: Path, data_dir: Path | None) -> list[Path]:
    """Temporary files and directories that interrupted writes of this run left behind
    (removed at start, under the run's lock, by :func:`remove_stale`)."""
    from rootopt.distributed import checkpoint as dcp

    found: list[Path] = []
    if run_dir.is_dir():
        found += [p for p in run_dir.iterdir() if _STALE_RUN.match(p.name) and p.is_file()]
        tok = run_dir / "tokenizer"
        if tok.is_dir() and not tok.is_symlink():
            found += [p for p in tok.iterdir() if _STALE_TOKENIZER.match(p.name) and p.is_file()]
    found += checkpoint.stale_temporaries(ckpt_dir)
    found += dcp.stale_partials(ckpt_dir)
    if data_dir is not None and data_dir.is_dir():
        found += [p for p in data_dir.iterdir() if _STALE_DATA.match(p.name) and p.is_file()]
    return sorted(found)


def remove_stale(paths: list[Path]) -> None:
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)


def write_tokenizer_copy(run_dir: Path, files: dict[str, bytes]) -> None:
    """The run directory's copy of the tokenizer (:data:`TOKENIZER_DIR`), each file atomic;
    a link there is replaced, never written through or kept (the run refuses one before
    it starts: :func:`refuse_links`)."""
    d = own_dir(run_dir / TOKENIZER_DIR, parents=False)
    for name, data in files.items():
        if Path(name).name != name:
            raise ValueError(f"tokenizer file name {name!r} is not a plain file name")
        p = d / name
        if not is_link(p) and p.is_file() and p.read_bytes() == data:
            continue
        atomic_write(p, data)
