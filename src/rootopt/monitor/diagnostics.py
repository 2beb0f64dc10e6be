"""The optimizer-state checks of docs/monitoring.md, "Diagnostics", as functions of a model,
a loss and a step.

* gradient range: max and min non-zero |g| per tensor; 1e-6..1e3 is the normal range.
* update ratio: one optimizer step's ``mean |Δθ| / mean |θ|`` per tensor (the tuning guide
  prints ``mean |update / param|``, which divides by near-zero entries; the ratio of means is the
  stable form of the same quantity); healthy band 1e-5..1e-3.
* loss-surface probe: ``L(θ + ε·z) − L(θ)`` for ε in 1e-3, 1e-2, 1e-1 with one fixed
  Gaussian direction ``z``; near a minimum the change grows like ε² (log-log slope ≈ 2).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
from torch import nn

GRAD_RANGE = (1e-6, 1e3)
UPDATE_RATIO_BAND = (1e-5, 1e-3)


def gradient_range(model: nn.Module) -> dict[str, tuple[float, float]]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.detach().abs().float()
        nz = g[g > 0]
        out[name] = (float(g.max()), float(nz.min()) if nz.numel() else 0.0)
    return out


def update_ratios(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """One trial step from the current gradients, then model and optimizer are restored."""
    saved_state = copy.deepcopy(optimizer.state_dict())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    out = {}
    with torch.no_grad():
        for n, p in model.named_parameters():
            denom = float(before[n].abs().mean())
            out[n] = float((p.detach() - before[n]).abs().mean()) / max(denom, 1e-30)
            p.copy_(before[n])
    optimizer.load_state_dict(saved_state)
    return out


def loss_surface_probe(
    model: nn.Module,
    loss_of: Callable[[nn.Module], float],
    *,
    seed: int = 0,
    epsilons: tuple[float, ...] = (1e-3, 1e-2, 1e-1),
) -> tuple[float, dict[float, float], float]:
    """``(base loss, {ε: ΔL}, log-log slope of |ΔL| between the smallest and largest ε)``."""
    base = loss_of(model)
    gen = torch.Generator().manual_seed(seed)
    params = list(model.parameters())
    direction = [torch.randn(p.shape, generator=gen).to(p.device, p.dtype) for p in params]
    saved = [p.detach().clone() for p in params]
    changes: dict[float, float] = {}
    with torch.no_grad():
        for eps in epsilons:
            for p, z, s in zip(params, direction, saved):
                p.copy_(
                    s + eps * z * s.abs().mean().clamp_min(1e-3)
                )  # scale z to each tensor's size
            changes[eps] = loss_of(model) - base
        for p, s in zip(params, saved):
            p.copy_(s)
    lo, hi = epsilons[0], epsilons[-1]
    a, b = abs(changes[lo]), abs(changes[hi])
    slope = math.log(b / a) / math.log(hi / lo) if a > 0 and b > 0 else float("nan")
    return base, changes, slope
