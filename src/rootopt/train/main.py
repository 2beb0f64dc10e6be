"""``rootopt train`` / ``python -m rootopt.train``: argv → config → :func:`rootopt.train.train`.

    rootopt train [--config FILE] [--data_path DIR] [--log_dir DIR] [section.key=value ...]

Without ``--config`` the embedded default runs: a small Llama-style model on CPython's
standard-library source (byte tokens) with ROOT, a few minutes on a laptop CPU.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from rootopt.config import ConfigError, load_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rootopt train",
        description="Train a model with ROOT. With no --config, runs the embedded default "
        "(small Llama-style LM on real offline text). Overrides: section.key=value, "
        "e.g. optimization.base_lr=1e-3 run.max_steps=200.",
    )
    p.add_argument(
        "--config",
        help="YAML config (sections: run, distributed, model, data, optimization, "
        "mixed_precision, checkpoint, monitoring)",
    )
    p.add_argument(
        "--data_path",
        "--data-path",
        dest="data_path",
        help="prepared shard directory (rootopt data prepare); default: prepare data.corpus into the run dir",
    )
    p.add_argument(
        "--log_dir",
        "--log-dir",
        dest="log_dir",
        help="run directory (metrics, checkpoints, plots); an existing one is resumed. Default: runs/<timestamp>",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    return p


def _world() -> Any:
    """:class:`rootopt.dist.WorldInfo` of the running process group (rank 0 of 1 without)."""
    from rootopt.dist import world

    return world()


def _err(msg: str) -> None:
    info = _world()
    where = f" (rank {info.rank})" if info.world_size > 1 and not msg.startswith("rank ") else ""
    print(f"rootopt train{where}: {msg}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done, 1 runtime failure (incl. divergence), 2 user error, 130 SIGINT,
    143 SIGTERM (each after a checkpoint where one could be written)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # SIGINT before the loop's handler (imports, setup) or a second one
        _err("interrupted; stopped without a final checkpoint (rerun to resume from the last one)")
        return 130


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        for line in exc.problems:
            _err(f"config error: {line}")
        return 2
    from rootopt.config import dump_yaml

    if args.print_config:
        print(dump_yaml(cfg), end="")
        return 0
    from rootopt.checkpoint import CheckpointError
    from rootopt.data import CorpusError, ShardError
    from rootopt.dist import CollectiveError
    from rootopt.train.build import TrainingError, run_dir_for
    from rootopt.train.loop import train

    run_dir = run_dir_for(args.log_dir)
    try:
        summary = train(cfg, run_dir, args.data_path)
    except ConfigError as exc:
        for line in exc.problems:
            _err(f"config error: {line}")
        return _leave(2)
    except (ShardError, CorpusError, CheckpointError) as exc:
        _err(str(exc))
        return _leave(2)
    except (TrainingError, CollectiveError) as exc:
        _err(str(exc))
        return _leave(1)
    except OSError as exc:  # outside the loop (setup, final files): one line, naming the path
        where = f" ({exc.filename})" if exc.filename else ""
        _err(f"I/O error: {exc.strerror or exc}{where}")
        return _leave(1)
    info = _world()
    if info.is_main:  # rank 0 reports for the run
        total = f" ({summary.steps} in total)" if summary.steps != summary.session_steps else ""
        _report(summary, total)
    if info.backend is not None:  # a process group is running (any world size)
        from rootopt.dist import finish

        finish(_status(summary))  # every file of the run is closed; see dist.finish
    return _status(summary)


def _leave(code: int) -> int:
    """Exit status after a failure. With peers (world size > 1) the process group may
    have a collective in flight that cannot be shut down cleanly, so the process leaves at
    once (``rootopt.dist.abort``'s rule); the launcher then stops or restarts the others."""
    if _world().world_size > 1:
        from rootopt.dist import exit_now

        exit_now(code)
    return code


def _report(summary: Any, total: str) -> None:
    print(
        f"{summary.status}: {summary.session_steps} steps in {summary.wall_s:.1f} s this session"
        f"{total} ({summary.steps_per_s:.2f} steps/s, {summary.tokens_per_s:.0f} tokens/s); "
        f"loss {summary.initial_loss:.3f} → {summary.final_loss:.3f}"
        + (f", val {summary.val_loss:.3f}" if summary.val_loss == summary.val_loss else "")
        + f"; non-finite steps {summary.nonfinite_steps}"
    )
    print(
        f"run dir: {summary.run_dir} (checkpoint {summary.checkpoint or 'none'}; "
        f"report: rootopt report {summary.run_dir})"
    )
    if summary.status == "interrupted":
        print("stopped by signal after a checkpoint; run the same command to resume")
    if summary.status == "max_time":
        print("stopped at run.max_time after a checkpoint; run the same command to continue")


def _status(summary: Any) -> int:
    if summary.status == "interrupted":
        sig = summary.signal or int(signal.SIGTERM)
        return 130 if sig == int(signal.SIGINT) else 128 + sig
    return 0
