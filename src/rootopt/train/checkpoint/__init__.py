"""A run's checkpoints as one component (docs/training.md, "Checkpoints and resume").

- :mod:`~rootopt.train.checkpoint.catalog`: the directory as data — one listing of both
  formats in the order written, one "newest valid" rule, one prune rule, the moves into
  ``invalid/`` and ``diverged/``.
- :mod:`~rootopt.train.checkpoint.formats`: what a checkpoint holds, written and read in its
  two back ends, ``ckpt-<step>.pt`` (:mod:`rootopt.checkpoint`, one process) and
  ``dcp-<step>/`` (:mod:`rootopt.distributed.checkpoint`, world size > 1).
- :mod:`~rootopt.train.checkpoint.start`: the checkpoint a run starts from
  (``checkpoint.resume``), chosen before the run writes anything.
- :mod:`~rootopt.train.checkpoint.manager`: the :class:`Checkpointer` the loop, the failure
  handling, the summary, ``rootopt export`` and ``rootopt diagnose`` call.
"""

from __future__ import annotations

from rootopt.train.checkpoint.catalog import (
    DIVERGED,
    INVALID,
    Entry,
    Found,
    list_checkpoints,
    newest_valid,
    prune,
    step_of,
)
from rootopt.train.checkpoint.formats import manifest_digest
from rootopt.train.checkpoint.manager import Checkpointer
from rootopt.train.checkpoint.start import Start, choose

__all__ = [
    "DIVERGED",
    "INVALID",
    "Checkpointer",
    "Entry",
    "Found",
    "Start",
    "choose",
    "list_checkpoints",
    "manifest_digest",
    "newest_valid",
    "prune",
    "step_of",
]
