"""rootopt: the ROOT optimizer (Robust Orthogonalized OpTimizer, arXiv 2511.20626).

>>> import rootopt
>>> groups, report = rootopt.param_groups(model, lr=1e-3)    # doctest: +SKIP
>>> opt = rootopt.ROOT(groups, lr=1e-3)                     # doctest: +SKIP

Every name is imported on first use, so ``import rootopt`` itself loads nothing heavy: the
``rootopt`` command and ``python -m rootopt.train`` reach their own handling (e.g. of a
Ctrl-C while torch is still importing) before torch is imported. The subpackages are
attributes too, imported on first use: ``rootopt.coeffs.resolve_record(...)`` works after a
bare ``import rootopt`` (docs/adanewton.md).
"""

from __future__ import annotations

import sys


def _interrupted_while_starting() -> None:
    """In the ``rootopt`` command and ``python -m rootopt.train`` (and only there): a
    Ctrl-C before the command's own handling is installed (while Python imports this
    package, ``typing``, the command module) is one line instead of a traceback. Installed
    first thing, so the window left is the interpreter's own start-up."""
    argv = list(getattr(sys, "orig_argv", []))
    cli = bool(sys.argv) and sys.argv[0].replace("\\", "/").rsplit("/", 1)[-1] in (
        "rootopt",
        "rootopt.exe",
    )
    at = argv.index("-m") + 1 if "-m" in argv else len(argv)
    module = at < len(argv) and argv[at] in ("rootopt", "rootopt.train")
    if not (cli or module):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: object) -> None:
        if issubclass(kind, KeyboardInterrupt):
            print("rootopt: interrupted while starting; nothing was written", file=sys.stderr)
            return  # the interpreter then ends by SIGINT (status 130 in a shell)
        previous(kind, value, tb)  # type: ignore[arg-type]

    sys.excepthook = hook


_interrupted_while_starting()

import importlib  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

if TYPE_CHECKING:
    from rootopt import anneal as anneal
    from rootopt import checkpoint as checkpoint
    from rootopt import coeffs as coeffs
    from rootopt import config as config
    from rootopt import data as data
    from rootopt import distributed as distributed
    from rootopt import hf as hf
    from rootopt import monitor as monitor
    from rootopt import optim as optim
    from rootopt import ortho as ortho
    from rootopt import rl as rl
    from rootopt import train as train
    from rootopt.optim import (
        ROOT,
        NonFiniteGradientError,
        RoutingReport,
        make_optimizer,
        param_groups,
    )
    from rootopt.optim.quantile import abs_quantile
    from rootopt.ortho import orthogonalize

__version__ = "0.1.0"

_WHERE = {
    "ROOT": "rootopt.optim",
    "NonFiniteGradientError": "rootopt.optim",
    "RoutingReport": "rootopt.optim",
    "make_optimizer": "rootopt.optim",
    "param_groups": "rootopt.optim",
    "abs_quantile": "rootopt.optim.quantile",
    "orthogonalize": "rootopt.ortho",
}


# Subpackages reachable as attributes of a bare ``import rootopt`` (imported on first use;
# one whose extra is missing raises its ModuleNotFoundError then). The benchmarks, the
# coefficient fitter and the cost model are no part of it: they are the separate
# ``rootopt_analysis`` package (analysis/ in the source tree).
_SUBMODULES = frozenset(
    {
        "anneal",
        "checkpoint",
        "coeffs",
        "config",
        "data",
        "distributed",
        "hf",
        "monitor",
        "optim",
        "ortho",
        "rl",
        "train",
    }
)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"rootopt.{name}")  # import binds it in globals()
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'rootopt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE, *_SUBMODULES})


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
]
