"""rootopt_analysis.provenance: what a benchmark records of where it ran, and the pause of
another process group while it times."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from rootopt_analysis.provenance import PAUSE_ENV, git_state, others_paused


def _stopped(pid: int, expected: bool) -> bool:
    """Whether the process is stopped, waiting up to 5 s for the ``expected`` state (a
    signal's delivery is asynchronous)."""
    deadline = time.monotonic() + 5
    while True:
        stopped = Path(f"/proc/{pid}/stat").read_text().split()[2] == "T"
        if stopped == expected or time.monotonic() > deadline:
            return stopped
        time.sleep(0.01)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_the_named_process_group_is_stopped_while_timing_and_continued_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        with others_paused():  # nothing named: nothing stopped
            assert not _stopped(other.pid, False)
        monkeypatch.setenv(PAUSE_ENV, str(other.pid))
        with others_paused(active=False):
            assert not _stopped(other.pid, False)
        with pytest.raises(RuntimeError), others_paused():
            assert _stopped(other.pid, True)
            raise RuntimeError("a benchmark that fails")
        assert not _stopped(other.pid, False)  # continued even so
        monkeypatch.setenv(PAUSE_ENV, "not a number")
        with others_paused():
            assert not _stopped(other.pid, False)
    finally:
        other.kill()
        other.wait()


def test_git_state_names_the_commit() -> None:
    repo = Path(__file__).resolve().parents[1]
    state = git_state(repo)
    assert set(state) == {"commit", "dirty"} and isinstance(state["dirty"], bool)
    if (repo / ".git").exists():
        assert isinstance(state["commit"], str) and len(state["commit"]) == 40
