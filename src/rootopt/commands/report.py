"""``rootopt report RUN_DIR``: validation criteria (PASS/FAIL/SKIP with evidence) and fixes.

See docs/training.md, "Validation: `rootopt report`".
"""

from __future__ import annotations

import argparse
import json
import sys

from rootopt.monitor.report import UPDATE_BAND, check_run


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rootopt report", description=__doc__)
    p.add_argument("run_dir", help="a run directory written by rootopt train")
    p.add_argument(
        "--baseline",
        help="a baseline run directory (e.g. the same config with optimization.optimizer=AdamW)",
    )
    p.add_argument(
        "--max-slowdown",
        type=float,
        default=1.5,
        help="allowed step-time ratio vs the baseline (1.5)",
    )
    p.add_argument(
        "--update-band",
        type=float,
        nargs=2,
        default=list(UPDATE_BAND),
        metavar=("LO", "HI"),
        help="accepted median ||Δθ||/||θ|| per step (default 1e-6 1e-1)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    try:
        rep = check_run(
            args.run_dir,
            baseline=args.baseline,
            max_slowdown=args.max_slowdown,
            update_band=(args.update_band[0], args.update_band[1]),
        )
    except ValueError as exc:
        print(f"rootopt report: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(rep.to_dict(), indent=1) if args.json else rep.render())
    return 0 if rep.ok else 1
