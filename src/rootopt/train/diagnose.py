"""``rootopt diagnose`` on a run's newest checkpoint (or a fresh model).

The checks are those of docs/monitoring.md, "Diagnostics: `rootopt diagnose`".

Rebuilds the run's model and optimizer from the config saved in the checkpoint, takes one
training batch, and prints the gradient range, one step's update ratios and the
loss-surface probe, each against its healthy band.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rootopt import checkpoint
from rootopt.config import Config, from_dict, load_config
from rootopt.data import ShardStream, load_manifest
from rootopt.monitor.diagnostics import (
    GRAD_RANGE,
    UPDATE_RATIO_BAND,
    gradient_range,
    loss_surface_probe,
    update_ratios,
)
from rootopt.train.build import ProcessInfo, TrainingError, build_optimizer
from rootopt.train.data import resolve_data
from rootopt.train.model import build_model, loss_fn


def _load(
    run_dir: Path | None, config: str | None, overrides: list[str]
) -> tuple[Config, dict[str, Any] | None, Path]:
    if run_dir is not None:
        found, skipped = checkpoint.newest_valid(run_dir / "checkpoints")
        for line in skipped:
            print(f"skipping invalid checkpoint: {line}")
        if found is not None:
            return from_dict(found.state["config"]), found.state, run_dir
        if (run_dir / "config.yaml").is_file():
            return load_config(run_dir / "config.yaml", overrides), None, run_dir
        raise TrainingError(f"{str(run_dir)!r} holds no checkpoint and no config.yaml")
    return load_config(config, overrides), None, Path("runs") / "diagnose"


def _run_data(run_dir: Path | None, state: dict[str, Any] | None) -> Path | None:
    """The shards a run trained on (its checkpoint, else its run.json), if it recorded them."""
    if run_dir is None:
        return None
    recorded = (state or {}).get("data", {}).get("path")
    if not recorded:
        try:
            recorded = json.loads((run_dir / "run.json").read_text(encoding="utf-8")).get(
                "data_dir"
            )
        except (OSError, ValueError, AttributeError):
            recorded = None
    return Path(recorded) if recorded else None


def diagnose(
    run_dir: Path | None,
    *,
    config: str | None = None,
    data_path: str | None = None,
    overrides: list[str] | None = None,
    seed: int = 0,
) -> list[str]:
    cfg, state, where = _load(run_dir, config, list(overrides or []))
    torch.set_num_threads(max(1, cfg.run.threads or torch.get_num_threads()))
    data_dir = Path(data_path) if data_path else _run_data(run_dir, state)
    if data_dir is None:  # a fresh model, or a run that prepared its corpus into itself
        data_dir = resolve_data(cfg, where, None, ProcessInfo(0, 1, 0))
    manifest = load_manifest(data_dir)
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, manifest, cfg.data.seq_len)
    optimizer, _ = build_optimizer(cfg, model)
    step = 0
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["state"]["step"])
    batch = next(
        iter(
            ShardStream(
                data_dir,
                "train",
                batch_size=cfg.data.batch_size,
                seq_len=cfg.data.seq_len,
                seed=seed,
                shuffle=True,
            )
        )
    )
    x, y = batch["input"], batch["target"]

    def loss_of(m: nn.Module) -> float:
        with torch.no_grad():
            return float(loss_fn(m(x), y))

    lines = [
        f"diagnostics at step {step} ({'checkpoint' if state else 'fresh model'}), one batch of {x.shape[0]}"
    ]
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    lo, hi = GRAD_RANGE
    ranges = gradient_range(model)
    gmax = max(v[0] for v in ranges.values())
    gmin = min((v[1] for v in ranges.values() if v[1] > 0), default=0.0)
    ok = lo <= gmin and gmax <= hi
    lines.append(
        f"[{'OK' if ok else 'WARN'}] gradient range: max |g| {gmax:.3e}, min non-zero |g| {gmin:.3e} "
        f"(normal {lo:.0e}..{hi:.0e})"
    )
    worst = sorted(ranges.items(), key=lambda kv: -kv[1][0])[:3]
    lines += [f"       largest: {n} max {a:.3e} min {b:.3e}" for n, (a, b) in worst]
    for g in optimizer.param_groups:
        g.setdefault("lr", cfg.optimization.base_lr)
    ratios = update_ratios(model, optimizer)
    lo, hi = UPDATE_RATIO_BAND
    inside = [n for n, r in ratios.items() if lo <= r <= hi]
    med = sorted(ratios.values())[len(ratios) // 2]
    lines.append(
        f"[{'OK' if len(inside) == len(ratios) else 'WARN'}] update ratio mean|Δθ|/mean|θ| at lr "
        f"{optimizer.param_groups[0]['lr']:.2e}: median {med:.2e}, min {min(ratios.values()):.2e}, "
        f"max {max(ratios.values()):.2e}; {len(inside)}/{len(ratios)} tensors in the healthy "
        f"band {lo:.0e}..{hi:.0e}"
    )
    outside = sorted((r, n) for n, r in ratios.items() if not lo <= r <= hi)[-3:]
    lines += [f"       outside: {n} {r:.2e}" for r, n in outside]
    base, changes, slope = loss_surface_probe(model, loss_of, seed=seed)
    quad = math.isfinite(slope) and 1.5 <= slope <= 2.5
    lines.append(
        f"[{'OK' if quad else 'WARN'}] loss-surface probe around L={base:.4f}: "
        + ", ".join(f"ε={e:.0e} ΔL={d:+.3e}" for e, d in changes.items())
        + f"; log-log slope {slope:.2f} (quadratic ≈ 2)"
    )
    return lines
