"""Optimizers by name, for configs and benchmarks: a thin front of :mod:`rootopt.optim.registry`.

Kept for its public names (``make_optimizer``, ``NAMES``); every optimizer is declared once, in
the registry.
"""

from __future__ import annotations

from rootopt.optim.registry import REGISTRY, make_optimizer

NAMES: tuple[str, ...] = tuple(REGISTRY)

__all__ = ["NAMES", "make_optimizer"]
