"""Offline tools for Newton–Schulz coefficients (AdaNewton).

The fitter (:mod:`.fit`), the spectrum families (:mod:`.spectra`) and the recorded momentum
spectra they draw on (``data/momentum_spectra.json``), the table builder (:mod:`.build`),
the user cache with its file lock (:mod:`.fitcache`), the momentum-spectrum recorder
(:mod:`.record`), the coefficient bench (:mod:`.bench`), the robustness check on unseen
shapes (:mod:`.families`) and the held-out evaluation on matrices recorded from training
(:mod:`.heldout`). ``rootopt coeffs ...`` runs them (:mod:`rootopt_analysis.commands.coeffs`).

The runtime (``import rootopt``, the optimizer, its ``step()``) reads the shipped table and
certifies schedules (:mod:`rootopt.coeffs`); fitting is an explicit, offline act. The one
bridge is opt-in: ``ROOT(..., ns_fit=True)`` imports :mod:`.fitcache` while the optimizer is
being built (never in ``step()``).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def new_file(text: str) -> Path:
    """argparse type for an output file the tool creates: an existing path is refused
    (one usage line) so that a results file of the user's is never overwritten."""
    path = Path(text)
    if path.exists():
        raise argparse.ArgumentTypeError(f"{text!r} exists; choose a new file")
    return path
