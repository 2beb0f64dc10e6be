"""Preparing a corpus into shards with bounded memory, staged, then published.

:func:`stage` writes a complete dataset into a staging directory (``.rootopt-staging``,
marked as ours by ``staging.json``), streaming: (``bpe:N``) a first pass trains the
tokenizer; then the corpus is read in pieces (:func:`rootopt.data.corpora.pieces`),
tokenized in batches of about :data:`BATCH_BYTES` of text and appended to one token stream,
``tokens.bin``. The stream is cut into ``n`` blocks of ``seq_len + 1`` tokens; the blocks are
ordered by the seeded permutation :func:`rootopt.data.shards.plan_shards` uses (numpy's
``Generator.permutation``, here computed in place over ``uint32``), the first
``ceil(n · val_fraction)`` held out for validation, and each shard's blocks read back from
the stream and written, one shard in memory at a time. What grows with the corpus in
memory is the permutation, 4 bytes per block; on disk the staging directory holds the token
stream beside the shards until they are published. For byte tokens this gives exactly the
shards the in-memory reference (:func:`rootopt.data.plan`) gives.

:func:`publish` then moves the staged files into the output directory under the rules of
:func:`rootopt.data.shards.write_plan`: an interim manifest naming every file about to be
replaced or added is written first, the manifest last, so an interrupted publish leaves a
directory that training refuses as incomplete and the next prepare cleans. A staging
directory left by a killed prepare is removed by the next one (:func:`discard`, only files
of ours).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rootopt._atomic import LinkError, atomic_write, fsync_dir, own_dir, refuse_link
from rootopt.data import corpora, shards
from rootopt.data import tokenizer as tokenizers
from rootopt.data.corpora import CLASS_CORPORA, TEXT_CORPORA, CorpusError, Piece
from rootopt.data.locking import DataInUse, DataLock, held_by_live_run
from rootopt.data.shards import FORMAT, VERSION, ShardError, ShardWriteError

STAGING = ".rootopt-staging"
MARKER = "staging.json"
TOKENS = "tokens.bin"
# Text per tokenizer call: four pieces (corpora.PIECE_BYTES each) per core for the library's
# thread pool, at least 1 MiB. A batch's encodings cost about 80 bytes of memory per byte of
# text (ids as Python lists, the library's Encoding objects): ~80 MiB at 2 cores, which is
# what preparing holds besides its imports (benchmarks/bench_prepare.py).
BATCH_BYTES = max(1 << 20, 4 * corpora.PIECE_BYTES * (os.cpu_count() or 1))
# The seeds numpy and torch take alike (run.seed's range, rootopt.config.schema).
MAX_SEED = 2**63 - 1
_OURS = re.compile(r"^(staging\.json|tokens\.bin|tokenizer\.json|\..+\.tmp)$")


@dataclass(frozen=True)
class Settings:
    """What a prepared dataset is made from (the manifest records each)."""

    corpus: str
    seq_len: int = 128
    max_bytes: int = 4_000_000
    samples_per_shard: int = 2000
    val_fraction: float = 0.05
    seed: int = 0
    tokenizer: str = tokenizers.BYTES
    text_field: str = "text"


@dataclass
class Staged:
    """A complete dataset in a staging directory, not yet published."""

    dir: Path
    manifest: dict[str, Any]

    @property
    def identity(self) -> str:
        return shards.data_identity(self.manifest)

    def names(self) -> list[str]:
        """The files :func:`publish` moves: the shards and the tokenizer file."""
        out = [e["name"] for s in self.manifest["splits"].values() for e in s]
        tok = self.manifest.get("tokenizer")
        if isinstance(tok, dict) and tok.get("file"):
            out.append(str(tok["file"]))
        return out


# --------------------------------------------------------------------------- checks


def check(settings: Settings) -> tokenizers.TokenizerSpec:
    """Refuse, reading only, settings that cannot be prepared (one line)."""
    s = settings
    if isinstance(s.seed, bool) or not isinstance(s.seed, int) or not 0 <= s.seed <= MAX_SEED:
        raise CorpusError(f"seed: must be an integer in [0, 2**63 - 1] (as run.seed); got {s.seed}")
    if s.corpus in CLASS_CORPORA:
        # feature vectors, not text: a tokenizer or text field would be ignored, so refused
        for what, value, unused in (
            ("tokenizer", s.tokenizer.strip().lower(), tokenizers.BYTES),
            ("text_field", s.text_field, "text"),
        ):
            if value != unused:
                raise CorpusError(
                    f"data.{what}: {s.corpus} is a classification corpus (feature vectors, "
                    f"not text) and takes no {what}; got {str(value)[:60]!r}, leave it at "
                    f"{unused!r}"
                )
        return tokenizers.parse_spec(tokenizers.BYTES)
    spec = tokenizers.parse_spec(s.tokenizer)
    if not s.text_field:
        raise CorpusError("text_field: expected the name of the JSON field holding the text")
    corpora.check_source(s.corpus)
    return spec


# --------------------------------------------------------------------------- staging


def is_staging(path: Path) -> bool:
    """``path`` is a staging directory of ours: it holds our marker, or (a prepare killed
    before the marker was written) nothing but temporaries of it."""
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        names = [p.name for p in path.iterdir()]
        marker = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return all(n.startswith(f".{MARKER}.") and n.endswith(".tmp") for n in names)
    return (
        isinstance(marker, dict) and marker.get("format") == FORMAT and bool(marker.get("staging"))
    )


def discard(staging: Path) -> None:
    """Remove a staging directory of ours (only files we write there); refuse one that is
    not ours."""
    if not staging.exists() and not staging.is_symlink():
        return
    if not is_staging(staging):
        raise ShardError(
            f"{str(staging)!r} is in the way and was not made by rootopt data prepare; "
            "move it elsewhere"
        )
    entries = list(staging.iterdir())
    foreign = [
        p.name
        for p in entries
        if p.is_symlink()
        or not p.is_file()
        or not (_OURS.match(p.name) or shards.SAFE_NAME.match(p.name))
    ]
    if foreign:
        raise ShardError(
            f"{str(staging)!r} holds {foreign[0]!r}, which rootopt data prepare did not write; "
            "move it elsewhere"
        )
    for p in entries:
        p.unlink()
    staging.rmdir()


def _bar(progress: bool, **kw: Any) -> Any:
    from tqdm import tqdm

    # disable=None: off when stderr is not a terminal
    return tqdm(file=sys.stderr, disable=None if progress else True, leave=False, **kw)


def _batches(stream: Iterator[Piece], limit: int) -> Iterator[list[Piece]]:
    """Consecutive pieces, at most ``limit`` bytes of text per batch (or one piece)."""
    batch: list[Piece] = []
    size = 0
    for p in stream:
        n = len(p.data) + len(p.sep)
        if batch and size + n > limit:
            yield batch
            batch, size = [], 0
        batch.append(p)
        size += n
    if batch:
        yield batch


def _text_stream(s: Settings, bar: Any) -> Iterator[Piece]:
    for p in corpora.pieces(s.corpus, max_bytes=s.max_bytes, text_field=s.text_field):
        bar.update(len(p.data) + len(p.sep))
        yield p


def _progress_total(s: Settings) -> int | None:
    size = corpora.source_bytes(s.corpus)
    if s.max_bytes > 0:
        return min(size, s.max_bytes) if size is not None else s.max_bytes
    return size


def _tokenizer(spec: tokenizers.TokenizerSpec, s: Settings, progress: bool) -> Any:
    if spec.kind != "bpe":
        return tokenizers.load(spec)
    with _bar(progress, total=_progress_total(s), unit="B", unit_scale=True) as bar:
        bar.set_description(f"training {spec.spec}")
        return tokenizers.train_bpe(
            (corpora.piece_text(p) for p in _text_stream(s, bar)), spec.vocab
        )


def _start(staging: Path) -> None:
    discard(staging)  # a killed prepare's, or refused
    staging.mkdir(parents=True)
    atomic_write(
        staging / MARKER, (json.dumps({"format": FORMAT, "staging": True}) + "\n").encode()
    )


def stage(
    settings: Settings,
    staging: Path,
    *,
    progress: bool = False,
    spec: tokenizers.TokenizerSpec | None = None,
    before_write: Callable[[], None] | None = None,
) -> Staged:
    """Prepare ``settings`` into ``staging`` (see the module docstring); on any failure the
    staging directory is removed again. The first two batches are read and tokenized
    before anything is written, so an empty or too short corpus (or a bad line among its
    first MiBs) is refused with nothing written; ``bpe:N`` reads the whole corpus first.
    ``before_write`` runs then, before the first write (:func:`prepare` locks ``--out``
    there); what it raises leaves ``staging`` as it was."""
    s = settings
    spec = spec or check(s)
    if s.corpus in CLASS_CORPORA:
        return _stage_classify(s, staging, before_write)
    tok = _tokenizer(spec, s, progress)
    counter = _ByteCount(tok)
    with _bar(progress, total=_progress_total(s), unit="B", unit_scale=True) as bar:
        bar.set_description("tokenizing")
        stream = _tokenized(tok, _batches(_text_stream(s, bar), BATCH_BYTES), counter)
        head = list(itertools.islice(stream, 2))
        if len(head) < 2:  # the whole corpus
            _count(s, sum(n for n, _ in head), sum(int(ids.size) for _, ids in head))
        if before_write is not None:
            before_write()
        try:
            _start(staging)
            return _stage_text(s, tok, staging, itertools.chain(head, stream), counter, progress)
        except BaseException:
            _quietly_discard(staging)
            raise


def _quietly_discard(staging: Path) -> None:
    with contextlib.suppress(OSError, ShardError):
        discard(staging)


class _ByteCount:
    """The UTF-8 bytes of text each sample's tokens encode (a shard's ``text_bytes``, what
    bits per byte divides by: docs/monitoring.md), from the bytes each id stands for
    (:meth:`rootopt.data.tokenizer.Tokenizer.byte_lengths`). Every batch checks that its
    ids add up to the bytes of its text; one that does not (a tokenizer whose tokens are
    not fixed bytes, a literal special token in the text) turns the count off for the whole
    dataset, so that a count is exact or absent, never an estimate."""

    def __init__(self, tok: tokenizers.Tokenizer) -> None:
        self.tok, self.lengths = tok, tok.byte_lengths()

    def check(self, batch: list[Piece], ids: np.ndarray) -> None:
        if self.lengths is None or self.tok.kind == tokenizers.BYTES:  # bytes: one id, one byte
            return
        if int(self.lengths[ids].sum()) != self.tok.text_bytes(batch):
            self.lengths = None

    def of(self, sample: dict[str, Any]) -> int:
        assert self.lengths is not None
        return int(self.lengths[np.frombuffer(sample["tokens.bin"], self.tok.dtype)].sum())


def _tokenized(
    tok: tokenizers.Tokenizer, batches: Iterator[list[Piece]], counter: _ByteCount
) -> Iterator[tuple[int, np.ndarray]]:
    """``(text bytes, token ids)`` of each batch, ids in the tokenizer's storage dtype."""
    for batch in batches:
        ids = tok.pack(batch)
        if ids.dtype != tok.dtype:
            raise CorpusError(f"tokenizer returned {ids.dtype} ids, expected {tok.dtype}")
        counter.check(batch, ids)
        yield sum(len(p.data) + len(p.sep) for p in batch), ids


def _count(s: Settings, used: int, tokens: int) -> int:
    """The number of samples ``tokens`` make; refuses fewer than two."""
    n = tokens // (s.seq_len + 1)
    if n < 2:
        raise ShardError(
            f"corpus of {used} bytes ({tokens} tokens) is too small for seq_len={s.seq_len}"
        )
    return n


def _stage_text(
    s: Settings,
    tok: tokenizers.Tokenizer,
    staging: Path,
    stream: Iterator[tuple[int, np.ndarray]],
    counter: _ByteCount,
    progress: bool,
) -> Staged:
    dtype = tok.dtype
    used = tokens = 0
    path = staging / TOKENS
    with _writing(path) as fh:
        for size, ids in stream:
            fh.write(ids.tobytes())
            used += size
            tokens += int(ids.size)
            del ids
            if _TRIM is not None:
                _TRIM()
    n = _count(s, used, tokens)
    block = s.seq_len + 1
    width = block * dtype.itemsize
    meta = {
        "task": "lm",
        "corpus": s.corpus if s.corpus in TEXT_CORPORA else Path(s.corpus).name,
        "tokenizer": tok.record(),
        "vocab_size": tok.vocab_size,
        "seq_len": s.seq_len,
        "text_bytes": used,
        "max_bytes": s.max_bytes,
        "token_dtype": dtype.name,
        "tokens": tokens,
        "text_field": s.text_field,
    }
    fd = os.open(path, os.O_RDONLY)
    try:

        def sample(i: int) -> dict[str, Any]:
            return {"tokens.bin": os.pread(fd, width, i * width)}

        measure = counter.of if counter.lengths is not None else None
        manifest = _write_all(s, staging, n, sample, meta, progress, measure)
    finally:
        os.close(fd)
    text = tok.to_json()
    if text is not None:
        atomic_write(staging / tokenizers.FILE_NAME, text.encode("utf-8"))
    path.unlink()
    return Staged(staging, manifest)


class _writing:
    """An open binary file for appending; an OSError becomes :class:`ShardWriteError`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> Any:
        self.fh = _guard(lambda: open(self.path, "wb"), self.path)  # noqa: SIM115
        return self

    def write(self, data: bytes) -> None:
        _guard(lambda: self.fh.write(data), self.path)

    def __exit__(self, *exc: object) -> None:
        _guard(self.fh.close, self.path)


def _libc_trim() -> Callable[[], Any] | None:
    """glibc's ``malloc_trim``, or None where there is none."""
    import ctypes
    import ctypes.util

    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    return lambda: fn(0)


# After each batch, memory the batch freed goes back to the system: glibc keeps freed
# blocks of the library's worker threads and of the batch's bytes in its heaps, and the
# resident size then creeps up with the corpus (bytes: 255 → 239 MiB peak at 60 MB, bpe:
# 323 → 302 MiB; benchmarks/bench_prepare.py measures 20 against 200 MB).
_TRIM = _libc_trim()


def _guard(fn: Callable[[], Any], where: Path) -> Any:
    try:
        return fn()
    except OSError as exc:
        raise ShardWriteError(
            f"cannot write shards into {str(where.parent)!r}: {exc.strerror or exc} "
            f"({exc.filename or where})"
        ) from None


def _order(n: int, seed: int) -> np.ndarray:
    """``np.random.default_rng(seed).permutation(n)``, in 4 bytes per entry: the same
    Fisher-Yates shuffle over the same random draws (``permutation(int)`` shuffles an
    ``arange``)."""
    order = np.arange(n, dtype=np.uint32 if n < 1 << 32 else np.int64)
    np.random.default_rng(seed).shuffle(order)
    return order


def _write_all(
    s: Settings,
    staging: Path,
    n: int,
    sample: Callable[[int], dict[str, Any]],
    meta: dict[str, Any],
    progress: bool,
    measure: Callable[[dict[str, Any]], int] | None = None,
) -> dict[str, Any]:
    """Shuffle ``n`` samples (seeded), hold out ``val_fraction`` of them, write the shards
    into ``staging`` one at a time; return the complete manifest (as
    :func:`rootopt.data.shards.plan_shards` then ``write_plan`` would write it, and with
    ``measure`` each shard's ``text_bytes``: the sum over its samples)."""
    order = _order(n, s.seed)
    n_val = math.ceil(n * s.val_fraction) if s.val_fraction > 0 else 0
    if n - n_val < 1:
        raise ShardError(f"corpus too small: {n} samples leave nothing to train on")
    parts = {"train": order[n_val:], "val": order[:n_val]}
    per = s.samples_per_shard
    total = sum(math.ceil(len(rows) / per) for rows in parts.values())
    splits: dict[str, list[dict[str, Any]]] = {}
    with _bar(progress, total=total, unit="shard") as bar:
        bar.set_description("writing shards")
        for split, rows in parts.items():
            splits[split] = []
            for i in range(math.ceil(len(rows) / per)):
                name = f"{split}-{i:06d}.tar"
                chunk = [sample(int(j)) for j in rows[i * per : (i + 1) * per]]
                entry: dict[str, Any] = {"name": name, "samples": len(chunk)}
                entry["content"] = shards.content_digest(chunk)
                if measure is not None:
                    entry["text_bytes"] = sum(measure(x) for x in chunk)
                entry["sha256"] = _guard(
                    lambda: shards.write_shard(staging / name, split, i, chunk),  # noqa: B023
                    staging / name,
                )
                splits[split].append(entry)
                bar.update(1)
    return {
        "format": FORMAT,
        "version": VERSION,
        **meta,
        "seed": s.seed,
        "samples_per_shard": s.samples_per_shard,
        "val_fraction": s.val_fraction,
        "splits": splits,
    }


def _stage_classify(
    s: Settings, staging: Path, before_write: Callable[[], None] | None = None
) -> Staged:
    x, y, names = corpora.classification_arrays(s.corpus)
    rows = shards.classify_samples(x, y)
    meta: dict[str, Any] = {
        "task": "classify",
        "corpus": s.corpus,
        "feature_dim": int(x.shape[1]),
        "num_classes": len(names),
        "classes": names,
    }
    if before_write is not None:
        before_write()
    try:
        _start(staging)
        return Staged(staging, _write_all(s, staging, len(rows), rows.__getitem__, meta, False))
    except BaseException:
        _quietly_discard(staging)
        raise


# --------------------------------------------------------------------------- publishing


def publish(staged: Staged, out: Path, owned: Sequence[str] | None = None) -> dict[str, Any]:
    """Move a staged dataset into ``out`` (see the module docstring); ``owned`` are the
    files of a previous prepare there (:func:`rootopt.data.shards.owned_files`, computed
    again when None). Returns the manifest."""
    names = staged.names()
    owned = list(shards.owned_files(out) if owned is None else owned)
    shards.refuse_foreign(out, names, owned)
    manifest = staged.manifest
    try:
        out.mkdir(parents=True, exist_ok=True)
        interim = {"format": FORMAT, "version": VERSION, "complete": False}
        interim["files"] = sorted(set(owned) | set(names))
        atomic_write(out / "manifest.json", (json.dumps(interim) + "\n").encode())
        for name in owned:
            (out / name).unlink(missing_ok=True)
        (out / "SHA256SUMS").unlink(missing_ok=True)
        for name in names:
            shutil.move(str(staged.dir / name), str(out / name))
        discard(staged.dir)
        entries = [(e["sha256"], e["name"]) for s in manifest["splits"].values() for e in s]
        tok = manifest.get("tokenizer")
        if isinstance(tok, dict) and tok.get("file"):
            entries.append((str(tok["sha256"]), str(tok["file"])))
        lines = [f"{sha}  {name}" for sha, name in entries]
        atomic_write(out / "SHA256SUMS", ("\n".join(lines) + "\n").encode())
        fsync_dir(out)
        atomic_write(out / "manifest.json", (json.dumps(manifest, indent=1) + "\n").encode())
    except OSError as exc:
        raise ShardWriteError(
            f"cannot write shards into {str(out)!r}: {exc.strerror or exc} ({exc.filename or out})"
        ) from None
    return manifest


def prepare(settings: Settings, out: str | Path, *, progress: bool = False) -> dict[str, Any]:
    """Check (reading only), lock ``out``, stage into ``out/.rootopt-staging``, publish
    into ``out``.

    ``out`` must be missing, empty or hold a manifest of ours; only the files that manifest
    lists are replaced. It is locked (:class:`rootopt.data.locking.DataLock`) before the
    staging directory a killed prepare left is discarded: a second prepare into ``out``, a
    prepare into a directory a live run reads, and a prepare into the ``data/`` of a live
    run's directory are refused. A refused or failed prepare leaves ``out`` as it was."""
    out = Path(out)
    spec = check(settings)
    try:
        refuse_link(out, "--out")
    except LinkError as exc:
        raise ShardError(str(exc)) from None
    owned = shards.owned_files(out)  # refuses a directory that is not ours
    shards.refuse_foreign(out, [], owned)
    made = [p for p in (out, *out.parents) if not p.exists()]
    lock = DataLock(out)
    locked = []  # [True] once this prepare may write into out (locked, or no lock support)

    def lock_out() -> None:
        """Before the first write: ``out`` locked, and still ours under the lock."""
        try:
            own_dir(out, "--out")
            lock.exclusive()
            locked.append(True)
        except LinkError as exc:
            raise ShardError(str(exc)) from None
        if held_by_live_run(out.parent):
            raise DataInUse(
                f"--out {str(out)!r} is the data of the run in {str(out.parent)!r}, which is "
                "training; wait for it to end, or prepare into another directory"
            )
        owned[:] = shards.owned_files(out)  # another prepare may have published meanwhile
        shards.refuse_foreign(out, [], owned)

    try:
        staged = stage(settings, out / STAGING, progress=progress, spec=spec, before_write=lock_out)
        return publish(staged, out, owned)
    except BaseException:
        # directories this prepare created, if they are empty again; not without the lock
        # (another prepare that holds it may just have created them)
        for p in made if locked else []:
            try:
                p.rmdir()
            except OSError:
                break
        raise
    finally:
        lock.release()
