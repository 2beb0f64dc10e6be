"""WebDataset shards with a sha256 manifest; a rank/worker-aware reader that resumes exactly.

Layout of a prepared directory::

    manifest.json          format, task, seq_len, per-shard {name, sha256, samples}
    SHA256SUMS             the same checksums, ``sha256sum -c`` compatible
    train-000000.tar ...   WebDataset shards (samples: tokens.bin | x.npy + cls)
    val-000000.tar ...

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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

FORMAT = "rootopt-shards"
VERSION = 1


class ShardError(ValueError):
    """A prepared shard directory that cannot be trusted (missing, corrupt, inconsistent)."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------- writing


def _write_split(
    out: Path, split: str, samples: list[dict[str, Any]], per_shard: int
) -> list[dict[str, Any]]:
    entries = []
    for i in range(math.ceil(len(samples) / per_shard)):
        name = f"{split}-{i:06d}.tar"
        chunk = samples[i * per_shard : (i + 1) * per_shard]
        with wds.TarWriter(str(out / name)) as sink:
            for j, sample in enumerate(chunk):
                sink.write({"__key__": f"{split}{i:06d}_{j:06d}", **sample})
        entries.append({"name": name, "sha256": sha256_file(out / name), "samples": len(chunk)})
    return entries


def write_shards(
    out: str | Path,
    samples: list[dict[str, Any]],
    *,
    samples_per_shard: int,
    val_fraction: float,
    seed: int,
    meta: dict[str, Any],
) -> dict[str, Any]:
    """Shuffle ``samples`` (seeded), hold out ``val_fraction`` of them, write shards + manifest."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*list(out.glob("*.tar")), out / "manifest.json", out / "SHA256SUMS"]:
        stale.unlink(missing_ok=True)
    order = np.random.default_rng(seed).permutation(len(samples))
    n_val = math.ceil(len(samples) * val_fraction) if val_fraction > 0 else 0
    if len(samples) - n_val < 1:
        raise ShardError(f"corpus too small: {len(samples)} samples leave nothing to train on")
    val = [samples[i] for i in order[:n_val]]
    train = [samples[i] for i in order[n_val:]]
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        **meta,
        "seed": seed,
        "splits": {
            "train": _write_split(out, "train", train, samples_per_shard),
            "val": _write_split(out, "val", val, samples_per_shard),
        },
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    lines = [f"{e['sha256']}  {e['name']}" for s in manifest["splits"].values() for e in s]
    (out / "SHA256SUMS").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return manifest


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


def load_manifest(root: str | Path) -> dict[str, Any]:
    root = Path(root)
    path = root / "manifest.json"
    if not path.is_file():
        raise ShardError(
            f"{str(root)!r} holds no manifest.json; prepare it with: rootopt data prepare --out DIR"
        )
    try:
        manifest: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ShardError(f"manifest.json in {str(root)!r} is not valid JSON ({exc.msg})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ShardError(f"manifest.json in {str(root)!r} is not a {FORMAT} v{VERSION} manifest")
    if not manifest["splits"]["train"]:
        raise ShardError(f"manifest.json in {str(root)!r} lists no train shards")
    return manifest


def verify_shard(root: Path, entry: dict[str, Any]) -> None:
    path = root / entry["name"]
    if not path.is_file():
        raise ShardError(f"shard {entry['name']} is missing from {str(root)!r}")
    actual = sha256_file(path)
    if actual != entry["sha256"]:
        raise ShardError(
            f"shard {entry['name']} failed its checksum (manifest sha256 {entry['sha256'][:12]}…, "
            f"file {actual[:12]}…): the file is corrupt or was modified; re-run rootopt data prepare"
        )


def _decode(sample: dict[str, Any], task: str, seq_len: int) -> tuple[np.ndarray, int]:
    if task == "lm":
        tokens = np.frombuffer(sample["tokens.bin"], dtype=np.uint8)[: seq_len + 1]
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
        self.manifest = load_manifest(self.root)
        self.task: str = self.manifest["task"]
        self.seq_len = seq_len or int(self.manifest.get("seq_len", 0))
        if self.task == "lm" and self.seq_len > int(self.manifest["seq_len"]):
            raise ShardError(
                f"data.seq_len={self.seq_len} exceeds the shards' seq_len={self.manifest['seq_len']}; "
                "prepare them again with a larger --seq_len"
            )
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
        if self.verify and entry["name"] not in self._verified:
            verify_shard(self.root, entry)
            self._verified.add(entry["name"])
        ds = wds.WebDataset(
            [str(self.root / entry["name"])],
            shardshuffle=False,
            nodesplitter=None,
            workersplitter=None,
            empty_check=False,
        )
        items = [_decode(s, self.task, self.seq_len) for s in ds]
        if len(items) != entry["samples"]:
            raise ShardError(
                f"shard {entry['name']} holds {len(items)} samples, manifest says {entry['samples']}"
            )
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
