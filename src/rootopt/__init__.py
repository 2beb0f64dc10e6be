"""rootopt: the ROOT optimizer (Robust Orthogonalized OpTimizer, arXiv 2511.20626).

>>> import rootopt
>>> groups, report = rootopt.param_groups(model, lr=1e-3)    # doctest: +SKIP
>>> opt = rootopt.ROOT(groups, lr=1e-3)                     # doctest: +SKIP

``rootopt.hf`` (Hugging Face Trainer) is imported on first use.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from rootopt.optim import (
    ROOT,
    NonFiniteGradientError,
    RoutingReport,
    make_optimizer,
    param_groups,
)
from rootopt.optim.functional import soft_threshold_split
from rootopt.optim.quantile import abs_quantile
from rootopt.ortho import orthogonalize

__version__ = "0.1.0"


def __getattr__(name: str) -> ModuleType:
    if name == "hf":  # lazy: keeps `import rootopt` light
        return importlib.import_module("rootopt.hf")
    raise AttributeError(f"module 'rootopt' has no attribute {name!r}")


__all__ = [
    "ROOT",
    "NonFiniteGradientError",
    "RoutingReport",
    "__version__",
    "abs_quantile",
    "hf",
    "make_optimizer",
    "orthogonalize",
    "param_groups",
    "soft_threshold_split",
]
