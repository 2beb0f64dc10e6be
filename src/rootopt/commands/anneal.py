"""``rootopt anneal head|check``: quantized block updates solved as a QUBO (dimod samplers).

``head`` trains a model whose classifier-head weights move on the grid ``s·ℤ`` by ternary
steps chosen by a QUBO (``--methods qubo``), sign-SGD (``sign``), a ternarised ROOT step
(``rounded-root``) or the unquantized ROOT head (``float-root``); the rest of the model trains
with ROOT. ``check`` solves a random small instance and compares it with brute force.

The default sampler ``sa`` is **classical simulated annealing** (dwave-samplers) on this CPU.
``--sampler module:Class`` takes any dimod sampler (e.g. ``dwave.system:LeapHybridSampler``
with your own D-Wave account; nothing of the kind is assumed). Needs ``pip install 'rootopt[anneal]'``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


class UserError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rootopt anneal",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("head", help="quantized-head experiment")
    h.add_argument("--task", default="bbc", choices=("bbc", "digits"))
    h.add_argument("--methods", default="qubo,sign,rounded-root,float-root")
    h.add_argument("--seeds", default="0,1,2")
    h.add_argument("--steps", type=int, default=100)
    h.add_argument("--s", type=float, default=0.02, help="grid step of the head")
    h.add_argument("--hidden", type=int, default=32, help="bbc hidden width / digits CNN width")
    h.add_argument("--rank", type=int, default=8, help="low-rank part of the curvature")
    h.add_argument("--sampler", default="sa", help="sa (default) | tabu | exact | module:Class")
    h.add_argument("--num-reads", type=int, default=8)
    h.add_argument("--num-sweeps", type=int, default=300)
    h.add_argument("--json", default="", help="also write the raw rows to this new file")
    c = sub.add_parser("check", help="solve a random instance; compare with brute force")
    c.add_argument("--n", type=int, default=8, help="ternary variables (brute force: 3^n)")
    c.add_argument("--sampler", default="sa")
    c.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except UserError as exc:
        print(f"rootopt anneal: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rootopt anneal: interrupted", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    try:
        import dimod  # noqa: F401
    except ModuleNotFoundError as exc:
        raise UserError(
            f"needs the {exc.name!r} package; install with: pip install 'rootopt[anneal]'"
        ) from None
    from rootopt.anneal.qubo import AnnealError

    try:
        if args.cmd == "check":
            return _check(args)
        return _head(args)
    except AnnealError as exc:
        raise UserError(str(exc)) from None


def _check(args: argparse.Namespace) -> int:
    import itertools

    import numpy as np

    from rootopt.anneal.qubo import make_sampler, quadratic_model, solve_ternary

    if not 1 <= args.n <= 12:
        raise UserError(f"--n must be in 1..12 for the brute-force check, got {args.n}")
    sampler, limit, desc = make_sampler(args.sampler)
    rng = np.random.default_rng(args.seed)
    g, v, d, s = (
        rng.normal(size=args.n),
        rng.normal(size=(args.n, 2)),
        rng.uniform(0, 1, args.n),
        0.5,
    )
    best = min(
        quadratic_model(s * np.array(t), g, d, v)
        for t in itertools.product((-1, 0, 1), repeat=args.n)
    )
    kw = {"num_reads": 50, "seed": args.seed} if args.sampler in ("sa", "tabu") else {}
    sol = solve_ternary(sampler, g, d, v, s, limit=limit, name=args.sampler, **kw)
    ok = abs(sol.energy - best) <= 1e-9 * max(1.0, abs(best))
    print(
        f"{desc}: n={args.n} ({sol.binaries} binaries, {sol.couplings} couplings) "
        f"energy {sol.energy:.6f}, brute-force optimum {best:.6f} -> {'optimal' if ok else 'NOT optimal'} "
        f"({sol.seconds * 1e3:.1f} ms)"
    )
    return 0 if ok else 1


def _head(args: argparse.Namespace) -> int:
    from rootopt.anneal.experiment import METHODS, HeadConfig, block_size, run_head, table
    from rootopt.anneal.qubo import check_size, make_sampler

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise UserError(
            f"unknown method(s) {bad or args.methods!r} (choose from {', '.join(METHODS)})"
        )
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.json and Path(args.json).exists():
        raise UserError(f"--json {args.json!r} exists; choose a new file")
    base = HeadConfig(
        task=args.task,
        steps=args.steps,
        s=args.s,
        rank=args.rank,
        sampler=args.sampler,
        num_reads=args.num_reads,
        num_sweeps=args.num_sweeps,
        hidden=args.hidden,
    )
    if "qubo" in methods:  # refuse before any training
        _, limit, _ = make_sampler(args.sampler)
        check_size(2 * block_size(base), limit, args.sampler)
    rows = []
    for m in methods:
        for seed in seeds:
            cfg = HeadConfig(**{**base.__dict__, "method": m, "seed": seed})
            rows.append(run_head(cfg))
            print(f"  {m} seed {seed}: val {rows[-1]['final_val_loss']:.4f}", file=sys.stderr)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0
