"""The training system: models, schedules, the loop (``python -m rootopt.train``)."""

from __future__ import annotations

from rootopt.train.build import TrainingError
from rootopt.train.loop import train
from rootopt.train.records import Diverged
from rootopt.train.state import Hooks, Summary, TrainState

__all__ = ["Diverged", "Hooks", "Summary", "TrainState", "TrainingError", "train"]
