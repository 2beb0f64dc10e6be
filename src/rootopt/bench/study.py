"""The defaults study: which ``ns_coefficients``, selector, ``outlier_quantile`` and ``ns_dtype``
ROOT defaults to, decided by paired training evidence (protocol: docs/benchmarks.md).

The whole study is plain data (:class:`Protocol`, :class:`Arm`, :class:`Cell`) plus pure
functions that, given the finished runs, say which runs are still needed (:func:`plan`) and
what was found (:func:`summarize`). :func:`run_study` keeps a pool of worker processes busy with
the needed runs, highest priority first, and asks :func:`plan` again after every finished run;
each run's result is a JSON file named by its spec, so an interrupted study resumes where it
stopped and a finished one is summarised without running anything.

Tuning (per arm and cell, on the validation split, selection seeds only): the matrix lr on a
quarter-decade grid that extends itself when the best point is on an edge; then the lr of the
AdamW side (embeddings, norms, head) as a multiple of the matrix lr; then the lr again near the
optimum; then the weight decay. Reporting (test split, report seeds disjoint from the selection
seeds): the chosen setting, each claim a paired difference with a 95 % interval.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from rootopt.bench.runner import Corruption, RunSpec
from rootopt.bench.stats import mean_ci, paired_ci
from rootopt.bench.suites import smoothness

Result = dict[str, Any]
Lookup = Callable[[RunSpec], Result | None]


# ----------------------------------------------------------------------------- protocol data


@dataclass(frozen=True)
class Arm:
    """One optimizer setting. Runs are identified by (optimizer, options, ...), not by the arm's
    name, so two arms with the same setting share their runs."""

    name: str
    optimizer: str  # registry name (rootopt.optim.registry)
    options: tuple[tuple[str, Any], ...] = ()
    label: str = ""
    side: bool = False  # has an internal AdamW side whose lr multiple is tuned
    tune_wd: bool = True  # False: the optimizer's decay is an L2 term; fixed at 0
    clip: float | None = 1.0

    def with_options(self, name: str, label: str, **opts: Any) -> Arm:
        merged = dict(self.options)
        merged.update(opts)
        return replace(self, name=name, label=label, options=tuple(sorted(merged.items())))

    def option(self, key: str, default: Any = None) -> Any:
        return dict(self.options).get(key, default)


# ROOT's options written out in every ROOT arm, so the study does not depend on the library
# defaults it decides.
ROOT_BASE: dict[str, Any] = {
    "ns_coefficients": "adanewton",
    "outlier_quantile": 0.9,
    "ns_dtype": "float32",
    "ortho_method": "newton_schulz",
}


def root_arm(name: str, label: str, **opts: Any) -> Arm:
    return Arm(name, "root", tuple(sorted({**ROOT_BASE, **opts}.items())), label, side=True)


# "official" is not a candidate: the paper's table has only 2048-wide shapes and falls back to
# Muon's tuple for every other shape, so on every matrix of these tasks it *is* `root-muon`
# (tests/test_study.py checks this for every shape the study trains).
COEFFICIENT_CANDIDATES: tuple[Arm, ...] = (
    # Order matters only for exact ties: the current default first.
    root_arm("root-adanewton", "ROOT, AdaNewton (per-shape table + per-matrix selector)"),
    root_arm("root-muon", "ROOT, Muon's coefficients", ns_coefficients="muon"),
    root_arm("root-polar", "ROOT, Polar Express", ns_coefficients="polar_express"),
    root_arm(
        "root-adanewton-static",
        "ROOT, AdaNewton table without the selector",
        ns_coefficients="adanewton-static",
    ),
)
REFERENCES: tuple[Arm, ...] = (
    root_arm(
        "muon-fp32",
        "Muon, fp32 iterations (ROOT's Muon mode)",
        ns_coefficients="muon",
        outlier_quantile=None,
    ),
    Arm("muon-bf16", "muon", (), "Muon, bf16 iterations (torch.optim.Muon)", side=True),
    Arm("adamw", "adamw", (), "AdamW (torch.optim)"),
)
ABLATIONS: tuple[Arm, ...] = (
    root_arm("root-svd", "ROOT, exact polar factor (SVD)", ortho_method="svd"),
)
DEFAULT_WD = 0.1


@dataclass(frozen=True)
class Cell:
    """A task trained for ``steps`` steps. ``base``: the cell whose tuned setting this one
    starts from (its AdamW-side lr and decay are inherited, its lr grid is centred on the
    base's optimum); None: tuned from scratch."""

    task: str
    steps: int
    base: str | None = None

    @property
    def name(self) -> str:
        return f"{self.task}@{self.steps}"


@dataclass(frozen=True)
class Protocol:
    cells: tuple[Cell, ...]
    selection_seeds: tuple[int, ...]
    report_seeds: tuple[int, ...]
    lr_grid: tuple[int, ...]  # exponents k of base_lr·10^(k/4)
    transfer_grid: tuple[int, ...]  # offsets of k around a base cell's optimum
    side_grid: tuple[int, ...]  # exponents j of the AdamW-side multiple 10^(j/4)
    wd_grid: tuple[float, ...]
    wd_extension: float  # tried when the largest decay of the grid is best
    max_extensions: int
    ablation_cells: tuple[str, ...]
    # A coefficient candidate worse (by the decision rule) on at least this many of the
    # default-horizon cells is screened out before the longer horizons and the larger model.
    screen_worse: int
    robust_cell: str
    robust_conditions: tuple[tuple[str, Corruption, float], ...]
    timing_steps: int
    timing_warmup: int
    cost_tie: float  # relative step-cost difference treated as equal
    per_decade: int = 4

    @staticmethod
    def full() -> Protocol:
        return Protocol(
            cells=(
                Cell("stdlib", 150),
                Cell("kjv", 150),
                Cell("digits", 200),
                Cell("stdlib", 600, base="stdlib@150"),
                Cell("kjv", 600, base="kjv@150"),
                Cell("digits", 800, base="digits@200"),
                Cell("stdlib-large", 200, base="stdlib@150"),
            ),
            selection_seeds=(100, 101),
            report_seeds=(0, 1, 2, 3, 4),
            lr_grid=(-1, 0, 1, 2, 3, 4),
            transfer_grid=(-1, 0, 1),
            side_grid=(-4, -2, 0),
            wd_grid=(0.0, 0.1, 0.3),
            wd_extension=1.0,
            max_extensions=4,
            ablation_cells=("stdlib@150",),
            screen_worse=2,
            robust_cell="stdlib@150",
            robust_conditions=(
                ("clean", Corruption(), 1.0),
                ("t(2) noise ×2", Corruption("student_t", scale=2.0, df=2), 1.0),
                ("outliers 0.1% ×100", Corruption("outliers", scale=100.0, rate=1e-3), 1.0),
                ("outliers 1% ×100", Corruption("outliers", scale=100.0, rate=1e-2), 1.0),
                ("lr ×10", Corruption(), 10.0),
            ),
            timing_steps=100,
            timing_warmup=5,
            cost_tie=0.05,
        )

    @staticmethod
    def quick() -> Protocol:
        """The whole pipeline on a few tiny runs (tests, a smoke check); not evidence."""
        return Protocol(
            cells=(Cell("digits", 6), Cell("digits", 12, base="digits@6")),
            selection_seeds=(100,),
            report_seeds=(0, 1),
            lr_grid=(0, 4),
            transfer_grid=(0,),
            side_grid=(0, 4),
            wd_grid=(0.1,),
            wd_extension=0.3,
            max_extensions=1,
            ablation_cells=(),
            screen_worse=1,
            robust_cell="digits@6",
            robust_conditions=(
                ("clean", Corruption(), 1.0),
                ("outliers 1% ×100", Corruption("outliers", scale=100.0, rate=1e-2), 1.0),
            ),
            timing_steps=3,
            timing_warmup=1,
            cost_tie=0.03,
        )

    @staticmethod
    def reduced() -> Protocol:
        """:meth:`full` on its first four cells: the three default-horizon cells and stdlib@600.
        A recorded deviation (docs/benchmarks.md, "What ran"): kjv@600, digits@800 and
        stdlib-large@200 were dropped before any of their runs finished, because the shared
        2-core machine could not finish them; everything else is the full protocol."""
        full = Protocol.full()
        return replace(full, cells=full.cells[:4])

    def cell(self, name: str) -> Cell:
        for c in self.cells:
            if c.name == name:
                return c
        raise KeyError(name)


def _lr(arm: Arm, k: int, per_decade: int) -> float:
    from rootopt.optim.registry import get

    return float(f"{get(arm.optimizer).lr * 10 ** (k / per_decade):.6g}")


def _mult(j: int, per_decade: int) -> float:
    return float(f"{10 ** (j / per_decade):.6g}")


# ----------------------------------------------------------------------------- tuning


@dataclass(frozen=True)
class Setting:
    k: int  # matrix lr exponent
    j: int = 0  # AdamW-side multiple exponent
    wd: float = DEFAULT_WD

    def as_dict(self, arm: Arm, per_decade: int) -> dict[str, Any]:
        return {
            "k": self.k,
            "lr": _lr(arm, self.k, per_decade),
            "side_lr_mult": _mult(self.j, per_decade) if arm.side else None,
            "weight_decay": self.wd,
        }


@dataclass
class Tuned:
    """The outcome of tuning one arm on one cell: the chosen setting and every score seen."""

    setting: Setting
    history: list[dict[str, Any]] = field(default_factory=list)
    edge: bool = False  # the optimum stayed on an edge after the last extension


class Needs(Exception):
    """Raised inside a tuner when runs are missing; carries them."""

    def __init__(self, specs: list[RunSpec]) -> None:
        super().__init__(f"{len(specs)} runs needed")
        self.specs = specs


def _missing(lookup: Lookup, specs: Sequence[RunSpec]) -> Needs:
    """:class:`Needs` for those of ``specs`` that have no result yet."""
    return Needs([s for s in specs if lookup(s) is None])


def make_spec(
    arm: Arm,
    cell: Cell,
    s: Setting,
    seed: int,
    per_decade: int,
    *,
    suite: str = "study",
    steps: int | None = None,
    clip: float | str | None = "arm",
    corruption: Corruption | None = None,
    lr_mult: float = 1.0,
) -> RunSpec:
    return RunSpec(
        suite=suite,
        task=cell.task,
        optimizer=arm.optimizer,
        lr=_lr(arm, s.k, per_decade),
        seed=seed,
        steps=cell.steps if steps is None else steps,
        weight_decay=s.wd if arm.tune_wd else 0.0,
        clip=arm.clip if clip == "arm" else clip,  # type: ignore[arg-type]
        corruption=corruption or Corruption(),
        lr_mult=lr_mult,
        options=arm.options,
        side_lr_mult=_mult(s.j, per_decade) if arm.side else 1.0,
    )


def selection_score(results: Sequence[Result]) -> float:
    """Mean final validation loss over the selection seeds; a divergence scores +inf."""
    vals = [r["final_val_loss"] for r in results]
    if any(r["diverged"] or not math.isfinite(v) for r, v in zip(results, vals, strict=True)):
        return math.inf
    return statistics.fmean(vals)


class Tuner:
    """Tunes one arm on one cell given the finished runs; raises :class:`Needs` when runs
    are missing. Deterministic: the same finished runs give the same requests."""

    def __init__(self, proto: Protocol, arm: Arm, cell: Cell, lookup: Lookup) -> None:
        self.p, self.arm, self.cell, self.lookup = proto, arm, cell, lookup
        self.history: list[dict[str, Any]] = []
        self.edge = False

    def _score(self, s: Setting) -> float | None:
        specs = [
            make_spec(self.arm, self.cell, s, sd, self.p.per_decade)
            for sd in self.p.selection_seeds
        ]
        res = [self.lookup(x) for x in specs]
        missing = [x for x, r in zip(specs, res, strict=True) if r is None]
        if missing:
            return None
        return selection_score([r for r in res if r is not None])

    def _search(
        self, what: str, points: Sequence[int], at: Callable[[int], Setting], step: int
    ) -> int:
        """Line search over integer exponents; extends by ``step`` past a best edge."""
        pts = sorted(points)
        for ext in range(self.p.max_extensions + 1):
            scores = {x: self._score(at(x)) for x in pts}
            missing = [x for x, v in scores.items() if v is None]
            if missing:
                raise _missing(
                    self.lookup,
                    [
                        make_spec(self.arm, self.cell, at(x), sd, self.p.per_decade)
                        for x in missing
                        for sd in self.p.selection_seeds
                    ],
                )
            best = min(pts, key=lambda x: (scores[x], x))
            on_edge = len(pts) > 1 and best in (pts[0], pts[-1])
            if not on_edge or all(math.isinf(v) for v in scores.values() if v is not None):
                self._record(what, at, scores)
                return best
            if ext == self.p.max_extensions:
                self.edge = True
                self._record(what, at, scores)
                return best
            pts = [best - step, *pts] if best == pts[0] else [*pts, best + step]
        raise AssertionError("unreachable")

    def _record(
        self, what: str, at: Callable[[int], Setting], scores: dict[int, float | None]
    ) -> None:
        self.history.append(
            {
                "phase": what,
                "points": [
                    {**at(x).as_dict(self.arm, self.p.per_decade), "val_loss": v}
                    for x, v in sorted(scores.items())
                ],
            }
        )

    def _wd(self, k: int, j: int) -> float:
        grid = list(self.p.wd_grid)
        scores = {w: self._score(Setting(k, j, w)) for w in grid}
        if any(v is None for v in scores.values()):
            raise _missing(
                self.lookup,
                [
                    make_spec(self.arm, self.cell, Setting(k, j, w), sd, self.p.per_decade)
                    for w, v in scores.items()
                    if v is None
                    for sd in self.p.selection_seeds
                ],
            )
        best = min(grid, key=lambda w: (scores[w], w))
        if best == max(grid) and self.p.wd_extension > best:
            w = self.p.wd_extension
            v = self._score(Setting(k, j, w))
            if v is None:
                raise _missing(
                    self.lookup,
                    [
                        make_spec(self.arm, self.cell, Setting(k, j, w), sd, self.p.per_decade)
                        for sd in self.p.selection_seeds
                    ],
                )
            scores[w] = v
            best = min(scores, key=lambda x: (scores[x], x))  # type: ignore[arg-type]
        self.history.append(
            {
                "phase": "weight decay",
                "points": [
                    {**Setting(k, j, w).as_dict(self.arm, self.p.per_decade), "val_loss": v}
                    for w, v in sorted(scores.items())
                ],
            }
        )
        return best

    def tune(self, base: Tuned | None) -> Tuned:
        wd0 = DEFAULT_WD if self.arm.tune_wd else 0.0
        if base is not None:  # a longer horizon or a larger model: start from the base cell
            b = base.setting
            k = self._search(
                "lr (from the base cell)",
                [b.k + o for o in self.p.transfer_grid],
                lambda x: Setting(x, b.j, b.wd),
                1,
            )
            return Tuned(Setting(k, b.j, b.wd), self.history, self.edge)
        k = self._search("lr", self.p.lr_grid, lambda x: Setting(x, 0, wd0), 1)
        j = 0
        if self.arm.side:
            j = self._search(
                "AdamW-side lr multiple",
                self.p.side_grid,
                lambda x: Setting(k, x, wd0),
                self.p.side_grid[1] - self.p.side_grid[0] if len(self.p.side_grid) > 1 else 1,
            )
        wd = self._wd(k, j) if self.arm.tune_wd else wd0
        return Tuned(Setting(k, j, wd), self.history, self.edge)


# ----------------------------------------------------------------------------- timing


@dataclass(frozen=True)
class TimingSpec:
    """Per-step CPU time of ``arm`` relative to ``ref`` on ``task``, measured interleaved in one
    process (one thread) so both see the same machine load."""

    task: str
    arm: RunSpec
    ref: RunSpec
    steps: int
    warmup: int

    @property
    def run_id(self) -> str:
        import hashlib

        blob = json.dumps(
            {
                "task": self.task,
                "arm": self.arm.to_dict(),
                "ref": self.ref.to_dict(),
                "steps": self.steps,
                "warmup": self.warmup,
                "code": 2,  # see REPORT_SUITE
            },
            sort_keys=True,
        )
        return f"timing-{self.task}-{self.arm.optimizer}-{hashlib.sha256(blob.encode()).hexdigest()[:10]}"


def time_pair(spec: TimingSpec, out_dir: str) -> Result:
    """Run :class:`TimingSpec` and write ``<out_dir>/timing/<run_id>.json``."""
    from rootopt._threads import one_thread

    with one_thread():
        return _time_pair(spec, out_dir)


def _time_pair(spec: TimingSpec, out_dir: str) -> Result:
    import torch

    from rootopt._atomic import atomic_write
    from rootopt.bench.runner import build_optimizer
    from rootopt.bench.tasks import load_task_data, task
    from rootopt.train.model import loss_fn

    t = task(spec.task)
    data = load_task_data(spec.task)
    sides = []
    for rs in (spec.arm, spec.ref):
        torch.manual_seed(0)
        model = t.model()
        opt = build_optimizer(rs, model)
        sides.append((model, opt, torch.Generator().manual_seed(7)))
    times: list[list[float]] = [[], []]
    for i in range(spec.warmup + spec.steps):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for which in order:
            model, opt, gen = sides[which]
            x, y = t.batch(data, gen)
            c0 = time.process_time()
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
            opt.step()
            dt = time.process_time() - c0
            if i >= spec.warmup:
                times[which].append(dt)
    arm_s, ref_s = (statistics.median(ts) for ts in times)
    result = {
        "run_id": spec.run_id,
        "task": spec.task,
        "arm_step_s": arm_s,
        "ref_step_s": ref_s,
        "ratio": arm_s / ref_s,
        "steps": spec.steps,
    }
    atomic_write(Path(out_dir) / "timing" / f"{spec.run_id}.json", json.dumps(result).encode())
    return result


# ----------------------------------------------------------------------------- the walk


Job = RunSpec | TimingSpec


@dataclass
class ArmCell:
    arm: Arm
    cell: Cell
    tuned: Tuned | None = None
    report: list[Result] | None = None  # one per report seed, in order
    equal_compute: list[Result] | None = None
    equal_compute_steps: int | None = None


@dataclass
class Walk:
    """Everything known after one pass over the protocol, and the jobs still needed (in
    priority order)."""

    proto: Protocol
    jobs: list[tuple[tuple[int, ...], Job]] = field(default_factory=list)
    cells: dict[tuple[str, str], ArmCell] = field(default_factory=dict)
    arms: dict[str, Arm] = field(default_factory=dict)
    timing: dict[tuple[str, str], float] = field(default_factory=dict)  # (arm, task) -> ratio
    decisions: dict[str, Any] = field(default_factory=dict)
    robustness: dict[str, Any] | None = None
    complete: bool = False

    def need(self, prio: tuple[int, ...], specs: Sequence[Job]) -> None:
        self.jobs.extend((prio, s) for s in specs)

    def get(self, arm: str, cell: str) -> ArmCell | None:
        return self.cells.get((arm, cell))


# Report runs (and the robustness runs) carry their own suite name: when the code under study
# changes after tuning, bumping REPORT_SUITE reruns exactly the evidence, not the tuning.
# Version 2: the report runs, the step-time ratios and the robustness runs were redone on the
# one-update code (docs/performance.md), which rounds differently (~1e-3 in a final loss) from
# the code the selection runs used; selection runs were not redone (docs/benchmarks.md).
REPORT_SUITE = "study-report-v2"
ROBUST_SUITE = "study-robust-v2"


def _report_specs(p: Protocol, ac: ArmCell, steps: int | None = None) -> list[RunSpec]:
    assert ac.tuned is not None
    return [
        make_spec(
            ac.arm, ac.cell, ac.tuned.setting, sd, p.per_decade, steps=steps, suite=REPORT_SUITE
        )
        for sd in p.report_seeds
    ]


def _study_arm_cell(
    w: Walk, arm: Arm, cell: Cell, lookup: Lookup, level: int, order: int
) -> ArmCell:
    p = w.proto
    ac = w.cells.setdefault((arm.name, cell.name), ArmCell(arm, cell))
    w.arms.setdefault(arm.name, arm)
    prio = (level, p.cells.index(cell), order)
    base: Tuned | None = None
    if cell.base is not None:
        b = w.get(arm.name, cell.base)
        if b is None or b.tuned is None:
            return ac  # waits for the base cell
        base = b.tuned
    try:
        ac.tuned = Tuner(p, arm, cell, lookup).tune(base)
    except Needs as n:
        w.need(prio, n.specs)
        return ac
    specs = _report_specs(p, ac)
    res = [lookup(s) for s in specs]
    if any(r is None for r in res):
        w.need(prio, [s for s, r in zip(specs, res, strict=True) if r is None])
    else:
        ac.report = [r for r in res if r is not None]
    return ac


def _timing(w: Walk, arm: Arm, task: str, timing_lookup: Callable[[str], Result | None]) -> None:
    p = w.proto
    cell = next(c for c in p.cells if c.task == task)
    ref = next(a for a in REFERENCES if a.name == "adamw")
    spec = TimingSpec(
        task,
        make_spec(arm, cell, Setting(0), 0, p.per_decade),
        make_spec(ref, cell, Setting(0), 0, p.per_decade),
        p.timing_steps,
        p.timing_warmup,
    )
    r = timing_lookup(spec.run_id)
    if r is None:
        w.need((0, 0, 0), [spec])
    else:
        w.timing[(arm.name, task)] = float(r["ratio"])


def cost(w: Walk, arm: str) -> float | None:
    """Geometric mean over the study's tasks of the arm's step time relative to AdamW."""
    tasks = sorted({c.task for c in w.proto.cells})
    ratios = [w.timing.get((arm, t)) for t in tasks]
    if any(r is None for r in ratios):
        return None
    return math.exp(statistics.fmean(math.log(r) for r in ratios if r is not None))


def _test_losses(rs: Sequence[Result]) -> list[float]:
    return [float(r["final_test_loss"]) if not r["diverged"] else math.nan for r in rs]


def decide(
    w: Walk, names: Sequence[str], key: str, cells: Sequence[Cell] | None = None
) -> dict[str, Any] | None:
    """The preregistered rule (docs/benchmarks.md): on every cell, a candidate is *worse* when
    one of its report runs diverged or its paired difference to the cell's best candidate has a
    95 % interval above zero. The tied-best candidates are those worse on the fewest cells;
    among them the cheapest (step time within ``cost_tie`` counts as equal) wins, then the best
    mean rank over cells, then the earlier name (the current default is listed first)."""
    p = w.proto
    costs = {n: cost(w, n) for n in names}
    if any(c is None for c in costs.values()):
        return None
    per_cell: dict[str, Any] = {}
    worse = {n: 0 for n in names}
    ranks: dict[str, list[int]] = {n: [] for n in names}
    for cell in p.cells if cells is None else cells:
        acs = [w.get(n, cell.name) for n in names]
        if any(ac is None or ac.report is None for ac in acs):
            return None
        losses = {
            n: _test_losses(ac.report) for n, ac in zip(names, acs, strict=True) if ac and ac.report
        }
        means = {
            n: (statistics.fmean(v) if all(map(math.isfinite, v)) else math.inf)
            for n, v in losses.items()
        }
        best = min(names, key=lambda n: (means[n], names.index(n)))
        order = sorted(names, key=lambda n: (means[n], names.index(n)))
        rows = {}
        for n in names:
            ranks[n].append(order.index(n) + 1)
            diverged = not math.isfinite(means[n])
            ci = None
            if not diverged and n != best and math.isfinite(means[best]):
                ci = paired_ci(losses[n], losses[best])
            is_worse = diverged or (ci is not None and ci.lo > 0)
            worse[n] += int(is_worse)
            rows[n] = {
                "mean_test_loss": means[n],
                "vs_best": ci.as_dict() if ci else None,
                "worse": is_worse,
            }
        per_cell[cell.name] = {"best": best, "rows": rows}
    fewest = min(worse.values())
    tied = [n for n in names if worse[n] == fewest]
    cheapest = min(costs[n] for n in tied)  # type: ignore[type-var]
    cheap = [n for n in tied if costs[n] <= cheapest * (1 + p.cost_tie)]  # type: ignore[operator]
    winner = min(cheap, key=lambda n: (statistics.fmean(ranks[n]), names.index(n)))
    return {
        "key": key,
        "candidates": list(names),
        "winner": winner,
        "worse_on_cells": worse,
        "tied_best": tied,
        "cost_vs_adamw": costs,
        "cheapest_tied": cheap,
        "mean_rank": {n: statistics.fmean(r) for n, r in ranks.items()},
        "cells": per_cell,
    }


def _final_arm(w: Walk, chosen: Arm, q: Any, dtype: str) -> Arm:
    opts = dict(chosen.options)
    opts.update(outlier_quantile=q, ns_dtype=dtype)
    for a in w.arms.values():
        if a.optimizer == chosen.optimizer and dict(a.options) == opts:
            return a
    name = f"{chosen.name}{'-noq' if q is None else ''}{'-bf16' if dtype == 'bfloat16' else ''}"
    return chosen.with_options(name, f"{chosen.label}, q={q}, {dtype}", **opts)


def walk(proto: Protocol, lookup: Lookup, timing_lookup: Callable[[str], Result | None]) -> Walk:
    """One pass over the protocol: what is known, and the jobs still needed."""
    w = Walk(proto)
    p = proto
    stage1 = (*COEFFICIENT_CANDIDATES, *REFERENCES)

    def study(arms: Sequence[Arm], level: int, cells: Sequence[Cell] | None = None) -> None:
        for cell in cells if cells is not None else p.cells:
            for i, arm in enumerate(arms):
                _study_arm_cell(w, arm, cell, lookup, level + (cell.base is not None), i)

    def timing(arms: Sequence[Arm]) -> None:
        for arm in arms:
            for task in sorted({c.task for c in p.cells}):
                _timing(w, arm, task, timing_lookup)

    timing(stage1)
    first = [c for c in p.cells if c.base is None]
    study(stage1, 10, first)
    names = [a.name for a in COEFFICIENT_CANDIDATES]
    screen = decide(w, names, "screening", first)
    d1 = None
    if screen is not None:
        survivors = [n for n in names if screen["worse_on_cells"][n] < p.screen_worse]
        w.decisions["screening"] = {**screen, "survivors": survivors}
        refs = [a for a in REFERENCES if a.name != "muon-fp32"]
        study([*(w.arms[n] for n in survivors), *refs], 10, [c for c in p.cells if c.base])
        d1 = decide(w, survivors, "ns_coefficients")
    final: Arm | None = None
    if d1 is not None:
        w.decisions["ns_coefficients"] = d1
        chosen = w.arms[d1["winner"]]
        noq = _final_arm(w, chosen, None, chosen.option("ns_dtype"))
        bf16 = _final_arm(w, chosen, chosen.option("outlier_quantile"), "bfloat16")
        stage2 = [noq, bf16]
        timing(stage2)
        study(stage2, 20)
        abl = [p.cell(c) for c in p.ablation_cells]
        q_ablations = [
            chosen.with_options(
                f"{chosen.name}-q{q:g}", f"{chosen.label}, q={q:g}", outlier_quantile=q
            )
            for q in (0.8, 0.99)
        ]
        study([*q_ablations, *ABLATIONS], 50, abl)
        d2 = decide(w, [chosen.name, noq.name], "outlier_quantile")
        d3 = decide(w, [chosen.name, bf16.name], "ns_dtype")
        if d2 is not None and d3 is not None:
            w.decisions["outlier_quantile"] = d2
            w.decisions["ns_dtype"] = d3
            q = w.arms[d2["winner"]].option("outlier_quantile")
            dtype = w.arms[d3["winner"]].option("ns_dtype")
            final = _final_arm(w, chosen, q, dtype)
            timing([final])
            study([final], 30)
            w.decisions["final"] = final.name
    # Equal compute: each arm gets the steps that cost what the cell's steps cost AdamW.
    for cell in (c for c in p.cells if c.base is None):
        for i, name in enumerate(list(w.arms)):
            ac = w.get(name, cell.name)
            ratio = w.timing.get((name, cell.task))
            if ac is None or ac.tuned is None or ratio is None:
                continue
            steps = max(1, round(cell.steps / ratio))
            ac.equal_compute_steps = steps
            specs = _report_specs(p, ac, steps=steps)
            res = [lookup(s) for s in specs]
            if any(r is None for r in res):
                w.need(
                    (40, p.cells.index(cell), i),
                    [s for s, r in zip(specs, res, strict=True) if r is None],
                )
            else:
                ac.equal_compute = [r for r in res if r is not None]
    if final is not None:
        _robustness(w, final, lookup)
    w.jobs.sort(key=lambda pj: pj[0])
    w.complete = not w.jobs and final is not None
    return w


def _robustness(w: Walk, final: Arm, lookup: Lookup) -> None:
    """Each arm at its tuned setting on the robustness cell, without gradient clipping unless
    the arm is a ``+clip`` one; degradation = loss under a condition minus the same arm's clean
    loss, paired by seed."""
    p = w.proto
    cell = p.cell(p.robust_cell)
    old = COEFFICIENT_CANDIDATES[0]
    noq = _final_arm(w, final, None, final.option("ns_dtype"))
    entries: list[tuple[str, Arm, float | None]] = []
    for arm in dict.fromkeys([final, old, noq]):
        entries.append((arm.name, arm, None))
    for ref in ("muon-bf16", "adamw"):
        arm = w.arms[ref]
        entries += [(ref, arm, None), (f"{ref}+clip", arm, 1.0)]
    table: dict[str, Any] = {}
    for i, (label, arm, clip) in enumerate(entries):
        ac = w.get(arm.name, cell.name)
        if ac is None or ac.tuned is None:
            return
        rows: dict[str, list[Result]] = {}
        for cond, corr, mult in p.robust_conditions:
            specs = [
                make_spec(
                    arm,
                    cell,
                    ac.tuned.setting,
                    sd,
                    p.per_decade,
                    suite=ROBUST_SUITE,
                    clip=clip,
                    corruption=corr,
                    lr_mult=mult,
                )
                for sd in p.report_seeds
            ]
            res = [lookup(s) for s in specs]
            if any(r is None for r in res):
                w.need((45, i, 0), [s for s, r in zip(specs, res, strict=True) if r is None])
                continue
            rows[cond] = [r for r in res if r is not None]
        table[label] = {"arm": arm.name, "clip": clip, "runs": rows}
    w.robustness = table


# ----------------------------------------------------------------------------- running


def _run_job(job: Job, out_dir: str) -> Result:
    """Worker entry: one run or one timing job. A run that raises (e.g. an SVD that does not
    converge on a non-finite matrix) is recorded as diverged with the error, not retried."""
    from rootopt.bench.runner import FORMAT, run_one

    if isinstance(job, TimingSpec):
        return time_pair(job, out_dir)
    try:
        return run_one(job, out_dir)
    except Exception as exc:  # the optimizer setting failed; keep the study going
        from rootopt._atomic import atomic_write

        r: Result = {
            "format": FORMAT,
            "run_id": job.run_id,
            "spec": job.to_dict(),
            "initial_val_loss": math.nan,
            "final_val_loss": math.nan,
            "final_val_acc": None,
            "final_test_loss": math.nan,
            "final_test_acc": None,
            "last_eval": {},
            "evals": [],
            "train_loss": [],
            "diverged": True,
            "error": f"{type(exc).__name__}: {exc}"[:500],
            "steps_done": 0,
            "step_time_s": None,
            "train_cpu_s": 0.0,
            "wall_s": 0.0,
        }
        atomic_write(Path(out_dir) / "runs" / f"{job.run_id}.json", json.dumps(r).encode())
        return r


def _load_dir(path: Path) -> dict[str, Result]:
    out: dict[str, Result] = {}
    if not path.is_dir():
        return out
    for f in path.glob("*.json"):
        try:
            r = json.loads(f.read_text())
        except (OSError, ValueError):
            continue  # torn or foreign: the job is redone
        if isinstance(r, dict) and r.get("run_id") == f.stem:
            out[f.stem] = r
    return out


def run_study(
    proto: Protocol,
    out: Path,
    *,
    workers: int,
    compute: bool = True,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> Walk:
    """Run every job the protocol still needs (highest priority first, re-planning after each
    finished job) and return the final :class:`Walk`. ``compute=False`` runs nothing."""
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait

    from rootopt.bench.runner import FORMAT, _worker_init

    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "timing").mkdir(parents=True, exist_ok=True)
    runs = {k: r for k, r in _load_dir(out / "runs").items() if r.get("format") == FORMAT}
    timings = _load_dir(out / "timing")

    def lookup(spec: RunSpec) -> Result | None:
        return runs.get(spec.run_id)

    w = walk(proto, lookup, timings.get)
    if not compute or not w.jobs:
        return w
    done = 0
    t0 = time.perf_counter()
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init) as pool:
        pending: dict[Future[Result], Job] = {}
        while True:
            ids = {j.run_id for j in pending.values()}
            for _, job in w.jobs:
                if len(pending) >= workers + 1:
                    break
                if job.run_id not in ids:
                    pending[pool.submit(_run_job, job, str(out))] = job
                    ids.add(job.run_id)
            if not pending:
                break
            finished, _ = wait(list(pending), return_when=FIRST_COMPLETED)
            for fut in finished:
                job = pending.pop(fut)
                r = fut.result()
                done += 1
                if isinstance(job, TimingSpec):
                    timings[job.run_id] = r
                    line = f"timing {job.task} {job.arm.optimizer} {dict(job.arm.options)}: ×{r['ratio']:.3f} of AdamW"
                else:
                    runs[job.run_id] = r
                    status = (
                        f"DIVERGED ({r['error'][:60]})"
                        if r["diverged"]
                        else f"val {r['final_val_loss']:.4f}"
                    )
                    line = (
                        f"{job.suite} {job.task}@{job.steps} {job.optimizer} "
                        f"{','.join(f'{k}={v}' for k, v in job.options if k != 'ortho_method')} "
                        f"lr {job.lr:.3g} side ×{job.side_lr_mult:g} wd {job.weight_decay:g} "
                        f"seed {job.seed}: {status} ({r['wall_s']:.0f}s)"
                    )
                if progress:
                    el = time.perf_counter() - t0
                    say(
                        f"[study {done} done, {len(pending)} running, {len(w.jobs)} ready, {el:.0f}s] {line}"
                    )
            w = walk(proto, lookup, timings.get)
    return w


# ----------------------------------------------------------------------------- summary


def _losses(rs: Sequence[Result] | None, key: str = "final_test_loss") -> list[float] | None:
    if rs is None:
        return None
    return [float(r[key]) if not r["diverged"] else math.nan for r in rs]


def _ci_or_none(xs: Sequence[float] | None) -> dict[str, Any] | None:
    if xs is None or len(xs) < 2 or not all(map(math.isfinite, xs)):
        return None
    return mean_ci(xs).as_dict()


COMPARISONS: tuple[tuple[str, str, str], ...] = (
    # (label, a, b): the paired difference a − b in test loss (negative: a is better)
    ("selector: AdaNewton − AdaNewton without selector", "root-adanewton", "root-adanewton-static"),
    ("AdaNewton − Muon's coefficients (both ROOT, fp32)", "root-adanewton", "root-muon"),
    ("new default − old default", "@final", "root-adanewton"),
    ("new default − Muon bf16 (torch.optim.Muon)", "@final", "muon-bf16"),
    ("new default − Muon fp32", "@final", "muon-fp32"),
    ("new default − AdamW", "@final", "adamw"),
    ("ROOT fp32 − Muon fp32 (precision-matched)", "@chosen", "muon-fp32"),
    ("ROOT bf16 − Muon bf16 (precision-matched)", "@chosen-bf16", "muon-bf16"),
    ("threshold on − off", "@chosen", "@chosen-noq"),
    ("bf16 − fp32 iterations", "@chosen-bf16", "@chosen"),
    ("Muon bf16 − AdamW", "muon-bf16", "adamw"),
)


def _resolve_name(w: Walk, name: str) -> str | None:
    if not name.startswith("@"):
        return name
    d1 = w.decisions.get("ns_coefficients")
    if name == "@final":
        return w.decisions.get("final")
    if d1 is None:
        return None
    chosen = w.arms[d1["winner"]]
    if name == "@chosen":
        return chosen.name
    if name == "@chosen-noq":
        return _final_arm(w, chosen, None, chosen.option("ns_dtype")).name
    if name == "@chosen-bf16":
        return _final_arm(w, chosen, chosen.option("outlier_quantile"), "bfloat16").name
    raise KeyError(name)


def _lr_sensitivity(t: Tuned | None) -> dict[str, Any] | None:
    """From the first lr search: how many grid points lie within 5 % of the best validation
    loss, and the worst/best ratio over the points that did not diverge."""
    if t is None or not t.history or not t.history[0]["phase"].startswith("lr"):
        return None
    pts = t.history[0]["points"]
    vals = [pt["val_loss"] for pt in pts]
    finite = [v for v in vals if v is not None and math.isfinite(v)]
    if not finite:
        return {
            "points": len(vals),
            "within_5pct": 0,
            "worst_over_best": None,
            "diverged": len(vals),
        }
    best = min(finite)
    return {
        "points": len(vals),
        "within_5pct": sum(v <= 1.05 * best for v in finite),
        "worst_over_best": max(finite) / best,
        "diverged": len(vals) - len(finite),
    }


def _steps_to_target(rows: dict[str, Any], seeds: Sequence[int]) -> None:
    """Per report seed, the first evaluated step whose test loss is at or below AdamW's mean
    final test loss on the cell (None: not reached within the schedule)."""
    adamw = rows.get("adamw")
    if not adamw or not adamw["test_loss_ci"]:
        return
    target = adamw["test_loss_ci"]["mean"]
    for r in rows.values():
        if not r["curves"]:
            continue
        r["steps_to_adamw"] = [
            next(
                (
                    s
                    for s, v in zip(cv["steps"], cv["test_loss"], strict=True)
                    if s > 0 and v <= target
                ),
                None,
            )
            for cv in r["curves"]
        ]
        r["adamw_target"] = target


def summarize(w: Walk, meta: dict[str, Any]) -> dict[str, Any]:
    """The study as JSON-able data: settings, per-arm results, comparisons, decisions."""
    p = w.proto
    arms: dict[str, Any] = {}
    for name, arm in w.arms.items():
        arms[name] = {
            "label": arm.label,
            "optimizer": arm.optimizer,
            "options": dict(arm.options),
            "cost_vs_adamw": cost(w, name),
            "timing": {t: r for (a, t), r in w.timing.items() if a == name},
        }
    cells: dict[str, Any] = {}
    for c in p.cells:
        rows: dict[str, Any] = {}
        for name in w.arms:
            ac = w.get(name, c.name)
            if ac is None:
                continue
            test = _losses(ac.report)
            val = _losses(ac.report, "final_val_loss")
            eq = _losses(ac.equal_compute)
            rows[name] = {
                "setting": ac.tuned.setting.as_dict(ac.arm, p.per_decade) if ac.tuned else None,
                "edge": ac.tuned.edge if ac.tuned else None,
                "history": ac.tuned.history if ac.tuned else None,
                "test_loss": test,
                "test_loss_ci": _ci_or_none(test),
                "val_loss": val,
                "test_acc": [r["final_test_acc"] for r in ac.report] if ac.report else None,
                "diverged": sum(bool(r["diverged"]) for r in ac.report) if ac.report else None,
                "equal_compute_steps": ac.equal_compute_steps,
                "equal_compute_test_loss": eq,
                "equal_compute_ci": _ci_or_none(eq),
                "curves": [
                    {
                        "steps": [e["step"] for e in r["evals"]],
                        "test_loss": [e["test_loss"] for e in r["evals"]],
                    }
                    for r in ac.report
                ]
                if ac.report
                else None,
                "smoothness": [
                    smoothness(r["train_loss"], skip=max(1, c.steps // 10)) for r in ac.report
                ]
                if ac.report
                else None,
                "lr_sensitivity": _lr_sensitivity(ac.tuned),
            }
        _steps_to_target(rows, p.report_seeds)
        cells[c.name] = {"task": c.task, "steps": c.steps, "base": c.base, "arms": rows}
    comparisons: list[dict[str, Any]] = []
    for label, a0, b0 in COMPARISONS:
        a, b = _resolve_name(w, a0), _resolve_name(w, b0)
        if a is None or b is None or a == b:
            continue
        per: dict[str, Any] = {}
        for c in p.cells:
            for kind, key in (
                ("equal steps", "test_loss"),
                ("equal compute", "equal_compute_test_loss"),
            ):
                ra, rb = cells[c.name]["arms"].get(a), cells[c.name]["arms"].get(b)
                if not ra or not rb or ra[key] is None or rb[key] is None:
                    continue
                xa, xb = ra[key], rb[key]
                if len(xa) != len(xb) or not all(map(math.isfinite, [*xa, *xb])):
                    per.setdefault(c.name, {})[kind] = None
                    continue
                per.setdefault(c.name, {})[kind] = paired_ci(xa, xb).as_dict()
        comparisons.append({"label": label, "a": a, "b": b, "cells": per})
    robust: dict[str, Any] | None = None
    if w.robustness is not None:
        robust = {
            "cell": p.robust_cell,
            "conditions": [c for c, _, _ in p.robust_conditions],
            "arms": {},
        }
        for label, entry in w.robustness.items():
            runs = entry["runs"]
            clean = _losses(runs.get("clean"))
            rows2: dict[str, Any] = {}
            for cond, rs in runs.items():
                xs = _losses(rs)
                assert xs is not None
                deg = None
                if clean is not None and cond != "clean" and all(map(math.isfinite, [*xs, *clean])):
                    deg = paired_ci(xs, clean).as_dict()
                rows2[cond] = {
                    "test_loss": xs,
                    "diverged": sum(bool(r["diverged"]) for r in rs),
                    "test_loss_ci": _ci_or_none(xs),
                    "degradation": deg,
                }
            robust["arms"][label] = {
                "arm": entry["arm"],
                "clip": entry["clip"],
                "conditions": rows2,
            }
    return {
        "format": 1,
        "meta": meta,
        "protocol": _protocol_dict(p),
        "complete": w.complete,
        "jobs_left": len(w.jobs),
        "arms": arms,
        "cells": cells,
        "decisions": w.decisions,
        "comparisons": comparisons,
        "robustness": robust,
    }


def _protocol_dict(p: Protocol) -> dict[str, Any]:
    d = asdict(p)
    d["robust_conditions"] = [
        {"label": lbl, "corruption": asdict(c), "lr_mult": m} for lbl, c, m in p.robust_conditions
    ]
    return d


def iter_runs(w: Walk) -> Iterator[tuple[str, str, Result]]:
    """(arm, cell, result) of every report run (for plots)."""
    for (arm, cell), ac in w.cells.items():
        for r in ac.report or []:
            yield arm, cell, r
