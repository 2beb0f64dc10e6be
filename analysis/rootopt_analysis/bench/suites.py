"""The benchmark suites behind ``rootopt bench``: convergence, lr robustness, outlier robustness,
overhead. Each turns run results into one section of ``results.json``.

Protocol (docs/benchmarks.md): every optimizer gets the same log-spaced lr grid relative to its
registry lr, the same warmup (10 %) + cosine (to 0.1×) schedule, the same steps, batches and
gradient clipping; the best grid lr (seed 0, final validation loss) is rerun with more seeds;
everything is compared at the end of each optimizer's own schedule.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rootopt.optim.registry import REGISTRY
from rootopt.tasks import TASKS
from rootopt_analysis.bench.runner import Corruption, RunSpec, run_many

WEIGHT_DECAY = 0.1
# lr grid: multiples of each optimizer's registry lr, half a decade apart (same budget for all).
FULL_GRID = (10**-0.5, 1.0, 10**0.5, 10.0)
QUICK_GRID = (1.0,)
ROBUST_OPTIMIZERS = ("adamw", "momentum", "muon", "root", "root-no-suppression")
# Robustness runs are shorter than the convergence runs (their own warmup + cosine over these
# steps): the suite compares optimizers under the same stress, not against the clean suite.
ROBUST_STEPS = 100
ROBUST_CONDITIONS: tuple[tuple[str, Corruption, float], ...] = (
    ("clean", Corruption(), 1.0),
    ("t(2) noise ×2", Corruption("student_t", scale=2.0, df=2), 1.0),
    ("outliers 0.1% ×100", Corruption("outliers", scale=100.0, rate=1e-3), 1.0),
    ("outliers 1% ×100", Corruption("outliers", scale=100.0, rate=1e-2), 1.0),
    ("lr ×3", Corruption(), 3.0),
    ("lr ×10", Corruption(), 10.0),
)
ROBUST_TASK = "stdlib"
# The second LM task is the costliest; the full suite runs it for this core set only (unless
# --optimizers names a set explicitly). Every optimizer runs every other task.
CORE_OPTIMIZERS = ("adamw", "adam", "lamb", "momentum", "muon", "root", "root-no-suppression")
REDUCED_TASKS = ("kjv",)
# Left out of the full suite for cost (--quick still trains them): Shampoo on bbc needs a
# 2000×2000 inverse matrix root per step for the TF-IDF input layer.
FULL_SKIP = (("bbc", "shampoo"),)
# The family suites run the small tasks; the larger LM is used by the defaults study only.
DEFAULT_TASKS = tuple(t for t in TASKS if not t.endswith("-large"))


@dataclass
class BenchConfig:
    out: Path
    quick: bool = False
    tasks: Sequence[str] = DEFAULT_TASKS
    optimizers: Sequence[str] = tuple(REGISTRY)
    seeds: int = 3
    workers: int = 2
    progress: bool = True
    grid: Sequence[float] = field(default_factory=lambda: FULL_GRID)
    reduce_costly: bool = False  # run REDUCED_TASKS with CORE_OPTIMIZERS only
    finished_only: bool = False  # report the finished runs, run nothing

    def optimizers_for(self, task: str) -> list[str]:
        if self.reduce_costly and task in REDUCED_TASKS:
            return [o for o in self.optimizers if o in CORE_OPTIMIZERS]
        if self.reduce_costly:
            return [o for o in self.optimizers if (task, o) not in FULL_SKIP]
        return list(self.optimizers)

    def steps(self, task: str) -> int:
        t = TASKS[task]
        return t.quick_steps if self.quick else t.steps


def weight_decay(name: str) -> float:
    """Decoupled decay 0.1 for AdamW-style optimizers; no L2 term for the others."""
    return WEIGHT_DECAY if REGISTRY[name].decoupled_weight_decay else 0.0


def _spec(
    cfg: BenchConfig, suite: str, task: str, opt: str, lr: float, seed: int, **kw: Any
) -> RunSpec:
    return RunSpec(
        suite=suite,
        task=task,
        optimizer=opt,
        lr=float(f"{lr:.6g}"),
        seed=seed,
        steps=cfg.steps(task),
        weight_decay=weight_decay(opt),
        **kw,
    )


def _mean_std(xs: Sequence[float]) -> tuple[float, float]:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def smoothness(train_loss: Sequence[float], beta: float = 0.9, skip: int = 0) -> float:
    """Mean absolute second difference of the EMA-smoothed training loss (after ``skip`` steps)."""
    ema, out, corr = 0.0, [], 1.0
    for i, x in enumerate(train_loss):
        ema = beta * ema + (1 - beta) * x
        corr *= beta
        if i >= skip:
            out.append(ema / (1 - corr))
    if len(out) < 3:
        return float("nan")
    d2 = [abs(out[i + 1] - 2 * out[i] + out[i - 1]) for i in range(1, len(out) - 1)]
    return statistics.fmean(d2)


def steps_to_target(r: dict[str, Any], target: float) -> tuple[int | None, float | None]:
    """First evaluated step whose validation loss is ≤ target, and the training seconds to it."""
    if r["diverged"]:
        return None, None
    for e in r["evals"]:
        if e["step"] > 0 and e["val_loss"] <= target:
            return int(e["step"]), float(e["train_s"])
    return None, None


# --------------------------------------------------------------------------- convergence


def convergence(cfg: BenchConfig) -> dict[str, Any]:
    t0 = time.perf_counter()
    sweep = [
        _spec(cfg, "convergence", task, opt, REGISTRY[opt].lr * m, 0)
        for task in cfg.tasks
        for opt in cfg.optimizers_for(task)
        for m in cfg.grid
    ]
    # Long runs first so the two workers finish together.
    order = sorted(sweep, key=lambda s: (TASKS[s.task].kind != "lm", s.optimizer != "shampoo"))
    by_id = {
        r["run_id"]: r
        for r in run_many(
            order,
            cfg.out,
            workers=cfg.workers,
            label="lr sweep",
            show=cfg.progress,
            compute=not cfg.finished_only,
        )
        if r is not None
    }
    sweep_res = [by_id.get(s.run_id) for s in sweep]
    best: dict[tuple[str, str], float] = {}
    grid_rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for s, r in zip(sweep, sweep_res):
        if r is None:
            continue
        grid_rows.setdefault(s.task, {}).setdefault(s.optimizer, []).append(
            {
                "lr": s.lr,
                "final_val_loss": r["final_val_loss"],
                "final_val_acc": r["final_val_acc"],
                "diverged": r["diverged"],
                "smoothness": smoothness(r["train_loss"], skip=max(1, s.steps // 10)),
            }
        )
    for task, per in grid_rows.items():
        for opt, rows in per.items():
            ok = [row for row in rows if not row["diverged"]]
            pick = min(ok, key=lambda row: row["final_val_loss"]) if ok else rows[len(rows) // 2]
            best[(task, opt)] = pick["lr"]
    seeds = [
        _spec(cfg, "convergence", task, opt, best[(task, opt)], seed)
        for task in cfg.tasks
        for opt in cfg.optimizers_for(task)
        for seed in range(cfg.seeds)
        if (task, opt) in best
    ]
    seed_res = run_many(
        seeds,
        cfg.out,
        workers=cfg.workers,
        label="seeds",
        show=cfg.progress,
        compute=not cfg.finished_only,
    )
    per_task: dict[str, Any] = {}
    for task in cfg.tasks:
        runs = {
            opt: [
                r
                for s, r in zip(seeds, seed_res)
                if s.task == task and s.optimizer == opt and r is not None
            ]
            for opt in cfg.optimizers_for(task)
        }
        runs = {opt: rs for opt, rs in runs.items() if rs}
        if not runs:
            continue
        adamw = runs.get("adamw") or next(iter(runs.values()))
        target = _mean_std([r["final_val_loss"] for r in adamw])[0]
        rows_out: dict[str, Any] = {}
        for opt, rs in runs.items():
            loss_m, loss_s = _mean_std([r["final_val_loss"] for r in rs])
            accs = [r["final_val_acc"] for r in rs if r["final_val_acc"] is not None]
            acc_m, acc_s = _mean_std(accs) if accs else (None, None)
            reach = [steps_to_target(r, target) for r in rs]
            hit = [x for x in reach if x[0] is not None]
            st_m, st_s = _mean_std([float(x[0]) for x in hit if x[0] is not None])
            wt_m, _ = _mean_std([float(x[1]) for x in hit if x[1] is not None])
            rows_out[opt] = {
                "best_lr": best[(task, opt)],
                "seeds": len(rs),
                "diverged": sum(r["diverged"] for r in rs),
                "final_val_loss": [loss_m, loss_s],
                "final_val_acc": [acc_m, acc_s] if acc_m is not None else None,
                "reached_target": len(hit),
                "steps_to_target": [st_m, st_s] if hit else None,
                "train_s_to_target": wt_m if hit else None,
                "step_time_ms": 1e3
                * statistics.median([r["step_time_s"] for r in rs if r["step_time_s"]]),
                "optimizer_state_bytes": rs[0]["optimizer_state_bytes"],
                "param_count": rs[0]["param_count"],
                "smoothness": _mean_std(
                    [
                        smoothness(r["train_loss"], skip=max(1, len(r["train_loss"]) // 10))
                        for r in rs
                    ]
                ),
                "curves": [
                    {
                        "steps": [e["step"] for e in r["evals"]],
                        "val_loss": [e["val_loss"] for e in r["evals"]],
                    }
                    for r in rs
                ],
            }
        per_task[task] = {
            "description": TASKS[task].description,
            "steps": cfg.steps(task),
            "target_val_loss": target,
            "optimizers": rows_out,
            "grid": grid_rows.get(task, {}),
        }
    return {
        "grid_multipliers": list(cfg.grid),
        "seeds": cfg.seeds,
        "weight_decay": {o: weight_decay(o) for o in cfg.optimizers},
        "registry_lr": {o: REGISTRY[o].lr for o in cfg.optimizers},
        "tasks": per_task,
        "wall_s": time.perf_counter() - t0,
    }


def lr_robustness(conv: dict[str, Any]) -> dict[str, Any]:
    """Final loss over the whole grid per optimizer: spread and width of the good region."""
    out: dict[str, Any] = {}
    for task, tv in conv["tasks"].items():
        rows: dict[str, Any] = {}
        for opt, grid in tv["grid"].items():
            losses = [g["final_val_loss"] for g in grid]
            finite = [x for x in losses if math.isfinite(x)]
            best = min(finite) if finite else float("nan")
            within = sum(1 for x in finite if x <= best * 1.05)
            rows[opt] = {
                "lrs": [g["lr"] for g in grid],
                "final_val_loss": losses,
                "diverged": sum(g["diverged"] for g in grid),
                "within_5pct_of_best": within,
                "worst_over_best": (max(finite) / best)
                if finite and len(finite) == len(losses)
                else None,
                "smoothness_at_best": tv["optimizers"].get(opt, {}).get("smoothness", [None])[0],
            }
        out[task] = rows
    return out


# --------------------------------------------------------------------------- robustness


def robustness(cfg: BenchConfig, conv: dict[str, Any] | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    task = ROBUST_TASK if ROBUST_TASK in cfg.tasks else cfg.tasks[0]
    opts = [o for o in ROBUST_OPTIMIZERS if o in cfg.optimizers] or list(cfg.optimizers)[:2]
    seeds = 1 if cfg.quick else 2
    conditions = (ROBUST_CONDITIONS[0], ROBUST_CONDITIONS[3]) if cfg.quick else ROBUST_CONDITIONS

    def lr_of(opt: str) -> tuple[float, str]:
        if conv is not None:
            row = conv["tasks"].get(task, {}).get("optimizers", {}).get(opt)
            if row is not None:
                return float(row["best_lr"]), "tuned (convergence suite)"
        return REGISTRY[opt].lr, "registry default"

    specs = [
        replace(
            _spec(
                cfg,
                "robustness",
                task,
                opt,
                lr_of(opt)[0],
                seed,
                clip=None,
                corruption=c,
                lr_mult=m,
            ),
            steps=cfg.steps(task) if cfg.quick else ROBUST_STEPS,
        )
        for _, c, m in conditions
        for opt in opts
        for seed in range(seeds)
    ]
    res = run_many(
        specs,
        cfg.out,
        workers=cfg.workers,
        label="robustness",
        show=cfg.progress,
        compute=not cfg.finished_only,
    )
    table: dict[str, dict[str, Any]] = {}
    for label, c, m in conditions:
        for opt in opts:
            rs = [
                r
                for s, r in zip(specs, res)
                if s.optimizer == opt and s.corruption == c and s.lr_mult == m and r is not None
            ]
            table.setdefault(label, {})[opt] = {
                "runs": len(rs),
                "diverged_fraction": sum(r["diverged"] for r in rs) / len(rs) if rs else None,
                "final_val_loss": _mean_std([r["final_val_loss"] for r in rs]),
                "errors": sorted({r["error"] for r in rs if r["error"]}),
            }
    return {
        "task": task,
        "steps": specs[0].steps if specs else 0,
        "seeds": seeds,
        "clip": None,
        "lr": {o: lr_of(o)[0] for o in opts},
        "lr_source": {o: lr_of(o)[1] for o in opts},
        "conditions": [
            {"label": lbl, "corruption": c.__dict__, "lr_mult": m} for lbl, c, m in conditions
        ],
        "table": table,
        "wall_s": time.perf_counter() - t0,
    }
