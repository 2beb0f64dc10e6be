"""rootopt: the ROOT optimizer (Robust Orthogonalized OpTimizer, arXiv 2511.20626)."""

from __future__ import annotations

from rootopt.ortho import orthogonalize

__version__ = "0.1.0"

__all__ = ["__version__", "orthogonalize"]
