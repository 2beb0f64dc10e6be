"""rootopt: the ROOT optimizer (Robust Orthogonalized OpTimizer, arXiv 2511.20626).

>>> import rootopt
>>> groups, report = rootopt.param_groups(model, lr=1e-3)    # doctest: +SKIP
>>> opt = rootopt.ROOT(groups, lr=1e-3)                     # doctest: +SKIP
"""

from __future__ import annotations

from rootopt.optim import (
    ROOT,
    NonFiniteGradientError,
    RoutingReport,
    make_optimizer,
    param_groups,
)
from rootopt.optim.functional import abs_quantile, soft_threshold_split
from rootopt.ortho import orthogonalize

__version__ = "0.1.0"

__all__ = [
    "ROOT",
    "NonFiniteGradientError",
    "RoutingReport",
    "__version__",
    "abs_quantile",
    "make_optimizer",
    "orthogonalize",
    "param_groups",
    "soft_threshold_split",
]
