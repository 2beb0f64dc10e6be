"""Data: real offline corpora, tokenizers, WebDataset shards with checksums."""

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
from rootopt.data.preparing import STAGING, Settings, Staged, discard, is_staging, publish, stage
from rootopt.data.shards import (
    ShardError,
    ShardPlan,
    ShardSamples,
    ShardStream,
    ShardWriteError,
    classify_samples,
    collate,
    data_identity,
    identity_tokenizer,
    lm_samples,
    load_manifest,
    make_loader,
    owned_files,
    plan_shards,
    sha256_file,
    validate_data,
    verify_shard,
)
from rootopt.data.tokenizer import TokenizerError, hf_files, parse_spec, vocab_size_of


def plan(
    corpus: str,
    *,
    seq_len: int = 128,
    max_bytes: int = 4_000_000,
    samples_per_shard: int = 2000,
    val_fraction: float = 0.05,
    seed: int = 0,
) -> ShardPlan:
    """The reference preparation of byte tokens, in memory (nothing is written): the whole
    corpus text, cut into blocks, shuffled and split by :func:`plan_shards`. :func:`prepare`
    streams instead and gives the same shards (tests compare the two)."""
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
    tokenizer: str = "bytes",
    text_field: str = "text",
    progress: bool = False,
) -> dict[str, Any]:
    """Tokenize a real corpus into train/val WebDataset shards plus a checksum manifest
    (streaming, bounded memory: :mod:`rootopt.data.preparing`).

    The shards are byte-reproducible: the same corpus and settings give the same files."""
    from rootopt.data import preparing

    settings = Settings(
        corpus=corpus,
        seq_len=seq_len,
        max_bytes=max_bytes,
        samples_per_shard=samples_per_shard,
        val_fraction=val_fraction,
        seed=seed,
        tokenizer=tokenizer,
        text_field=text_field,
    )
    return preparing.prepare(settings, out, progress=progress)


__all__ = [
    "CLASS_CORPORA",
    "STAGING",
    "TEXT_CORPORA",
    "CorpusError",
    "Settings",
    "ShardError",
    "ShardPlan",
    "ShardSamples",
    "ShardStream",
    "ShardWriteError",
    "Staged",
    "TokenizerError",
    "classification_arrays",
    "collate",
    "data_identity",
    "discard",
    "hf_files",
    "identity_tokenizer",
    "is_staging",
    "load_manifest",
    "make_loader",
    "owned_files",
    "parse_spec",
    "plan",
    "plan_shards",
    "prepare",
    "publish",
    "sha256_file",
    "stage",
    "text_bytes",
    "validate_data",
    "verify_shard",
    "vocab_size_of",
]
