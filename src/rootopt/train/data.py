"""The run's data: which prepared shards it reads, checked before step 1, and its batches."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from rootopt.config import Config, ConfigError
from rootopt.data import (
    ShardSamples,
    ShardStream,
    collate,
    load_manifest,
    publish,
    validate_data,
)
from rootopt.distributed.sampler import GlobalBatchSampler
from rootopt.train.build import ProcessInfo
from rootopt.train.run.state import Run


def resolve_data(cfg: Config, run_dir: Path, data_path: str | None, info: ProcessInfo) -> Path:
    """Prepared shards: ``--data_path``, else ``data.path``, else ``data.corpus`` prepared into
    ``run_dir/data`` (by rank 0, now).

    The run-dir copy is reused only when every preparation setting matches the config
    (corpus, seq_len, seed, max_bytes, samples_per_shard, val_fraction); otherwise it is
    prepared again (the directory holds only this run's own shards). ``rootopt train``
    does the same in two halves, checks before writes (:mod:`rootopt.train.preflight`).
    """
    from rootopt.train.preflight import data_for

    path = data_path or cfg.data.path
    if path:
        load_manifest(path)  # fail early, with the shard error, if it is not a prepared directory
        return Path(path)
    if not info.is_main:
        return run_dir / "data"
    out, staged, _ = data_for(cfg, run_dir, "", None, False)
    if staged is not None:
        publish(staged, out)
    return out


def check_data(run: Run) -> int:
    """Every shard of every split: present, readable, sample count and (if enabled) sha256.

    Runs before step 1, so a damaged validation split stops the run before any work is done
    instead of at the final evaluation.
    """
    return validate_data(run.data_dir, checksum=run.cfg.data.verify_checksums)


class StreamBatchSampler(GlobalBatchSampler):
    """GlobalBatchSampler over stream positions: epoch ``e`` is positions
    ``[e·N, (e+1)·N)``, which :class:`rootopt.data.ShardSamples` maps to that epoch's
    seeded shard and sample order (the shuffle lives there, keeping shard locality)."""

    def order(self, epoch: int) -> torch.Tensor:
        n = self.num_samples
        return torch.arange(epoch * n, (epoch + 1) * n)


def sampler(run: Run, samples: int) -> GlobalBatchSampler:
    """This rank's part of every global micro-batch, from the run's data position.

    ``data.batch_size`` is the global micro-batch: the same samples at micro-step ``t``
    whatever the world size, cut across ranks with no overlap and no gap
    (docs/distributed.md, "Data"). The position ``run.state.batches`` counts global
    micro-batches, so a resume at another world size continues exactly where it stopped.
    """
    d, info = run.cfg.data, run.info
    try:
        return StreamBatchSampler(
            samples,
            d.batch_size,
            rank=info.rank,
            world_size=info.world_size,
            seed=run.cfg.run.seed,
            shuffle=False,
            start_step=run.state.batches,
        )
    except ValueError as exc:
        raise ConfigError([f"data.batch_size: {exc} (batch_size is the global batch)"]) from None


def batches(run: Run) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of this rank's part of each global micro-batch (a torch ``DataLoader``;
    workers receive whole batches of indices, so the order does not depend on them)."""
    d = run.cfg.data
    ds = ShardSamples(
        run.data_dir,
        "train",
        seq_len=d.seq_len,
        seed=run.cfg.run.seed,
        shuffle=d.shuffle,
        verify=d.verify_checksums,
    )
    batch_sampler = sampler(run, len(ds))
    run.loss_weight = batch_sampler.loss_weight()
    loader = DataLoader(
        ds,
        batch_sampler=batch_sampler,
        num_workers=d.num_workers,
        collate_fn=functools.partial(collate, task=ds.task),
    )
    return iter(loader)


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
