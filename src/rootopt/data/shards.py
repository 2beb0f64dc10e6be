"""WebDataset shards with a sha256 manifest; a rank/worker-aware reader that resumes exactly.

Layout of a prepared directory::

    manifest.json          format, task, seq_len, tokenizer, token_dtype,
                           per-shard {name, samples, content, text_bytes, sha256}
    SHA256SUMS             the same checksums, ``sha256sum -c`` compatible
    tokenizer.json         the tokenizer (not for byte tokens; rootopt.data.tokenizer)
    train-000000.tar ...   WebDataset shards (samples: tokens.bin | x.npy + cls)
    val-000000.tar ...

A sample's ``tokens.bin`` holds ``seq_len + 1`` token ids in the manifest's ``token_dtype``
(little-endian; ``uint8`` when the manifest predates tokenizers).

Reading order (what makes resume exact): a rank owns the train shards ``shards[rank::world]``
for every epoch; each epoch it visits them in a seeded order and, with ``shuffle``, each
shard's samples in a seeded permutation. Worker ``w`` of ``W`` data-loader workers takes
every ``W``-th of those shards and yields whole batches, so the loader's round-robin makes
batch ``n`` come from worker ``n % W``. A position is "batches consumed by this rank"; every
worker can compute from the manifest alone (no shard reads) where it must restart.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from rootopt.data import tokenizer as tokenizers

FORMAT = "rootopt-shards"
VERSION = 1


class ShardError(ValueError):
    """A prepared shard directory that cannot be trusted (missing, corrupt, inconsistent)."""


class ShardWriteError(ShardError):
    """Shards could not be written (a full or read-only disk): a runtime failure."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------- writing

# Every tar member gets the same owner, mode and time, so preparing the same corpus with the
# same settings writes byte-identical shards (a run whose prepared data was deleted prepares
# it again and resumes; the manifest's sha256s match). 2000-01-01T00:00:00Z.
TAR_MTIME = 946_684_800
TAR_USER = "rootopt"


def _field_bytes(value: Any) -> bytes:
    """A sample field as bytes, for the content digest (independent of the tar encoding)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value)
        return f"{arr.dtype.str}|{arr.shape}|".encode() + arr.tobytes()
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        return str(value).encode()
    raise ShardError(f"sample field of type {type(value).__name__} cannot be written")


def content_digest(samples: list[dict[str, Any]]) -> str:
    """sha256 over one shard's samples in order: each field's name, length and bytes."""
    h = hashlib.sha256()
    for sample in samples:
        for name in sorted(k for k in sample if not k.startswith("_")):
            blob = _field_bytes(sample[name])
            h.update(f"{name}\0{len(blob)}\0".encode())
            h.update(blob)
        h.update(b"\1")
    return h.hexdigest()


def data_identity(manifest: dict[str, Any]) -> str:
    """What a checkpoint records about its data and a resume compares: the shards' names,
    sample counts and sample contents in order (``content:<sha256>``), so a dataset prepared
    again from the same corpus and settings is the same data whatever the bytes of its tar
    files. Manifests written before content digests existed fall back to a digest of their
    shard list (``manifest:<sha256>``, names + file checksums + counts).

    A tokenizer other than byte tokens is part of the identity (kind, spec, vocabulary,
    sha256: ``...+tokenizer:<json>``), so data prepared with another tokenizer is other
    data even where the ids happen to agree; byte-token identities are unchanged from before
    tokenizers existed (old checkpoints resume)."""
    splits = manifest.get("splits", {})
    entries = [(split, e) for split in ("train", "val") for e in splits.get(split, [])]
    if entries and all(isinstance(e.get("content"), str) for _, e in entries):
        rows = [[split, e["name"], e["samples"], e["content"]] for split, e in entries]
        base = "content:" + hashlib.sha256(json.dumps(rows).encode()).hexdigest()
    else:
        base = "manifest:" + hashlib.sha256(json.dumps(splits, sort_keys=True).encode()).hexdigest()
    tok = tokenizers.identity_part(manifest)
    return f"{base}+tokenizer:{tok}" if tok else base


def identity_tokenizer(identity: str) -> dict[str, Any]:
    """The tokenizer record a :func:`data_identity` names (byte tokens when it names none)."""
    _, sep, tok = identity.partition("+tokenizer:")
    if sep:
        try:
            rec = json.loads(tok)
        except json.JSONDecodeError:
            rec = None
        if isinstance(rec, dict):
            return rec
    return tokenizers.record_of({})


@dataclass
class ShardPlan:
    """A dataset ready to write: the manifest without file checksums, and each shard's
    samples. Building one reads the corpus but writes nothing, so a run can check the data
    it is about to prepare (e.g. against its checkpoint) before touching the disk."""

    manifest: dict[str, Any]
    shards: dict[str, list[dict[str, Any]]]  # shard name -> its samples, in order

    @property
    def identity(self) -> str:
        return data_identity(self.manifest)

    def names(self) -> list[str]:
        return list(self.shards)


def plan_shards(
    samples: list[dict[str, Any]],
    *,
    samples_per_shard: int,
    val_fraction: float,
    seed: int,
    meta: dict[str, Any],
) -> ShardPlan:
    """Shuffle ``samples`` (seeded), hold out ``val_fraction`` of them, cut them into shards.

    The in-memory reference of :func:`rootopt.data.preparing.stage`, which streams (tests
    compare the two)."""
    order = np.random.default_rng(seed).permutation(len(samples))
    n_val = math.ceil(len(samples) * val_fraction) if val_fraction > 0 else 0
    if len(samples) - n_val < 1:
        raise ShardError(f"corpus too small: {len(samples)} samples leave nothing to train on")
    parts = {
        "train": [samples[i] for i in order[n_val:]],
        "val": [samples[i] for i in order[:n_val]],
    }
    shards: dict[str, list[dict[str, Any]]] = {}
    splits: dict[str, list[dict[str, Any]]] = {}
    for split, rows in parts.items():
        splits[split] = []
        for i in range(math.ceil(len(rows) / samples_per_shard)):
            name = f"{split}-{i:06d}.tar"
            chunk = rows[i * samples_per_shard : (i + 1) * samples_per_shard]
            shards[name] = chunk
            splits[split].append(
                {"name": name, "samples": len(chunk), "content": content_digest(chunk)}
            )
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        **meta,
        "seed": seed,
        "samples_per_shard": samples_per_shard,
        "val_fraction": val_fraction,
        "splits": splits,
    }
    return ShardPlan(manifest, shards)


def write_shard(path: Path, split: str, index: int, samples: list[dict[str, Any]]) -> str:
    """Write one WebDataset shard (reproducible bytes); return its sha256."""
    with wds.TarWriter(str(path), user=TAR_USER, group=TAR_USER, mtime=TAR_MTIME) as sink:
        for j, sample in enumerate(samples):
            sink.write({"__key__": f"{split}{index:06d}_{j:06d}", **sample})
    return sha256_file(path)


# What a prepare writes into its output directory (and so what it may replace there).
OUTPUT_NAME = re.compile(r"^((train|val)-\d{6}\.tar|tokenizer\.json)$")


def owned_files(out: Path) -> list[str]:
    """Files a previous prepare wrote into ``out`` (its manifest's list); refuse anything else.

    ``out`` must be missing, empty, or hold a manifest written by this module (complete or
    interrupted), or only a staging directory of ours (a prepare killed while staging): a
    command deletes only files it can prove it created (docs/data.md). Reads only.
    """
    from rootopt.data.preparing import STAGING, is_staging

    if not out.exists():
        return []
    if not out.is_dir():
        raise ShardError(f"--out {str(out)!r} exists and is not a directory")
    entries = sorted(
        p.name for p in out.iterdir() if not (p.name == STAGING and is_staging(out / STAGING))
    )
    if not entries:
        return []
    path = out / "manifest.json"
    try:
        old = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        old = None
    if not isinstance(old, dict) or old.get("format") != FORMAT:
        raise ShardError(
            f"refusing to write into {str(out)!r}: it is not empty ({len(entries)} entries, e.g. "
            f"{entries[0]!r}) and holds no manifest.json written by rootopt data prepare; "
            "use a new or empty directory"
        )
    names = old.get("files")
    if names is None:  # a complete manifest lists its shards under splits, and its tokenizer
        names = [e.get("name") for s in _dict(old.get("splits")).values() for e in _list(s)]
        tok = old.get("tokenizer")
        if isinstance(tok, dict) and tok.get("file") == tokenizers.FILE_NAME:
            names.append(tokenizers.FILE_NAME)
    return [
        n
        for n in _list(names)
        if isinstance(n, str) and (SAFE_NAME.match(n) or n == tokenizers.FILE_NAME)
    ]


def _dict(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _list(x: Any) -> list[Any]:
    return x if isinstance(x, list) else []


def refuse_foreign(out: Path, names: list[str], owned: list[str]) -> None:
    """Refuse (one line, reading only) to write into ``out`` where a file a prepare writes
    (``names``, and any name of the kind it writes) exists that the manifest there does not
    list."""
    if not out.is_dir():
        return
    ours = set(owned) | {"manifest.json", "SHA256SUMS"}
    present = sorted(
        n
        for n in {*names, *(p.name for p in out.iterdir() if OUTPUT_NAME.match(p.name))}
        if (out / n).exists() or (out / n).is_symlink()
    )
    foreign = [n for n in present if n not in ours]
    if foreign:
        raise ShardError(
            f"refusing to overwrite {foreign[0]!r} in {str(out)!r}: the existing manifest "
            "does not list it (not written by rootopt data prepare)"
        )


def lm_samples(data: bytes, seq_len: int) -> list[dict[str, Any]]:
    """Cut byte tokens into non-overlapping blocks of ``seq_len + 1`` (input + shifted target)."""
    block = seq_len + 1
    n = len(data) // block
    if n < 2:
        raise ShardError(f"corpus of {len(data)} bytes is too small for seq_len={seq_len}")
    return [{"tokens.bin": data[i * block : (i + 1) * block]} for i in range(n)]


def classify_samples(x: np.ndarray, y: np.ndarray) -> list[dict[str, Any]]:
    return [{"x.npy": x[i].astype(np.float32), "cls": int(y[i])} for i in range(len(y))]


# --------------------------------------------------------------------------- reading


SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}\.tar$")
_DTYPES = ("uint8", "uint16", "uint32")
_UINT8 = np.dtype(np.uint8)


def _manifest_problem(m: Any) -> str | None:
    """The first structural problem of a parsed manifest, or None."""
    if not isinstance(m, dict):
        return "is not a JSON object"
    if m.get("format") != FORMAT or m.get("version") != VERSION:
        if m.get("format") == FORMAT and m.get("complete") is False:
            return "is from an interrupted rootopt data prepare; run it again"
        return f"is not a {FORMAT} v{VERSION} manifest"
    if m.get("complete") is False:
        return "is from an interrupted rootopt data prepare; run it again"
    if m.get("task") not in ("lm", "classify"):
        return f"has task {str(m.get('task'))[:40]!r} (expected lm or classify)"
    splits = m.get("splits")
    if not isinstance(splits, dict):
        return "has no 'splits' mapping"
    seen: set[str] = set()
    for split in ("train", "val"):
        entries = splits.get(split, [])
        if not isinstance(entries, list):
            return f"splits.{split} is not a list"
        for i, e in enumerate(entries):
            where = f"splits.{split}[{i}]"
            if not isinstance(e, dict):
                return f"{where} is not an object"
            name = e.get("name")
            if not isinstance(name, str):
                return f"{where} has no 'name'"
            if not SAFE_NAME.match(name):
                return f"{where}.name {name[:60]!r} is not a plain shard file name (NAME.tar)"
            if name in seen:
                return f"{where}.name {name!r} is listed twice"
            seen.add(name)
            if not isinstance(e.get("sha256"), str):
                return f"{where} ({name}) has no 'sha256'"
            n = e.get("samples")
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                return f"{where} ({name}) has no valid 'samples' count"
            if "content" in e and not isinstance(e["content"], str):
                return f"{where} ({name}) has a 'content' digest that is not a string"
            b = e.get("text_bytes", 0)
            if isinstance(b, bool) or not isinstance(b, int) or b < 0:
                return f"{where} ({name}) has a 'text_bytes' count that is not an integer >= 0"
    if not splits.get("train"):
        return "lists no train shards"
    if m.get("token_dtype", "uint8") not in _DTYPES:
        return f"has token_dtype {str(m.get('token_dtype'))[:20]!r} (expected one of {', '.join(_DTYPES)})"
    tok = m.get("tokenizer")
    if isinstance(tok, dict):
        vocab = tok.get("vocab_size")
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            return "has a tokenizer without a valid 'vocab_size'"
        if tokenizers.token_dtype(vocab).name != m.get("token_dtype", "uint8"):
            return f"stores {m.get('token_dtype', 'uint8')} ids for a vocabulary of {vocab}"
        if tok.get("file") not in (None, tokenizers.FILE_NAME):
            return f"names tokenizer file {str(tok.get('file'))[:60]!r} (expected {tokenizers.FILE_NAME})"
        if tok.get("file") and not isinstance(tok.get("sha256"), str):
            return "lists a tokenizer file without its sha256"
    elif tok not in (None, "bytes"):
        return f"has tokenizer {str(tok)[:40]!r} (expected a tokenizer record)"
    return None


def load_manifest(root: str | Path) -> dict[str, Any]:
    root = Path(root)
    path = root / "manifest.json"
    if not path.is_file():
        if not root.exists():
            where = f"{str(root)!r} does not exist"
        elif not root.is_dir():
            where = f"{str(root)!r} is a file, not a prepared shard directory"
        else:
            where = f"{str(root)!r} holds no manifest.json"
        raise ShardError(f"{where}; prepare one with: rootopt data prepare --out DIR")
    try:
        manifest: Any = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ShardError(f"manifest.json in {str(root)!r} is not valid JSON ({exc.msg})") from None
    except UnicodeDecodeError:
        raise ShardError(f"manifest.json in {str(root)!r} is not UTF-8 text") from None
    except OSError as exc:
        raise ShardError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    problem = _manifest_problem(manifest)
    if problem:
        raise ShardError(f"manifest.json in {str(root)!r} {problem}")
    out: dict[str, Any] = manifest
    out["splits"].setdefault("val", [])
    return out


def verify_shard(root: Path, entry: dict[str, Any], *, checksum: bool = True) -> None:
    """Existence, readability and either (``checksum``) the sha256 or the sample count from
    the tar headers.

    A file whose sha256 equals the manifest's holds the bytes the prepare wrote, and so the
    samples it counted: reading every tar header as well, at every launch, would only repeat
    that."""
    path = root / entry["name"]
    if not path.is_file():
        raise ShardError(f"shard {entry['name']} is missing from {str(root)!r}")
    try:
        actual = sha256_file(path) if checksum else None
        members = None if checksum else _tar_samples(path)
    except OSError as exc:
        raise ShardError(f"shard {entry['name']} cannot be read: {exc.strerror or exc}") from None
    except tarfile.TarError as exc:
        raise ShardError(f"shard {entry['name']} is not a readable tar file ({exc})") from None
    if actual is not None and actual != entry["sha256"]:
        raise ShardError(
            f"shard {entry['name']} failed its checksum (manifest sha256 {entry['sha256'][:12]}…, "
            f"file {actual[:12]}…): the file is corrupt or was modified; re-run rootopt data prepare"
        )
    if members is not None and members != entry["samples"]:
        raise ShardError(
            f"shard {entry['name']} holds {members} samples, manifest says {entry['samples']} "
            "(truncated or modified)"
        )


def verify_tokenizer(root: Path, manifest: dict[str, Any], *, checksum: bool = True) -> None:
    """The tokenizer file a manifest lists: present and (``checksum``) its sha256."""
    tok = manifest.get("tokenizer")
    if not isinstance(tok, dict) or not tok.get("file"):
        return
    path = root / str(tok["file"])
    if not path.is_file():
        raise ShardError(
            f"{tok['file']} is missing from {str(root)!r}; re-run rootopt data prepare"
        )
    if checksum:
        try:
            actual = sha256_file(path)
        except OSError as exc:
            raise ShardError(f"{tok['file']} cannot be read: {exc.strerror or exc}") from None
        if actual != tok.get("sha256"):
            raise ShardError(
                f"{tok['file']} failed its checksum (manifest sha256 {str(tok.get('sha256'))[:12]}…, "
                f"file {actual[:12]}…): it was modified; re-run rootopt data prepare"
            )


def _tar_samples(path: Path) -> int:
    """Distinct sample keys in a WebDataset tar, from its headers only."""
    keys = set()
    with tarfile.open(path, "r:") as tf:
        for member in tf:
            if member.isfile():
                keys.add(member.name.split(".", 1)[0])
    return len(keys)


def validate_data(
    root: str | Path, *, checksum: bool, splits: tuple[str, ...] = ("train", "val")
) -> int:
    """Check every shard of ``splits`` before training starts; return how many were checked."""
    root = Path(root)
    manifest = load_manifest(root)
    verify_tokenizer(root, manifest, checksum=checksum)
    n = 0
    for split in splits:
        for entry in manifest["splits"].get(split, []):
            verify_shard(root, entry, checksum=checksum)
            n += 1
    return n


def _decode(
    sample: dict[str, Any], task: str, seq_len: int, dtype: np.dtype[Any]
) -> tuple[np.ndarray, int]:
    if task == "lm":
        tokens = np.frombuffer(sample["tokens.bin"], dtype=dtype.newbyteorder("<"))[: seq_len + 1]
        return tokens.astype(np.int64), 0
    x = np.load(io.BytesIO(sample["x.npy"]))
    return x, int(sample["cls"])


def _collate(items: list[tuple[np.ndarray, int]], task: str) -> dict[str, torch.Tensor]:
    if task == "lm":
        t = torch.from_numpy(np.stack([a for a, _ in items]))
        return {"input": t[:, :-1].contiguous(), "target": t[:, 1:].contiguous()}
    return {
        "input": torch.from_numpy(np.stack([a for a, _ in items])),
        "target": torch.tensor([b for _, b in items], dtype=torch.int64),
    }


def _open_shards(root: Path, seq_len: int) -> tuple[dict[str, Any], str, int]:
    """``(manifest, task, seq_len)`` of a shard directory; ``seq_len=0`` takes the shards'
    own, and a longer one than they were prepared with is refused with one line. The
    token dtype is ``tokenizers.dtype_of(manifest)``."""
    manifest = load_manifest(root)
    task: str = manifest["task"]
    seq_len = seq_len or int(manifest.get("seq_len", 0))
    if task == "lm" and seq_len > int(manifest["seq_len"]):
        raise ShardError(
            f"data.seq_len={seq_len} exceeds the shards' seq_len={manifest['seq_len']}; "
            "prepare them again with a larger --seq_len"
        )
    return manifest, task, seq_len


def _read_shard(
    root: Path,
    entry: dict[str, Any],
    task: str,
    seq_len: int,
    verified: set[str] | None = None,
    dtype: np.dtype[Any] = _UINT8,
) -> list[tuple[np.ndarray, int]]:
    """Every decoded sample of one shard, in file order; one line naming the shard when it
    is missing, unreadable or holds another number of samples than its manifest entry."""
    name = entry["name"]
    if verified is not None and name not in verified:  # checksum once per reader
        verify_shard(root, entry)
        verified.add(name)
    path = root / name
    if not path.is_file():
        raise ShardError(f"shard {name} is missing from {str(root)!r}")
    ds = wds.WebDataset(
        [str(path)],
        shardshuffle=False,
        nodesplitter=None,
        workersplitter=None,
        empty_check=False,
        handler=wds.reraise_exception,
    )
    try:
        items = [_decode(s, task, seq_len, dtype) for s in ds]
    except (OSError, tarfile.TarError, ValueError, KeyError) as exc:
        raise ShardError(
            f"shard {name} cannot be read ({type(exc).__name__}: {str(exc)[:120]})"
        ) from None
    if len(items) != entry["samples"]:
        raise ShardError(
            f"shard {name} holds {len(items)} samples, manifest says {entry['samples']}"
        )
    return items


@dataclass
class _Plan:
    shards: list[dict[str, Any]]  # this worker's shards for one epoch, in visiting order
    epoch: int


class ShardStream(IterableDataset[dict[str, torch.Tensor]]):
    """Batches from prepared shards for one rank; see the module docstring for the order.

    ``start_batch`` is the number of batches this rank has already consumed (the resume
    position). ``loop=False`` reads the split once, in manifest order, without shuffling
    (validation).
    """

    def __init__(
        self,
        root: str | Path,
        split: str = "train",
        *,
        batch_size: int,
        seq_len: int = 0,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        verify: bool = True,
        loop: bool = True,
        start_batch: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.root = Path(root)
        self.manifest, self.task, self.seq_len = _open_shards(self.root, seq_len)
        self.dtype = tokenizers.dtype_of(self.manifest)
        entries = self.manifest["splits"][split]
        self.shards = entries[rank::world_size] if loop else entries
        if not self.shards:
            raise ShardError(
                f"rank {rank} of {world_size} gets no {split} shards ({len(entries)} in total)"
            )
        self.split, self.batch_size, self.seed = split, batch_size, seed
        self.shuffle, self.verify, self.loop = shuffle and loop, verify, loop
        self.rank, self.world_size = rank, world_size
        self.start_batch = start_batch
        self.num_workers = max(1, num_workers)
        self._verified: set[str] = set()

    # ----- order
    def _epoch_plan(self, epoch: int, worker: int) -> _Plan:
        shards = list(self.shards)
        if self.shuffle:
            perm = np.random.default_rng([self.seed, self.rank, epoch]).permutation(len(shards))
            shards = [shards[i] for i in perm]
        return _Plan(shards[worker :: self.num_workers], epoch)

    def _samples(self, entry: dict[str, Any], epoch: int) -> list[tuple[np.ndarray, int]]:
        verified = self._verified if self.verify else None
        items = _read_shard(self.root, entry, self.task, self.seq_len, verified, self.dtype)
        if self.shuffle:
            perm = np.random.default_rng(
                [self.seed, self.rank, epoch, hash_name(entry["name"])]
            ).permutation(len(items))
            items = [items[i] for i in perm]
        return items

    def _worker_samples(self, worker: int, skip: int) -> Iterator[tuple[np.ndarray, int]]:
        """This worker's endless sample stream, starting after ``skip`` samples."""
        epoch = 0
        while True:
            plan = self._epoch_plan(epoch, worker)
            total = sum(e["samples"] for e in plan.shards)
            if total == 0:
                if not self.loop:
                    return
                raise ShardError(f"worker {worker} has no samples; use fewer data-loader workers")
            if skip >= total and self.loop:
                skip -= total
                epoch += 1
                continue
            for entry in plan.shards:
                if skip >= entry["samples"]:
                    skip -= entry["samples"]
                    continue
                items = self._samples(entry, epoch)
                yield from items[skip:]
                skip = 0
            if not self.loop:
                return
            epoch += 1

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        if info is not None and info.num_workers != self.num_workers:
            raise ShardError(
                f"ShardStream built for {self.num_workers} workers runs under {info.num_workers}"
            )
        # Global batch n belongs to stream n % W. A loader restarted at batch `start` hands its
        # task i to worker i % W, so worker w must play stream (start + w) % W, which has
        # already yielded ceil((start - stream) / W) batches.
        stream = (worker + self.start_batch) % self.num_workers
        done = max(0, -(-(self.start_batch - stream) // self.num_workers))
        batch: list[tuple[np.ndarray, int]] = []
        for item in self._worker_samples(stream, done * self.batch_size):
            batch.append(item)
            if len(batch) == self.batch_size:
                yield _collate(batch, self.task)
                batch = []
        if batch and not self.loop:
            yield _collate(batch, self.task)


class ShardSamples(Dataset[tuple[np.ndarray, int]]):
    """One split's samples by *stream position*, the same for every rank and worker.

    Position ``p`` is sample ``p mod N`` of epoch ``p // N`` (``N`` = samples in the
    split). Each epoch visits the shards in a seeded order and, with ``shuffle``, each
    shard's samples in a seeded permutation (the order :class:`ShardStream` uses for one
    process), so consecutive positions come from the same shard. The training loop cuts
    consecutive positions into global batches and those across ranks
    (:class:`rootopt.distributed.sampler.GlobalBatchSampler`, docs/distributed.md "Data"): a
    rank's part of a batch touches one or two shards. A shard is verified (``verify``) and
    decoded on first use; the last ``cache`` decoded shards stay in memory.
    """

    def __init__(
        self,
        root: str | Path,
        split: str = "train",
        *,
        seq_len: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        verify: bool = True,
        cache: int = 4,
    ) -> None:
        self.root = Path(root)
        self.manifest, self.task, self.seq_len = _open_shards(self.root, seq_len)
        self.dtype = tokenizers.dtype_of(self.manifest)
        self.entries: list[dict[str, Any]] = list(self.manifest["splits"][split])
        self.samples = sum(int(e["samples"]) for e in self.entries)
        if self.samples == 0:
            raise ShardError(f"the {split} split of {str(self.root)!r} holds no samples")
        self.seed, self.shuffle, self.verify, self.cache = seed, shuffle, verify, max(1, cache)
        self._plan: tuple[int, list[int], np.ndarray] | None = None
        self._decoded: dict[tuple[int, str], list[tuple[np.ndarray, int]]] = {}
        self._verified: set[str] = set()

    def __len__(self) -> int:
        return self.samples

    def _epoch(self, epoch: int) -> tuple[list[int], np.ndarray]:
        """Shard visiting order of ``epoch`` and the cumulative sample counts along it."""
        if self._plan is None or self._plan[0] != epoch:
            order = list(range(len(self.entries)))
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(len(order)).tolist()
            starts = np.cumsum([0] + [int(self.entries[k]["samples"]) for k in order])
            self._plan = (epoch, order, starts)
        return self._plan[1], self._plan[2]

    def _read(self, entry: dict[str, Any], epoch: int) -> list[tuple[np.ndarray, int]]:
        """The shard's samples in ``epoch``'s order (decoded once, then cached)."""
        name = entry["name"]
        items = self._decoded.pop((epoch, name), None)
        if items is None:
            verified = self._verified if self.verify else None
            items = _read_shard(self.root, entry, self.task, self.seq_len, verified, self.dtype)
            if self.shuffle:
                perm = np.random.default_rng([self.seed, epoch, hash_name(name)])
                items = [items[k] for k in perm.permutation(len(items))]
        self._decoded[(epoch, name)] = items  # most recently used last
        while len(self._decoded) > self.cache:
            self._decoded.pop(next(iter(self._decoded)))
        return items

    def __getitem__(self, position: int) -> tuple[np.ndarray, int]:
        if position < 0:
            raise IndexError(f"stream position {position} is negative")
        epoch, offset = divmod(int(position), self.samples)
        order, starts = self._epoch(epoch)
        i = int(np.searchsorted(starts, offset, side="right")) - 1
        entry = self.entries[order[i]]
        return self._read(entry, epoch)[offset - int(starts[i])]


def collate(items: list[tuple[np.ndarray, int]], task: str) -> dict[str, torch.Tensor]:
    """Stack samples from :class:`ShardSamples` into a batch (``input``/``target``)."""
    return _collate(items, task)


def hash_name(name: str) -> int:
    """A stable (process-independent) integer from a shard name."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")


def make_loader(stream: ShardStream, num_workers: int) -> DataLoader[dict[str, torch.Tensor]]:
    """A loader that preserves the stream's order (workers round-robin, batches built in workers)."""
    if num_workers and num_workers != stream.num_workers:
        raise ValueError(
            f"make_loader: num_workers={num_workers} but the stream was built for {stream.num_workers}"
        )
    return DataLoader(stream, batch_size=None, num_workers=num_workers, persistent_workers=False)
