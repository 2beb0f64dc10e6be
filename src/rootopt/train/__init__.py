"""The training system: models, schedules, the loop (``python -m rootopt.train``)."""

from __future__ import annotations

from rootopt.train.build import TrainingError
from rootopt.train.loop import Hooks, Summary, TrainState, train

__all__ = ["Hooks", "Summary", "TrainState", "TrainingError", "train"]
