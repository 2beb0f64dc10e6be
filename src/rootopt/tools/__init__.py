"""Offline tools for Newton–Schulz coefficients (AdaNewton).

The fitter (:mod:`rootopt.tools.fit`), the spectrum families (:mod:`rootopt.tools.spectra`),
the table builder (:mod:`rootopt.tools.build`), the user cache with its file lock
(:mod:`rootopt.tools.fitcache`), the momentum-spectrum recorder (:mod:`rootopt.tools.record`),
the coefficient bench (:mod:`rootopt.tools.bench`) and the held-out evaluation on matrices
recorded from training (:mod:`rootopt.tools.heldout`). ``rootopt coeffs ...`` runs them.

Nothing in the runtime (``import rootopt``, the optimizer, its ``step()``) imports this
package: the runtime reads the shipped table and certifies schedules
(:mod:`rootopt.coeffs`); fitting is an explicit, offline act. The one bridge is opt-in:
``ROOT(..., ns_fit=True)`` imports :mod:`rootopt.tools.fitcache` while the optimizer is
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
