"""``rootopt report RUN_DIR``: validation criteria (PASS/FAIL/SKIP with evidence) and fixes.

See docs/monitoring.md, "Validation: `rootopt report`".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rootopt.monitor.report import UPDATE_BAND, check_run


def _not_a_run_log(run: Path) -> str:
    """Why ``run``'s ``summary.json`` or ``metrics.jsonl`` is not what ``rootopt train``
    writes ('' when they are, or are absent: check_run reports that). A log with a cut or
    damaged line is still a log (the report names it); one with no record at all and
    binary bytes is not."""
    summary = run / "summary.json"
    if summary.is_file():
        try:
            data = json.loads(summary.read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            data = {}  # unreadable: the report's log check says so
        if not isinstance(data, dict):
            kinds: dict[type, str] = {list: "a list", str: "a string"}
            kind = kinds.get(type(data), type(data).__name__)
            return (
                f"{str(summary)!r} is not a run summary (it holds {kind}; rootopt train "
                "writes a JSON object)"
            )
    metrics = run / "metrics.jsonl"
    if metrics.is_file():
        from rootopt.monitor.metrics import read_jsonl_checked

        rows, bad = read_jsonl_checked(metrics)
        if not rows and bad:
            with open(metrics, "rb") as fh:
                head = fh.read(1 << 16)
            try:
                head.decode("utf-8")
                binary = b"\x00" in head
            except UnicodeDecodeError as exc:
                binary = exc.start < len(head) - 4  # not merely a character cut at the end
            if binary:
                return (
                    f"{str(metrics)!r} is not a metrics log: binary data and no JSON record "
                    "(rootopt train writes one JSON object per line)"
                )
    return ""


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
    for run in [args.run_dir, *([args.baseline] if args.baseline else [])]:
        problem = _not_a_run_log(Path(run))
        if problem:
            print(f"rootopt report: {problem}", file=sys.stderr)
            return 2
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
