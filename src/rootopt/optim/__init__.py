"""The ROOT optimizer: functional core, torch.optim class, routing, baselines."""

from __future__ import annotations

from rootopt.optim.functional import lr_scale_factor
from rootopt.optim.quantile import abs_quantile
from rootopt.optim.registry import REGISTRY, make_optimizer
from rootopt.optim.root import ROOT, NonFiniteGradientError
from rootopt.optim.routing import Route, RoutingReport, Rule, default_rules, param_groups

# Names accepted by make_optimizer (and ``optimization.optimizer``), ROOT first.
OPTIMIZER_NAMES: tuple[str, ...] = tuple(REGISTRY)

__all__ = [
    "OPTIMIZER_NAMES",
    "ROOT",
    "NonFiniteGradientError",
    "Route",
    "RoutingReport",
    "Rule",
    "abs_quantile",
    "default_rules",
    "lr_scale_factor",
    "make_optimizer",
    "param_groups",
]
