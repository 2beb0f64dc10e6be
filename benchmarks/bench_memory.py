"""Peak resident memory of one ROOT step on many same-shape matrices.

Each configuration runs in a fresh process (peak RSS is per process): build ``--count``
parameters of ``--shape`` (float32), give them gradients, take ``--steps`` steps, and
report ``ru_maxrss`` before the first step (parameters + gradients + imports) and after.

Usage: python benchmarks/bench_memory.py [--count 32] [--shape 512x2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

CONFIGS: dict[str, dict[str, object]] = {
    "reference_path": {"batched": False},
    "batched_default_budget": {},
    "batched_no_budget": {"bucket_bytes": 0},
}


def child(count: int, rows: int, cols: int, steps: int, options: dict[str, object]) -> None:
    import torch

    import rootopt

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(rows, cols) * 0.02) for _ in range(count)]
    for p in params:
        p.grad = torch.randn(rows, cols)
    # A shape-free coefficient set: what is measured is the step, not a coefficient lookup.
    opt = rootopt.ROOT(params, ns_coefficients="muon", **options)  # type: ignore[arg-type]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(steps):
        opt.step()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"rss_before_step_mib": before / 1024, "peak_rss_mib": after / 1024}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--shape", default="512x2048")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--json", default="")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.json and os.path.lexists(args.json):
        # checked before the measurements, not after: the file is never overwritten
        ap.error(f"--json {args.json}: the file exists; name a new one")
    rows, cols = (int(v) for v in args.shape.split("x"))
    if args.child:
        child(args.count, rows, cols, args.steps, json.loads(args.child))
        return 0
    results = {}
    for name, options in CONFIGS.items():
        cmd = [sys.executable, __file__, "--count", str(args.count), "--shape", args.shape]
        cmd += ["--steps", str(args.steps), "--child", json.dumps(options)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=os.environ)
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            return 1
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
        r = results[name]
        print(
            f"{name:<24} rss before step {r['rss_before_step_mib']:7.0f} MiB"
            f"   peak {r['peak_rss_mib']:7.0f} MiB",
            flush=True,
        )
    if args.json:
        with open(args.json, "x") as f:
            json.dump({"count": args.count, "shape": args.shape, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
