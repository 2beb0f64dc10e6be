"""The training system (``rootopt train``, ``python -m rootopt.train``), by component.

Top level, the loop and what it calls each step: :mod:`~rootopt.train.main` (argv → config
→ :func:`train`), :mod:`~rootopt.train.loop` (set-up, then the loop, read top to bottom),
:mod:`~rootopt.train.preflight` (rank 0 checks everything before the run writes),
:mod:`~rootopt.train.policies` (stop, log, evaluate: each owns its interval rule),
:mod:`~rootopt.train.step` (one optimizer step, one validation pass),
:mod:`~rootopt.train.data` (the run's shards and batches), and the components built outside
the loop: :mod:`~rootopt.train.build` (processes, device, optimizer, precision),
:mod:`~rootopt.train.sync` (gradient synchronisation), :mod:`~rootopt.train.schedule`
(lr schedules, clipping).

Sub-packages: :mod:`~rootopt.train.models` (the models), :mod:`~rootopt.train.metrics`
(records, health, MFU), :mod:`~rootopt.train.run` (the run's state, directory, summary,
failures, signals, agreement across ranks), :mod:`~rootopt.train.checkpoint` (the
checkpointer) and :mod:`~rootopt.train.tools` (``rootopt export``, ``rootopt diagnose``).

Each imports only those listed before it (docs/operations.md, "Code layout"): models;
metrics; build, schedule, sync; run; checkpoint; preflight; data; step; policies; loop;
main; tools (which a training run never imports).

Names are loaded on first use, so ``python -m rootopt.train`` reaches its own error handling
(e.g. a Ctrl-C while torch is still importing) before the heavy imports run.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rootopt.train.build import TrainingError
    from rootopt.train.loop import train
    from rootopt.train.run.failures import Diverged
    from rootopt.train.run.state import Hooks, TrainState
    from rootopt.train.run.summary import Summary

_WHERE = {
    "TrainingError": "rootopt.train.build",
    "train": "rootopt.train.loop",
    "Diverged": "rootopt.train.run.failures",
    "Hooks": "rootopt.train.run.state",
    "Summary": "rootopt.train.run.summary",
    "TrainState": "rootopt.train.run.state",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'rootopt.train' has no attribute {name!r}")


__all__ = ["Diverged", "Hooks", "Summary", "TrainState", "TrainingError", "train"]
