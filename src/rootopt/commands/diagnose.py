"""``rootopt diagnose [RUN_DIR]``: gradient range, update ratio and loss-surface probe.

See docs/monitoring.md, "Diagnostics: `rootopt diagnose`".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rootopt diagnose", description=__doc__)
    p.add_argument(
        "run_dir", nargs="?", help="run directory (newest valid checkpoint); omit for a fresh model"
    )
    p.add_argument("--config", help="config for a fresh model (without RUN_DIR)")
    p.add_argument(
        "--data_path", "--data-path", dest="data_path", help="prepared shards (default: the run's)"
    )
    p.add_argument("--seed", type=int, default=0, help="batch and probe-direction seed")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = p.parse_args(argv)
    from rootopt.checkpoint import CheckpointError
    from rootopt.config import ConfigError
    from rootopt.data import CorpusError, ShardError
    from rootopt.train.build import TrainingError
    from rootopt.train.tools.diagnose import diagnose

    run_dir = None
    if args.run_dir:
        run_dir = Path(args.run_dir)
        if not run_dir.is_dir():
            print(f"rootopt diagnose: {args.run_dir!r} is not a directory", file=sys.stderr)
            return 2
    try:
        lines = diagnose(
            run_dir,
            config=args.config,
            data_path=args.data_path,
            overrides=args.overrides,
            seed=args.seed,
        )
    except ConfigError as exc:
        for line in exc.problems:
            print(f"rootopt diagnose: config error: {line}", file=sys.stderr)
        return 2
    except (ShardError, CorpusError, CheckpointError, TrainingError) as exc:
        print(f"rootopt diagnose: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0
