"""The run's data: which prepared shards it reads, checked before step 1, and its batches."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from rootopt.config import Config
from rootopt.data import ShardStream, load_manifest, make_loader, prepare, validate_data
from rootopt.train.build import ProcessInfo
from rootopt.train.state import Run


def resolve_data(cfg: Config, run_dir: Path, data_path: str | None, info: ProcessInfo) -> Path:
    """Prepared shards: ``--data_path``, else ``data.path``, else ``data.corpus`` prepared into the run dir.

    The run-dir copy is reused only when every preparation setting matches the config
    (corpus, seq_len, seed, max_bytes, samples_per_shard, val_fraction); otherwise it is
    prepared again (the directory holds only this run's own shards).
    """
    path = data_path or cfg.data.path
    if path:
        load_manifest(path)  # fail early, with the shard error, if it is not a prepared directory
        return Path(path)
    out = run_dir / "data"
    d = cfg.data
    want = {
        "corpus": d.corpus,
        "seq_len": d.seq_len,
        "seed": cfg.run.seed,
        "samples_per_shard": d.samples_per_shard,
        "val_fraction": d.val_fraction,
    }
    try:
        have = load_manifest(out)
        same = all(have.get(k) == v for k, v in want.items())
        if have.get("task") == "lm":
            same = same and have.get("max_bytes") == d.max_bytes
        if same:
            return out
    except ValueError:
        pass
    if info.is_main:
        prepare(
            d.corpus,
            out,
            seq_len=d.seq_len,
            max_bytes=d.max_bytes,
            samples_per_shard=d.samples_per_shard,
            val_fraction=d.val_fraction,
            seed=cfg.run.seed,
        )
    return out


def check_data(run: Run) -> int:
    """Every shard of every split: present, readable, sample count and (if enabled) sha256.

    Runs before step 1, so a damaged validation split stops the run before any work is done
    instead of at the final evaluation.
    """
    return validate_data(run.data_dir, checksum=run.cfg.data.verify_checksums)


def batches(run: Run) -> Iterator[dict[str, torch.Tensor]]:
    d = run.cfg.data
    stream = ShardStream(
        run.data_dir,
        "train",
        batch_size=d.batch_size,
        seq_len=d.seq_len,
        rank=run.info.rank,
        world_size=run.info.world_size,
        seed=run.cfg.run.seed,
        shuffle=d.shuffle,
        verify=d.verify_checksums,
        start_batch=run.state.batches,
        num_workers=d.num_workers,
    )
    return iter(make_loader(stream, d.num_workers))


def val_stream(run: Run) -> ShardStream | None:
    if not run.manifest["splits"].get("val"):
        return None
    return ShardStream(
        run.data_dir,
        "val",
        batch_size=run.cfg.data.batch_size,
        seq_len=run.cfg.data.seq_len,
        verify=run.cfg.data.verify_checksums,
        loop=False,
    )
