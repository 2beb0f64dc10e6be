"""Data: real offline corpora, byte-level tokens, WebDataset shards with checksums."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rootopt.data.corpora import (
    CLASS_CORPORA,
    TEXT_CORPORA,
    CorpusError,
    classification_arrays,
    text_bytes,
)
from rootopt.data.shards import (
    ShardError,
    ShardPlan,
    ShardSamples,
    ShardStream,
    ShardWriteError,
    check_target,
    classify_samples,
    collate,
    data_identity,
    lm_samples,
    load_manifest,
    make_loader,
    plan_shards,
    sha256_file,
    validate_data,
    verify_shard,
    write_plan,
    write_shards,
)


def plan(
    corpus: str,
    *,
    seq_len: int = 128,
    max_bytes: int = 4_000_000,
    samples_per_shard: int = 2000,
    val_fraction: float = 0.05,
    seed: int = 0,
) -> ShardPlan:
    """Tokenize a real corpus into planned train/val shards, in memory (nothing is written)."""
    if corpus in CLASS_CORPORA:
        x, y, names = classification_arrays(corpus)
        samples = classify_samples(x, y)
        meta: dict[str, Any] = {
            "task": "classify",
            "corpus": corpus,
            "feature_dim": int(x.shape[1]),
            "num_classes": len(names),
            "classes": names,
        }
    else:
        data = text_bytes(corpus, max_bytes=max_bytes)
        samples = lm_samples(data, seq_len)
        meta = {
            "task": "lm",
            "corpus": corpus if corpus in TEXT_CORPORA else Path(corpus).name,
            "tokenizer": "bytes",
            "vocab_size": 256,
            "seq_len": seq_len,
            "text_bytes": len(data),
            "max_bytes": max_bytes,
        }
    return plan_shards(
        samples,
        samples_per_shard=samples_per_shard,
        val_fraction=val_fraction,
        seed=seed,
        meta=meta,
    )


def prepare(
    corpus: str,
    out: str | Path,
    *,
    seq_len: int = 128,
    max_bytes: int = 4_000_000,
    samples_per_shard: int = 2000,
    val_fraction: float = 0.05,
    seed: int = 0,
) -> dict[str, Any]:
    """Tokenize a real corpus into train/val WebDataset shards plus a checksum manifest.

    The shards are byte-reproducible: the same corpus and settings give the same files."""
    shards = plan(
        corpus,
        seq_len=seq_len,
        max_bytes=max_bytes,
        samples_per_shard=samples_per_shard,
        val_fraction=val_fraction,
        seed=seed,
    )
    return write_plan(out, shards)


__all__ = [
    "CLASS_CORPORA",
    "TEXT_CORPORA",
    "CorpusError",
    "ShardError",
    "ShardPlan",
    "ShardSamples",
    "ShardStream",
    "ShardWriteError",
    "check_target",
    "classification_arrays",
    "collate",
    "data_identity",
    "load_manifest",
    "make_loader",
    "plan",
    "plan_shards",
    "prepare",
    "sha256_file",
    "text_bytes",
    "validate_data",
    "verify_shard",
    "write_plan",
    "write_shards",
]
