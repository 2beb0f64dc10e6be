"""``rootopt train``: see :mod:`rootopt.train.main`."""

from __future__ import annotations

from rootopt.train.main import main

__all__ = ["main"]
