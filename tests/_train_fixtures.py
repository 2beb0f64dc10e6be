"""Shared helpers for the training-system tests (tiny model, tiny prepared corpus)."""

from __future__ import annotations

from pathlib import Path

TINY = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "data.seq_len=32",
    "data.batch_size=8",
    "run.max_steps=40",
    "run.log_every=5",
    "run.eval_every=20",
    "run.eval_batches=2",
    "optimization.warmup_steps=5",
    "monitoring.progress_bar=false",
    "monitoring.tensorboard=false",
    "monitoring.plot=false",
    "monitoring.histogram_every=0",
    "checkpoint.every=10",
]


def prepare_tiny(out: Path) -> Path:
    from rootopt.data import prepare

    prepare(
        "kjv", out, seq_len=32, max_bytes=150_000, samples_per_shard=400, val_fraction=0.05, seed=0
    )
    return out


def final_params(run_dir: Path) -> dict[str, object]:
    from rootopt import checkpoint

    found, _ = checkpoint.newest_valid(run_dir / "checkpoints")
    assert found is not None
    return found.state
