"""The training system: models, schedules, the loop (``python -m rootopt.train``).

Names are loaded on first use, so ``python -m rootopt.train`` reaches its own error handling
(e.g. a Ctrl-C while torch is still importing) before the heavy imports run.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rootopt.train.build import TrainingError
    from rootopt.train.failures import Diverged
    from rootopt.train.loop import train
    from rootopt.train.state import Hooks, TrainState
    from rootopt.train.summary import Summary

_WHERE = {
    "TrainingError": "rootopt.train.build",
    "train": "rootopt.train.loop",
    "Diverged": "rootopt.train.failures",
    "Hooks": "rootopt.train.state",
    "Summary": "rootopt.train.summary",
    "TrainState": "rootopt.train.state",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'rootopt.train' has no attribute {name!r}")


__all__ = ["Diverged", "Hooks", "Summary", "TrainState", "TrainingError", "train"]
