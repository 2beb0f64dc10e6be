"""Training-system overhead: ``rootopt train`` steps on a transformers model against a bare
PyTorch loop with the same model, optimizer, batch and precision, interleaved in one run.

The system arm is a real ``rootopt train`` run (in this process, config defaults for
logging, evaluation, data loading and checkpoints; ``--config`` and overrides as for the
command). Its ``after_step`` hook runs one bare step after every system step, so both arms
meet the same spells of a shared machine; a system step is timed from the end of the
previous hook to the start of the next (the loop's own work: data, step, metrics,
histograms, less the time of a validation pass when one is due: validation is the user's
work, timed and reported apart), a bare step by the wall clock around it. A round is ``--steps``
pairs (one logging window at the default ``--steps 10``).

The bare arm: the same transformers model built from the same config and seed (no
wrapper), the same optimizer (``rootopt.train.build.build_optimizer``: ROOT with its
routing, without telemetry), the same learning-rate schedule and global-norm clipping, the
same batches (read from the shards once, held in memory), the same autocast dtype:
``zero_grad → forward → cross-entropy → backward → clip → step → schedule``.

Printed and written (``--json``): per round the two times and their ratio, the median ratio
with its quartiles, the ratio of the totals, and the measured cost of one checkpoint write
with its share per step at ``checkpoint.every``. ``--render JSON``
prints the results page (docs/results/train_overhead.md) from a JSON.

    python benchmarks/bench_train_overhead.py --json docs/results/train_overhead.json
    python benchmarks/bench_train_overhead.py --render docs/results/train_overhead.json > docs/results/train_overhead.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rootopt_analysis.provenance import others_paused

ROOT_DIR = Path(__file__).resolve().parents[1]
TARGET = 1.05
DEFAULT = [
    "model.kind=hf",
    f"model.hf_config={ROOT_DIR / 'configs' / 'hf' / 'llama-small'}",
    "monitoring.progress_bar=false",
]


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return n


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT_DIR), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT_DIR), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out + ("+dirty" if dirty else "")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}".strip()


def _bare_arm(cfg: Any, manifest: dict[str, Any], batches: list[tuple[torch.Tensor, ...]]) -> Any:
    """A step function of the bare loop (see the module docstring)."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from rootopt.train.build import Precision, build_optimizer
    from rootopt.train.models import build_model
    from rootopt.train.models.transformers_lm import hf_config_object
    from rootopt.train.schedule import LRMultiplier

    torch.manual_seed(cfg.run.seed)
    wrapped = build_model(cfg.model, manifest, cfg.data.seq_len)  # the same spec and init
    spec = getattr(wrapped, "spec", None)
    assert isinstance(spec, dict), "the benchmark is for model.kind=hf"
    torch.manual_seed(cfg.run.seed)
    model = AutoModelForCausalLM.from_config(hf_config_object(spec), dtype=torch.float32)
    model.load_state_dict({k.removeprefix("hf."): v for k, v in wrapped.state_dict().items()})
    model.train()
    o = dataclasses.replace(cfg.optimization, telemetry=False)
    opt, _ = build_optimizer(dataclasses.replace(cfg, optimization=o), model)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        LRMultiplier(
            o.schedule, warmup=o.warmup_steps, total=cfg.run.max_steps, min_ratio=o.min_lr_ratio
        ),
    )
    precision = Precision(cfg, torch.device("cpu"))
    params = [p for p in model.parameters() if p.requires_grad]
    position = [0]

    def step() -> float:
        x, y = batches[position[0] % len(batches)]
        position[0] += 1
        opt.zero_grad(set_to_none=True)
        with precision.autocast():
            logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.optimization.clip.max_norm)
        opt.step()
        sched.step()
        return float(loss.detach())

    return step


def _first_batches(cfg: Any, data_dir: Path, n: int) -> list[tuple[torch.Tensor, ...]]:
    from types import SimpleNamespace

    from rootopt.train.build import ProcessInfo
    from rootopt.train.data import batches
    from rootopt.train.run.state import TrainState

    fake = SimpleNamespace(
        cfg=cfg, info=ProcessInfo(0, 1, 0), state=TrainState(), data_dir=data_dir
    )
    it = batches(fake)  # type: ignore[arg-type]
    return [(b["input"], b["target"]) for b in (next(it) for _ in range(n))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rootopt.config import load_config
    from rootopt.data import load_manifest
    from rootopt.train import Hooks, train
    from rootopt.train.build import Precision, ProcessInfo
    from rootopt.train.data import resolve_data

    total = args.rounds * args.steps + args.warmup_steps
    work = Path(tempfile.mkdtemp(prefix="rootopt-overhead-"))
    over = [*DEFAULT, *args.overrides, f"run.max_steps={total}"]
    cfg = load_config(args.config, over)
    torch.set_num_threads(cfg.run.threads or torch.get_num_threads())
    data_dir = (
        Path(args.data_path)
        if args.data_path
        else resolve_data(cfg, work / "prep", None, ProcessInfo(0, 1, 0))
    )
    manifest = load_manifest(data_dir)
    bare = _bare_arm(cfg, manifest, _first_batches(cfg, data_dir, args.steps))
    bare()  # warm-up: first-call allocations of the bare arm
    rounds: list[dict[str, float]] = []
    state = {"since": 0.0, "sys": 0.0, "bare": 0.0, "steps": 0, "skip": args.warmup_steps}
    state.update(eval=0.0, eval_in_step=0.0, evals=0)
    from rootopt.train import loop

    evaluate = loop.evaluate

    def timed_evaluate(*a: Any, **k: Any) -> Any:
        """Validation is the user's work, not the system's overhead: timed apart."""
        t0 = time.perf_counter()
        try:
            return evaluate(*a, **k)
        finally:
            state["eval_in_step"] += time.perf_counter() - t0

    loop.evaluate = timed_evaluate  # type: ignore[assignment]

    def after_step(step: int) -> bool:
        now = time.perf_counter()
        took, state["eval_in_step"] = state["eval_in_step"], 0.0
        if took:
            state["eval"] += took
            state["evals"] += 1
        if state["skip"] > 0:  # the system arm's first steps (allocations, first log)
            state["skip"] -= 1
        else:
            state["sys"] += now - state["since"] - took
            t0 = time.perf_counter()
            bare()  # one bare step after each system step: both meet the same spells
            state["bare"] += time.perf_counter() - t0
            state["steps"] += 1
        if state["steps"] == args.steps:
            s, b = state["sys"], state["bare"]
            rounds.append({"system_s": s, "bare_s": b, "ratio": s / b})
            state["sys"] = state["bare"] = 0.0
            state["steps"] = 0
        state["since"] = time.perf_counter()
        return False

    load_start = os.getloadavg()[0]
    state["since"] = time.perf_counter()
    with others_paused():
        try:
            summary = train(
                cfg,
                work / "run",
                str(data_dir),
                hooks=Hooks(after_step=after_step),
                say=lambda _: None,
            )
        finally:
            loop.evaluate = evaluate  # type: ignore[assignment]
        ck = _time_checkpoint(work / "run")
    ratios = [r["ratio"] for r in rounds]
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    sys_total = sum(r["system_s"] for r in rounds)
    bare_total = sum(r["bare_s"] for r in rounds)
    step_s = bare_total / (len(rounds) * args.steps)
    # checkpoints every checkpoint.every steps (rarer than the run is long): their cost per
    # step from one timed write; evaluations every run.eval_every steps, timed in the run
    amortized = ck / cfg.checkpoint.every / step_s
    eval_s = state["eval"] / state["evals"] if state["evals"] else 0.0
    eval_share = eval_s / cfg.run.eval_every / step_s if cfg.run.eval_every else 0.0
    load_end = os.getloadavg()[0]

    def here(text: str) -> str:  # paths inside the repository, relative to it
        return text.replace(f"{ROOT_DIR}{os.sep}", "")

    return {
        "benchmark": "train_overhead",
        "load_average": [round(load_start, 2), round(load_end, 2)],
        "commit": _commit(),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "machine": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "config": args.config or "embedded default",
        "overrides": [here(o) for o in over],
        "model": here(cfg.model.hf_config),
        "batch": cfg.data.batch_size,
        "seq_len": cfg.data.seq_len,
        "precision": Precision(cfg, torch.device("cpu")).name,
        "log_every": cfg.run.log_every,
        "eval_every": cfg.run.eval_every,
        "checkpoint_every": cfg.checkpoint.every,
        "steps_per_round": args.steps,
        "rounds": rounds,
        "median_ratio": statistics.median(ratios),
        "ratio_q1": q[0],
        "ratio_q3": q[2],
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "total_ratio": sys_total / bare_total,
        "bare_step_s": step_s,
        "checkpoint_s": ck,
        "amortized_checkpoint": amortized,
        "evaluation_s": eval_s,
        "evaluations": state["evals"],
        "evaluation_share": eval_share,
        "target": TARGET,
        "met": statistics.median(ratios) <= TARGET,
        "status": summary.status,
    }


def _time_checkpoint(run_dir: Path) -> float:
    """Seconds of the run's final checkpoint write (its events.jsonl does not time it):
    the size of the newest checkpoint written again, atomically, as the run writes it."""
    from rootopt import checkpoint
    from rootopt.train.checkpoint import newest_valid

    found, _ = newest_valid(run_dir / "checkpoints")
    if found is None:
        return 0.0
    out = run_dir / "timing"
    t0 = time.perf_counter()
    checkpoint.save(out, int(found.state["state"]["step"]), found.state)
    return time.perf_counter() - t0


def render(data: dict[str, Any]) -> str:
    rows = "\n".join(
        f"| {i + 1} | {r['system_s']:.3f} | {r['bare_s']:.3f} | {r['ratio']:.3f} |"
        for i, r in enumerate(data["rounds"])
    )
    verdict = "met" if data["met"] else "missed"
    return f"""# Training-system overhead (`benchmarks/bench_train_overhead.py`)

Generated from `docs/results/train_overhead.json` (commit {data["commit"]}, {data["date"]},
torch {data["torch"]}, {data["machine"]}, {data["cpu_count"]} cores shared with other jobs:
load average {data["load_average"][0]} at the start, {data["load_average"][1]} at the end;
{data["threads"]} torch thread). `rootopt train` on `{Path(data["model"]).name}` (model.kind=hf), batch
{data["batch"]} × {data["seq_len"]} tokens, {data["precision"]}, against a bare PyTorch loop
with the same model, optimizer (ROOT with its routing), schedule, clipping and batches,
alternating step by step; {len(data["rounds"])} rounds of {data["steps_per_round"]} steps per arm.
Logging every {data["log_every"]} steps, evaluation every {data["eval_every"]}, checkpoints
every {data["checkpoint_every"]} (the defaults).

**Median ratio system / bare: {data["median_ratio"]:.3f}** (quartiles {data["ratio_q1"]:.3f}
– {data["ratio_q3"]:.3f}, range {data["ratio_min"]:.3f} – {data["ratio_max"]:.3f}); ratio of
the totals {data["total_ratio"]:.3f}. Target ≤ {data["target"]}: {verdict}. A bare step took
{data["bare_step_s"] * 1e3:.1f} ms; one checkpoint write {data["checkpoint_s"] * 1e3:.0f} ms,
which at the checkpoint interval adds {data["amortized_checkpoint"]:.2%} per step (the
run is shorter than the interval). Validation, the user's own work rather than overhead, is
timed apart and left out of the system steps: one pass ({data["evaluations"]} timed) took
{data["evaluation_s"]:.2f} s, {data["evaluation_share"]:.1%} of the step time at evaluation
every {data["eval_every"]} steps.

| round | system (s) | bare (s) | ratio |
|---|---|---|---|
{rows}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="a rootopt config (default: the embedded one)")
    ap.add_argument("--data_path", help="prepared shards (default: data.corpus, prepared)")
    ap.add_argument("--rounds", type=_positive, default=15)
    ap.add_argument("--steps", type=_positive, default=10, help="steps per arm and round")
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--json", help="write the results here (refused if it exists)")
    ap.add_argument("--render", help="print the results page of this JSON and exit")
    ap.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = ap.parse_args()
    if args.render:
        print(render(json.loads(Path(args.render).read_text())), end="")
        return
    if args.json and Path(args.json).exists():
        sys.exit(f"bench_train_overhead: {args.json} exists; choose another path")
    data = run(args)
    for i, r in enumerate(data["rounds"]):
        print(
            f"round {i + 1}: system {r['system_s']:.3f} s, bare {r['bare_s']:.3f} s, ratio {r['ratio']:.3f}"
        )
    print(
        f"median ratio {data['median_ratio']:.3f} (quartiles {data['ratio_q1']:.3f}-"
        f"{data['ratio_q3']:.3f}); total {data['total_ratio']:.3f}; target <= {TARGET}: "
        f"{'met' if data['met'] else 'missed'}"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
