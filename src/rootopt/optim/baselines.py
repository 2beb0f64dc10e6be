"""Optimizers by name, for configs and benchmarks: ROOT and the family it is compared to."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rootopt.optim.root import ROOT
from rootopt.optim.routing import RoutingReport, param_groups

NAMES = ("root", "muon", "adamw", "adam", "sgd", "lamb", "shampoo")


def make_optimizer(
    name: str,
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    **extra: Any,
) -> tuple[torch.optim.Optimizer, RoutingReport | None]:
    """Build optimizer ``name`` for ``model``; returns ``(optimizer, routing report or None)``.

    ``root``: :class:`ROOT` on :func:`param_groups` (``extra`` → ROOT options).
    ``muon``: ROOT's Muon mode — no outlier clipping, Muon's tuple, bf16 iterations, EMA
    equivalent momentum — which the tests check equal to ``torch.optim.Muon`` on matrices,
    with the same AdamW routing for the rest. ``adamw``/``adam``/``sgd``: torch.optim.
    ``lamb``/``shampoo``: pytorch-optimizer.
    """
    key = name.lower()
    if key in ("root", "muon"):
        opts = dict(extra)
        if key == "muon":
            opts.update(outlier_quantile=None, ns_coefficients="muon", ns_dtype="bfloat16")
        groups, report = param_groups(
            model, lr=lr, weight_decay=weight_decay, adamw_betas=betas, adamw_eps=eps
        )
        return ROOT(
            groups, lr=lr, weight_decay=weight_decay, adamw_betas=betas, adamw_eps=eps, **opts
        ), report
    params = [p for p in model.parameters() if p.requires_grad]
    if key == "adamw":
        return torch.optim.AdamW(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **extra
        ), None
    if key == "adam":
        return torch.optim.Adam(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **extra
        ), None
    if key == "sgd":
        extra.setdefault("momentum", 0.9)
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay, **extra), None
    if key in ("lamb", "shampoo"):
        try:
            import pytorch_optimizer as po
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ValueError(
                f"optimizer {name!r} needs pytorch-optimizer: pip install pytorch-optimizer"
            ) from exc
        if key == "lamb":
            return po.Lamb(
                params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **extra
            ), None
        return po.Shampoo(params, lr=lr, weight_decay=weight_decay, **extra), None
    raise ValueError(f"Invalid optimizer: {name!r} (choose one of {', '.join(NAMES)})")
