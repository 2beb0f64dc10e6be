"""``rootopt rl train|eval``: train a learned ROOT controller (RecurrentPPO) and evaluate it.

``train`` writes a policy directory (``policy.zip`` + ``provenance.json``: config, versions,
seed, task distribution, episode returns) into a new ``--out``. ``eval`` runs held-out tasks
with the controller and with plain ROOT (tuned lr, cosine schedule) on the same seeds and
prints a markdown table; ``--json`` also writes the raw rows. Use a policy in a training run
with ``optimization.controller: PATH``. Needs ``pip install 'rootopt[rl]'``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


class UserError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rootopt rl", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a controller policy")
    t.add_argument("--out", required=True, help="new directory for the policy")
    t.add_argument("--tasks", default="stdlib-d32,digits-w8,bbc-h32", help="task distribution")
    t.add_argument("--timesteps", type=int, default=1200, help="decisions in total")
    t.add_argument("--steps", type=int, default=60, help="optimizer steps per episode")
    t.add_argument("--every", type=int, default=6, help="optimizer steps per decision")
    t.add_argument("--base-lr", type=float, default=0.03, help="ROOT base lr of the schedule")
    t.add_argument("--seed", type=int, default=0)
    e = sub.add_parser("eval", help="held-out comparison against plain ROOT")
    e.add_argument("policy", help="policy directory from 'rootopt rl train'")
    e.add_argument("--tasks", default="kjv-d32,stdlib-d64,digits-w24")
    e.add_argument("--seeds", default="0,1,2")
    e.add_argument("--steps", type=int, default=60)
    e.add_argument("--base-lr", type=float, default=0.03)
    e.add_argument("--json", default="", help="also write the raw rows to this new file")
    return p


def _tasks(raw: str) -> tuple[str, ...]:
    from rootopt.rl.tasks import TASKS

    names = tuple(x.strip() for x in raw.split(",") if x.strip())
    bad = [n for n in names if n not in TASKS]
    if bad or not names:
        raise UserError(
            f"unknown controller task(s) {bad or raw!r} (choose from {', '.join(TASKS)})"
        )
    return names


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except UserError as exc:
        print(f"rootopt rl: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rootopt rl: interrupted", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    import torch

    from rootopt.rl.controller import ControllerError

    torch.set_num_threads(1)
    try:
        import gymnasium  # noqa: F401
        import sb3_contrib  # noqa: F401
    except ModuleNotFoundError as exc:
        raise UserError(
            f"needs the {exc.name!r} package; install with: pip install 'rootopt[rl]'"
        ) from None
    from rootopt.rl.env import EpisodeConfig
    from rootopt.rl.train import PPOConfig, evaluate, table, train_policy

    if args.cmd == "train":
        out = Path(args.out)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise UserError(f"--out {str(out)!r} exists and is not an empty directory")
        if args.steps < 2 * args.every or args.every < 1:
            raise UserError("--steps must be at least 2 × --every (and --every ≥ 1)")
        ep = EpisodeConfig(
            tasks=_tasks(args.tasks), steps=args.steps, every=args.every, base_lr=args.base_lr
        )
        _, _env, prov = train_policy(ep, PPOConfig(timesteps=args.timesteps, seed=args.seed), out)
        r = prov["episode_returns"]
        k = max(1, len(r) // 5)
        print(
            f"saved {out}: {len(r)} episodes in {prov['train_seconds']:.0f}s; mean return "
            f"first {k} {sum(r[:k]) / k:.3f} → last {k} {sum(r[-k:]) / k:.3f}"
        )
        return 0
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    try:
        from rootopt.rl.controller import load_policy

        _, prov = load_policy(args.policy)
        ep = EpisodeConfig(
            tasks=_tasks(args.tasks),
            steps=args.steps,
            every=int(prov["every"]),
            base_lr=args.base_lr,
        )
        rows = evaluate(Path(args.policy), list(ep.tasks), seeds, ep)
    except ControllerError as exc:
        raise UserError(str(exc)) from None
    print(table(rows))
    if args.json:
        dest = Path(args.json)
        if dest.exists():
            raise UserError(f"--json {str(dest)!r} exists; choose a new file")
        dest.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0
