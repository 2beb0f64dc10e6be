"""Process-wide thread settings, scoped."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the body on one intra-op thread, then restore the caller's count.

    Library entry points that pin threads for reproducible timing (benchmark runs,
    experiments) use this so an in-process call leaves no global state behind."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
