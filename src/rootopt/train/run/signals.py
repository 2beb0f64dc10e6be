"""Stop signals: while a run is set up (:func:`interruptible`) and while it trains
(:class:`StopFlag`, read by the loop's stop policy, :class:`rootopt.train.policies.Stop`)."""

from __future__ import annotations

import contextlib
import os
import signal
from types import FrameType
from typing import Any


@contextlib.contextmanager
def interruptible(enabled: bool = True) -> Any:
    """While the run is set up: SIGINT and SIGTERM raise :class:`Interrupted` at once (the
    set-up writes atomically, so stopping anywhere loses nothing), and the command line
    reports it as one line with status 130 / 143."""
    from rootopt.train.run.agree import Interrupted

    def handle(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signum)

    previous: dict[signal.Signals, Any] = {}
    if enabled:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread: no handlers
                previous[sig] = signal.signal(sig, handle)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class StopFlag:
    """Set by SIGTERM/SIGINT (checkpoint, then stop) or a hook.

    A second signal gives up at once (``KeyboardInterrupt``), except under torchrun: a
    Ctrl-C in the terminal reaches the workers directly *and* through the launcher, which
    forwards it; torchrun itself escalates to SIGKILL when the workers take too long.
    """

    def __init__(self, enabled: bool) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(ValueError):  # not the main thread: no handlers
                    self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is not None:  # second signal: give up immediately
            if "TORCHELASTIC_RUN_ID" in os.environ:
                return
            raise KeyboardInterrupt
        self.signal = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
