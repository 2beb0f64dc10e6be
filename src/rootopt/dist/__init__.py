"""Deprecated alias of :mod:`rootopt.distributed`, kept for one release.

The package was renamed because ``dist/`` is the conventional build-output folder
(docs/distributed.md, "Package name"). ``import rootopt.dist`` and every
``rootopt.dist.<module>`` import keep working and resolve to the very same module
objects as ``rootopt.distributed``, so isinstance checks, pickles and checkpoints that
name the old path still load. Importing it warns once with a ``DeprecationWarning``.
"""

from __future__ import annotations

import importlib
import sys
import warnings

from rootopt.distributed import *  # noqa: F403  (the alias re-exports the whole package)
from rootopt.distributed import __all__ as __all__

# Every runtime submodule of the renamed package, registered under its old name (its cost
# model and byte counters, ``plan`` and ``counters``, moved out of the runtime:
# rootopt.tools.costmodel and rootopt.tools.counters).
_SUBMODULES = ("checkpoint", "group", "model", "owners", "root", "sampler")

for _name in _SUBMODULES:
    _module = importlib.import_module(f"rootopt.distributed.{_name}")
    sys.modules[f"{__name__}.{_name}"] = _module
    setattr(sys.modules[__name__], _name, _module)

warnings.warn(
    "rootopt.dist is renamed rootopt.distributed; the alias will be removed in the next release",
    DeprecationWarning,
    stacklevel=2,
)
