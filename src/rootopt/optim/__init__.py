"""The ROOT optimizer: functional core, torch.optim class, routing, baselines."""

from __future__ import annotations

from rootopt.optim.baselines import NAMES as OPTIMIZER_NAMES
from rootopt.optim.baselines import make_optimizer
from rootopt.optim.functional import (
    abs_quantile,
    clip_outliers,
    lr_scale_factor,
    soft_threshold_split,
)
from rootopt.optim.root import ROOT, NonFiniteGradientError
from rootopt.optim.routing import Route, RoutingReport, Rule, default_rules, param_groups

__all__ = [
    "OPTIMIZER_NAMES",
    "ROOT",
    "NonFiniteGradientError",
    "Route",
    "RoutingReport",
    "Rule",
    "abs_quantile",
    "clip_outliers",
    "default_rules",
    "lr_scale_factor",
    "make_optimizer",
    "param_groups",
    "soft_threshold_split",
]
