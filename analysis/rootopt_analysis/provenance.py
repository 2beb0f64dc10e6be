"""Where a measurement came from: the commit it ran on and the machine, for the JSON every
results page is generated from (docs/results/)."""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def git_state(repo: Path, *paths: str) -> dict[str, Any]:
    """``{"commit": HEAD or None, "dirty": bool}``; dirty counts tracked files only, under
    ``paths`` when given (a results script may be edited while its numbers stay valid)."""

    def git(*args: str) -> str:
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else ""

    scope = ["--", *paths] if paths else []
    return {
        "commit": git("rev-parse", "HEAD") or None,
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no", *scope)),
    }


def cpu_name() -> str:
    """The CPU's model name (Linux), else the architecture."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


PAUSE_ENV = "ROOTOPT_BENCH_PAUSE_PGID"


@contextlib.contextmanager
def others_paused(active: bool = True) -> Iterator[None]:
    """While a benchmark times: stop the process group named by ``$ROOTOPT_BENCH_PAUSE_PGID``
    (e.g. a long study sharing the machine) with SIGSTOP, and always continue it after."""
    pgid = 0
    if active:
        with contextlib.suppress(ValueError):
            pgid = int(os.environ.get(PAUSE_ENV, "0") or 0)
    if pgid > 0:
        try:
            os.killpg(pgid, signal.SIGSTOP)
        except OSError:
            pgid = 0  # gone, or not ours: time as it is
    try:
        yield
    finally:
        if pgid > 0:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGCONT)


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


# The instruction-set classes that decide ROOT's iteration dtype on an x86 CPU
# (docs/performance.md, "Iteration dtype"), highest first, with the flag that marks each.
ISA_CLASSES = (("AMX", "amx_bf16"), ("AVX-512-BF16", "avx512_bf16"), ("AVX-512", "avx512f"))


def instruction_set() -> dict[str, Any]:
    """The CPU's model, its vector instruction-set class (AMX / AVX-512-BF16 / AVX-512 /
    AVX2 on x86, the architecture elsewhere), oneDNN's ISA cap when one is set, and whether
    bfloat16 matmuls run on bf16 units here (the cap counted)."""
    from rootopt.optim._options import cpu_emulates_bf16

    flags = cpu_flags()
    isa = next((name for name, flag in ISA_CLASSES if flag in flags), None)
    if isa is None:
        isa = "AVX2" if "avx2" in flags else platform.machine()
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or None
    return {
        "cpu": cpu_name(),
        "isa": isa,
        "onednn_max_cpu_isa": cap,
        "native_bf16": platform.machine().lower() in ("x86_64", "amd64")
        and not cpu_emulates_bf16(),
    }
