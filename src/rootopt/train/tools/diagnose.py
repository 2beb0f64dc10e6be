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
from rootopt.train.checkpoint import Checkpointer, Found
from rootopt.train.data import resolve_data
from rootopt.train.models import build_model, loss_fn


def _load(
    run_dir: Path | None, config: str | None, overrides: list[str]
) -> tuple[Config, Checkpointer | None, Found | None, Path]:
    """The config to diagnose, and the run's checkpointer and newest valid checkpoint of
    either format (none: a fresh model)."""
    if run_dir is not None:
        checkpointer = Checkpointer.of_run(run_dir)
        found, _ = checkpointer.newest(print)
        if found is not None:
            return from_dict(found.state["config"]), checkpointer, found, run_dir
        if (run_dir / "config.yaml").is_file():
            return load_config(run_dir / "config.yaml", overrides), None, None, run_dir
        raise TrainingError(f"{str(run_dir)!r} holds no checkpoint and no config.yaml")
    return load_config(config, overrides), None, None, Path("runs") / "diagnose"


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
    cfg, checkpointer, found, where = _load(run_dir, config, list(overrides or []))
    state = found.state if found is not None else None
    torch.set_num_threads(max(1, cfg.run.threads or torch.get_num_threads()))
    data_dir = Path(data_path) if data_path else _run_data(run_dir, state)
    if data_dir is None:  # a fresh model, or a run that prepared its corpus into itself
        data_dir = resolve_data(cfg, where, None, ProcessInfo(0, 1, 0))
    manifest = load_manifest(data_dir)
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, manifest, cfg.data.seq_len)
    optimizer, _ = build_optimizer(cfg, model)
    step = 0
    if checkpointer is not None and found is not None:
        checkpointer.load_into(found, model, optimizer)
        step = int(found.state["state"]["step"])
    stream = ShardStream(
        data_dir,
        "train",
        batch_size=cfg.data.batch_size,
        seq_len=cfg.data.seq_len,
        seed=seed,
        shuffle=True,
    )
    batch = next(iter(stream))
    x, y = batch["input"], batch["target"]
    what = "checkpoint" if state else "fresh model"
    lines = [f"diagnostics at step {step} ({what}), one batch of {x.shape[0]}"]
    lines += _gradient_lines(model, optimizer, x, y)
    for g in optimizer.param_groups:
        g.setdefault("lr", cfg.optimization.base_lr)
    lines += _ratio_lines(model, optimizer)
    lines.append(_probe_line(model, x, y, seed))
    return lines


def _gradient_lines(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> list[str]:
    """The gradient range of one batch against the guide's normal range."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    lo, hi = GRAD_RANGE
    ranges = gradient_range(model)
    gmax = max(v[0] for v in ranges.values())
    gmin = min((v[1] for v in ranges.values() if v[1] > 0), default=0.0)
    ok = lo <= gmin and gmax <= hi
    lines = [
        f"[{'OK' if ok else 'WARN'}] gradient range: max |g| {gmax:.3e}, min non-zero |g| {gmin:.3e} "
        f"(normal {lo:.0e}..{hi:.0e})"
    ]
    worst = sorted(ranges.items(), key=lambda kv: -kv[1][0])[:3]
    return lines + [f"       largest: {n} max {a:.3e} min {b:.3e}" for n, (a, b) in worst]


def _ratio_lines(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """One trial step's update ratios against the guide's healthy band."""
    ratios = update_ratios(model, optimizer)
    lo, hi = UPDATE_RATIO_BAND
    inside = [n for n, r in ratios.items() if lo <= r <= hi]
    med = sorted(ratios.values())[len(ratios) // 2]
    lines = [
        f"[{'OK' if len(inside) == len(ratios) else 'WARN'}] update ratio mean|Δθ|/mean|θ| at lr "
        f"{optimizer.param_groups[0]['lr']:.2e}: median {med:.2e}, min {min(ratios.values()):.2e}, "
        f"max {max(ratios.values()):.2e}; {len(inside)}/{len(ratios)} tensors in the healthy "
        f"band {lo:.0e}..{hi:.0e}"
    ]
    outside = sorted((r, n) for n, r in ratios.items() if not lo <= r <= hi)[-3:]
    return lines + [f"       outside: {n} {r:.2e}" for r, n in outside]


def _probe_line(model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int) -> str:
    """The loss-surface probe along one seeded direction and its log-log slope."""

    def loss_of(m: nn.Module) -> float:
        with torch.no_grad():
            return float(loss_fn(m(x), y))

    base, changes, slope = loss_surface_probe(model, loss_of, seed=seed)
    quad = math.isfinite(slope) and 1.5 <= slope <= 2.5
    return (
        f"[{'OK' if quad else 'WARN'}] loss-surface probe around L={base:.4f}: "
        + ", ".join(f"ε={e:.0e} ΔL={d:+.3e}" for e, d in changes.items())
        + f"; log-log slope {slope:.2f} (quadratic ≈ 2)"
    )
