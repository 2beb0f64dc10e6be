"""The defaults study: which ``ns_coefficients``, ``outlier_quantile`` and ``ns_dtype`` ROOT
defaults to, decided by paired training evidence (protocol v2: docs/benchmarks-v2.md).

The whole study is plain data (:class:`Protocol`, :class:`Arm`, :class:`Cell`) plus pure
functions that, given the finished runs, say which runs are still needed (:func:`walk`) and
what was found (:func:`summarize`). :func:`run_study` keeps a pool of worker processes busy with
the needed runs, highest priority first, and walks the protocol again after every finished
run; each finished run is one line of the study directory's ``runs.jsonl``
(:mod:`rootopt_analysis.bench.store`), so an interrupted study resumes where it stopped, from the
directory it ran in or from a committed copy of its record.

Three disjoint seed sets: selection seeds tune each arm (validation split: the matrix lr on a
quarter-decade grid that extends itself on an edge, the AdamW side's lr multiple, the weight
decay); decision seeds feed the decision rule (validation split); report seeds give every
reported number (test split), each claim a paired difference with a 95 % interval. Beside the
decision: the robustness family (a common absolute lr grid, with and without clipping,
injected gradient corruption, Holm-corrected between-arm comparisons), a long horizon and a
bf16-autocast cell.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any
from typing import Protocol as Interface

from rootopt_analysis.bench.runner import Corruption, RunSpec
from rootopt_analysis.bench.stats import holm, mean_ci, paired_ci, paired_p
from rootopt_analysis.bench.store import Store, commit_of, read_sessions

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
# (tests/test_study.py checks this for every shape the study trains). "adanewton-static" is an
# alias of "adanewton" since the selector was removed (v1's decision), so it is no arm either.
COEFFICIENT_CANDIDATES: tuple[Arm, ...] = (
    # Order matters only for exact ties: the current default first.
    root_arm("root-muon", "ROOT, Muon's coefficients", ns_coefficients="muon"),
    root_arm("root-adanewton", "ROOT, AdaNewton (per-shape table)"),
    root_arm("root-polar", "ROOT, Polar Express", ns_coefficients="polar_express"),
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
# ROOT as shipped when protocol v2 was written (Muon's coefficients, q = 0.9, float32): the arm
# of the robustness family, the long horizon and the autocast cell, which do not wait for the
# coefficient decision (docs/benchmarks.md, protocol v2).
SHIPPED = "root-muon"
# The robustness family's optimizers: ROOT, Muon at ROOT's Newton-Schulz precision,
# torch.optim.Muon, AdamW.
ROBUST_ARMS = (SHIPPED, "muon-fp32", "muon-bf16", "adamw")
LONG_ARMS = (SHIPPED, "muon-fp32", "muon-bf16")
AMP_ARMS = (SHIPPED, "muon-fp32", "muon-bf16", "adamw")
DEFAULT_WD = 0.1


def arm_by_name(name: str) -> Arm:
    for a in (*COEFFICIENT_CANDIDATES, *REFERENCES, *ABLATIONS):
        if a.name == name:
            return a
    raise KeyError(name)


@dataclass(frozen=True)
class Cell:
    """A task trained for ``steps`` steps. ``base``: the cell whose tuned setting this one
    starts from (its AdamW-side lr and decay are inherited, its lr grid is centred on the
    base's optimum); None: tuned from scratch. ``precision``: "bf16" trains under bf16
    autocast (the runner's RunSpec.precision)."""

    task: str
    steps: int
    base: str | None = None
    precision: str = "fp32"

    @property
    def name(self) -> str:
        amp = "-amp" if self.precision != "fp32" else ""
        return f"{self.task}{amp}@{self.steps}"


@dataclass(frozen=True)
class Protocol:
    cells: tuple[Cell, ...]  # the decision cells
    selection_seeds: tuple[int, ...]
    decision_seeds: tuple[int, ...]
    report_seeds: tuple[int, ...]
    lr_grid: tuple[int, ...]  # exponents k of base_lr·10^(k/4)
    transfer_grid: tuple[int, ...]  # offsets of k around a base cell's optimum
    side_grid: tuple[int, ...]  # exponents j of the AdamW-side multiple 10^(j/4)
    wd_grid: tuple[float, ...]
    wd_extension: float  # tried when the largest decay of the grid is best
    max_extensions: int
    ablation_cells: tuple[str, ...]
    ablation_quantiles: tuple[float, ...]
    # A coefficient candidate worse (by the decision rule) on at least this many of the
    # default-horizon cells is screened out before the longer horizons and the larger model.
    screen_worse: int
    robust_cells: tuple[str, ...]
    robust_conditions: tuple[tuple[str, Corruption], ...]
    robust_wd: float  # the family's common weight decay
    sweep_k: tuple[int, int]  # first and last k of the common absolute lr grid
    sweep_stop: int  # consecutive all-diverged points that end an optimizer's sweep
    lr_region: tuple[int, ...]  # the k whose mean loss is the lr-stability degradation
    long_cell: Cell | None
    long_quantiles: tuple[float, ...]
    amp_cell: Cell | None
    timing_steps: int
    timing_warmup: int
    cost_tie: float  # relative step-cost difference treated as equal
    per_decade: int = 4

    @staticmethod
    def full() -> Protocol:
        """Protocol v2 (docs/benchmarks-v2.md)."""
        corruptions = (
            ("t(2) noise ×2", Corruption("student_t", scale=2.0, df=2)),
            ("outliers 0.1% ×100", Corruption("outliers", scale=100.0, rate=1e-3)),
            ("outliers 1% ×100", Corruption("outliers", scale=100.0, rate=1e-2)),
        )
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
            decision_seeds=(200, 201, 202, 203, 204),
            report_seeds=(0, 1, 2, 3, 4),
            lr_grid=(-1, 0, 1, 2, 3, 4),
            transfer_grid=(-1, 0, 1),
            side_grid=(-4, -2, 0),
            wd_grid=(0.0, 0.1, 0.3),
            wd_extension=1.0,
            max_extensions=4,
            ablation_cells=("stdlib@150",),
            ablation_quantiles=(0.8, 0.95, 0.99),
            screen_worse=2,
            robust_cells=("stdlib@150", "kjv@150"),
            robust_conditions=corruptions,
            robust_wd=0.1,
            sweep_k=(0, 14),
            sweep_stop=2,
            lr_region=(6, 7, 8, 9, 10),
            long_cell=Cell("stdlib", 2400, base="stdlib@600"),
            long_quantiles=(0.8, 0.95),
            amp_cell=Cell("stdlib", 150, base="stdlib@150", precision="bf16"),
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
            decision_seeds=(200, 201),
            report_seeds=(0, 1),
            lr_grid=(0, 4),
            transfer_grid=(0,),
            side_grid=(0, 4),
            wd_grid=(0.1,),
            wd_extension=0.3,
            max_extensions=1,
            ablation_cells=(),
            ablation_quantiles=(),
            screen_worse=1,
            robust_cells=("digits@6",),
            robust_conditions=(
                ("outliers 1% ×100", Corruption("outliers", scale=100.0, rate=1e-2)),
            ),
            robust_wd=0.1,
            sweep_k=(2, 6),
            sweep_stop=1,
            lr_region=(4, 5, 6),
            long_cell=Cell("digits", 24, base="digits@12"),
            long_quantiles=(0.8,),
            amp_cell=Cell("digits", 6, base="digits@6", precision="bf16"),
            timing_steps=3,
            timing_warmup=1,
            cost_tie=0.03,
        )

    @property
    def all_cells(self) -> tuple[Cell, ...]:
        extra = tuple(c for c in (self.long_cell, self.amp_cell) if c is not None)
        return (*self.cells, *extra)

    def cell(self, name: str) -> Cell:
        for c in self.all_cells:
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
    suite: str = "study-select-v3",
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
        precision=cell.precision,
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
    process (one thread) so both see the same machine load. A cost for the decision's tie-break
    (within ``cost_tie``), never a budget."""

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
                "code": 3,  # see REPORT_SUITE
            },
            sort_keys=True,
        )
        return f"timing-{self.task}-{self.arm.optimizer}-{hashlib.sha256(blob.encode()).hexdigest()[:10]}"


@dataclass(frozen=True)
class FlopSpec:
    """The floating-point operations of one training step of ``arm`` (forward, backward and
    optimizer step) as ``torch.utils.flop_counter.FlopCounterMode`` counts them: the budget
    unit of the equal-compute runs (a count, so it does not depend on the machine's load)."""

    task: str
    arm: RunSpec

    @property
    def run_id(self) -> str:
        import hashlib

        blob = json.dumps({"task": self.task, "arm": self.arm.to_dict(), "code": 1}, sort_keys=True)
        return f"flops-{self.task}-{self.arm.optimizer}-{hashlib.sha256(blob.encode()).hexdigest()[:10]}"


def time_pair(spec: TimingSpec, out_dir: str) -> Result:
    """Run :class:`TimingSpec` and write ``<out_dir>/timing/<run_id>.json``."""
    from rootopt._threads import one_thread

    with one_thread():
        return _time_pair(spec, out_dir)


def _time_pair(spec: TimingSpec, out_dir: str) -> Result:
    import torch

    from rootopt._atomic import atomic_write
    from rootopt.tasks import load_task_data, task
    from rootopt.train.models import loss_fn
    from rootopt_analysis.bench.runner import build_optimizer

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
        "kind": "timing",
        "task": spec.task,
        "arm_step_s": arm_s,
        "ref_step_s": ref_s,
        "ratio": arm_s / ref_s,
        "steps": spec.steps,
    }
    atomic_write(Path(out_dir) / "timing" / f"{spec.run_id}.json", json.dumps(result).encode())
    return result


def count_flops(spec: FlopSpec, out_dir: str) -> Result:
    """Run :class:`FlopSpec` (one warm-up step, then one counted step) and write its result."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from rootopt._atomic import atomic_write
    from rootopt._threads import one_thread
    from rootopt.tasks import load_task_data, task
    from rootopt.train.models import loss_fn
    from rootopt_analysis.bench.runner import build_optimizer

    with one_thread():
        t = task(spec.task)
        data = load_task_data(spec.task)
        torch.manual_seed(0)
        model = t.model()
        opt = build_optimizer(spec.arm, model)
        gen = torch.Generator().manual_seed(7)
        counted = 0
        for i in range(2):
            x, y = t.batch(data, gen)
            with FlopCounterMode(display=False) as fc:
                loss = loss_fn(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()  # type: ignore[no-untyped-call]
                torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
                opt.step()
            counted = int(fc.get_total_flops()) if i == 1 else 0
    result = {"run_id": spec.run_id, "kind": "flops", "task": spec.task, "flops": counted}
    atomic_write(Path(out_dir) / "timing" / f"{spec.run_id}.json", json.dumps(result).encode())
    return result


# ----------------------------------------------------------------------------- the walk


Job = RunSpec | TimingSpec | FlopSpec


class AnyJob(Interface):
    """What the walk queues: v2's jobs, and v3's kinds (rootopt_analysis.bench.study_v3)."""

    @property
    def run_id(self) -> str: ...


@dataclass
class ArmCell:
    arm: Arm
    cell: Cell
    tuned: Tuned | None = None
    decide: list[Result] | None = None  # one per decision seed, in order
    report: list[Result] | None = None  # one per report seed, in order
    equal_compute: list[Result] | None = None
    equal_compute_steps: int | None = None
    tuned_from: str | None = None  # the arm whose base-cell setting this one started from


@dataclass
class Walk:
    """Everything known after one pass over the protocol, and the jobs still needed (in
    priority order)."""

    proto: Protocol
    jobs: list[tuple[tuple[int, ...], AnyJob]] = field(default_factory=list)
    cells: dict[tuple[str, str], ArmCell] = field(default_factory=dict)
    arms: dict[str, Arm] = field(default_factory=dict)
    timing: dict[tuple[str, str], float] = field(default_factory=dict)  # (arm, task) -> ratio
    flops: dict[tuple[str, str], int] = field(default_factory=dict)  # (arm, task) -> per step
    decisions: dict[str, Any] = field(default_factory=dict)
    # robustness family: (cell, arm, clip) -> {"sweep": {k: results}, "optimum": k,
    # "conditions": {label: results}}
    robust: dict[tuple[str, str, float | None], dict[str, Any]] = field(default_factory=dict)
    # run id -> the (arm, cell, role) that use it (the run index)
    uses: dict[str, set[tuple[str, str, str]]] = field(default_factory=dict)
    complete: bool = False

    def need(self, prio: tuple[int, ...], specs: Sequence[AnyJob]) -> None:
        self.jobs.extend((prio, s) for s in specs)

    def get(self, arm: str, cell: str) -> ArmCell | None:
        return self.cells.get((arm, cell))

    def tagged(self, lookup: Lookup, arm: str, cell: str, role: str) -> Lookup:
        """``lookup`` that records which arm, cell and role each run serves (the index)."""

        def lk(spec: RunSpec) -> Result | None:
            self.uses.setdefault(spec.run_id, set()).add((arm, cell, role))
            return lookup(spec)

        return lk


# Every suite carries the evidence's code generation: when the code under study changes,
# bumping the suffix reruns the evidence. v3: protocol v2 on the code of December 2026, every
# arm re-tuned (v1's selection, report and robustness suites were "study", "study-report-v2"
# and "study-robust-v2"; their runs were not kept).
SELECT_SUITE = "study-select-v3"
DECIDE_SUITE = "study-decide-v3"
REPORT_SUITE = "study-report-v3"
ROBUST_SUITE = "study-robust-v3"
SWEEP_SUITE = "study-sweep-v3"

# Priorities (lower runs first; docs/benchmarks.md, "Budget and priority").
P_COST, P_DECIDE, P_TRANSFER, P_STAGE2, P_REPORT = 0, 10, 11, 20, 30
P_ROBUST, P_LONG, P_AMP, P_ROBUST_NOCLIP, P_EQUAL, P_ABLATION = 35, 40, 42, 45, 50, 60


def _seed_specs(
    p: Protocol, ac: ArmCell, seeds: Sequence[int], suite: str, steps: int | None = None
) -> list[RunSpec]:
    assert ac.tuned is not None
    return [
        make_spec(ac.arm, ac.cell, ac.tuned.setting, sd, p.per_decade, steps=steps, suite=suite)
        for sd in seeds
    ]


def _fetch(
    w: Walk, lookup: Lookup, specs: Sequence[RunSpec], prio: tuple[int, ...]
) -> list[Result] | None:
    res = [lookup(s) for s in specs]
    missing = [s for s, r in zip(specs, res, strict=True) if r is None]
    if missing:
        w.need(prio, missing)
        return None
    return [r for r in res if r is not None]


def _study_arm_cell(
    w: Walk,
    arm: Arm,
    cell: Cell,
    lookup: Lookup,
    tune_prio: tuple[int, ...],
    *,
    decide_prio: tuple[int, ...] | None = None,
    report_prio: tuple[int, ...] | None = None,
    base_arm: str | None = None,
) -> ArmCell:
    """Tune ``arm`` on ``cell`` (from ``base_arm``'s setting on the base cell, default its
    own), then ask for its decision runs and report runs where a priority is given."""
    p = w.proto
    ac = w.cells.setdefault((arm.name, cell.name), ArmCell(arm, cell))
    w.arms.setdefault(arm.name, arm)
    base: Tuned | None = None
    if cell.base is not None:
        src = base_arm or arm.name
        b = w.get(src, cell.base)
        if b is None or b.tuned is None:
            return ac  # waits for the base cell
        base = b.tuned
        ac.tuned_from = src
    if ac.tuned is None:
        try:
            ac.tuned = Tuner(p, arm, cell, w.tagged(lookup, arm.name, cell.name, "selection")).tune(
                base
            )
        except Needs as n:
            w.need(tune_prio, n.specs)
            return ac
    if decide_prio is not None and ac.decide is None:
        lk = w.tagged(lookup, arm.name, cell.name, "decision")
        ac.decide = _fetch(w, lk, _seed_specs(p, ac, p.decision_seeds, DECIDE_SUITE), decide_prio)
    if report_prio is not None and ac.report is None:
        lk = w.tagged(lookup, arm.name, cell.name, "report")
        ac.report = _fetch(w, lk, _seed_specs(p, ac, p.report_seeds, REPORT_SUITE), report_prio)
    return ac


def _cost_jobs(
    w: Walk, arm: Arm, tasks: Sequence[str], timing_lookup: Callable[[str], Result | None]
) -> None:
    p = w.proto
    ref = arm_by_name("adamw")
    for task in tasks:
        cell = next(c for c in p.cells if c.task == task)
        spec = TimingSpec(
            task,
            make_spec(arm, cell, Setting(0), 0, p.per_decade),
            make_spec(ref, cell, Setting(0), 0, p.per_decade),
            p.timing_steps,
            p.timing_warmup,
        )
        r = timing_lookup(spec.run_id)
        if r is None:
            w.need((P_COST,), [spec])
        else:
            w.timing[(arm.name, task)] = float(r["ratio"])
        fs = FlopSpec(task, make_spec(arm, cell, Setting(0), 0, p.per_decade))
        r = timing_lookup(fs.run_id)
        if r is None:
            w.need((P_COST,), [fs])
        else:
            w.flops[(arm.name, task)] = int(r["flops"])


def cost(w: Walk, arm: str) -> float | None:
    """Geometric mean over the study's tasks of the arm's step time relative to AdamW."""
    tasks = sorted({c.task for c in w.proto.cells})
    ratios = [w.timing.get((arm, t)) for t in tasks]
    if any(r is None for r in ratios):
        return None
    return math.exp(statistics.fmean(math.log(r) for r in ratios if r is not None))


def _val_losses(rs: Sequence[Result]) -> list[float]:
    return [float(r["final_val_loss"]) if not r["diverged"] else math.nan for r in rs]


def apply_rule(
    losses: dict[str, dict[str, list[float]]],
    names: Sequence[str],
    costs: dict[str, float],
    cost_tie: float,
) -> dict[str, Any]:
    """The decision rule on plain numbers: ``losses[cell][name]`` per seed (NaN: diverged),
    ``names`` in tie-break order, ``costs`` relative step costs. Pure, so a decision can be
    recomputed from any summary (also v1's)."""
    per_cell: dict[str, Any] = {}
    worse = {n: 0 for n in names}
    ranks: dict[str, list[int]] = {n: [] for n in names}
    for cell, by_name in losses.items():
        means = {
            n: (statistics.fmean(by_name[n]) if all(map(math.isfinite, by_name[n])) else math.inf)
            for n in names
        }
        best = min(names, key=lambda n: (means[n], names.index(n)))
        order = sorted(names, key=lambda n: (means[n], names.index(n)))
        rows = {}
        for n in names:
            ranks[n].append(order.index(n) + 1)
            diverged = not math.isfinite(means[n])
            ci = None
            if not diverged and n != best and math.isfinite(means[best]):
                ci = paired_ci(by_name[n], by_name[best])
            is_worse = diverged or (ci is not None and ci.lo > 0)
            worse[n] += int(is_worse)
            rows[n] = {
                "mean_val_loss": means[n],
                "vs_best": ci.as_dict() if ci else None,
                "worse": is_worse,
            }
        per_cell[cell] = {"best": best, "rows": rows}
    fewest = min(worse.values())
    tied = [n for n in names if worse[n] == fewest]
    cheapest = min(costs[n] for n in tied)
    cheap = [n for n in tied if costs[n] <= cheapest * (1 + cost_tie)]
    winner = min(cheap, key=lambda n: (statistics.fmean(ranks[n]), names.index(n)))
    return {
        "candidates": list(names),
        "winner": winner,
        "worse_on_cells": worse,
        "tied_best": tied,
        "cost_vs_adamw": costs,
        "cheapest_tied": cheap,
        "mean_rank": {n: statistics.fmean(r) for n, r in ranks.items()},
        "cells": per_cell,
    }


def rule_with_stability(
    losses: dict[str, dict[str, list[float]]],
    names: Sequence[str],
    costs: dict[str, float],
    cost_tie: float,
) -> dict[str, Any]:
    """:func:`apply_rule`, plus the winner with each cell left out and the mean loss of each
    candidate over the cells."""
    d = apply_rule(losses, names, costs, cost_tie)
    loo: dict[str, str] = {}
    if len(losses) > 1:
        for c in losses:
            rest = {k: v for k, v in losses.items() if k != c}
            loo[c] = apply_rule(rest, names, costs, cost_tie)["winner"]
    means = {
        n: statistics.fmean(d["cells"][c]["rows"][n]["mean_val_loss"] for c in losses)
        for n in names
    }
    return {
        **d,
        "winner_without_cell": loo,
        "stable": all(v == d["winner"] for v in loo.values()),
        "mean_val_loss_over_cells": means,
    }


def decide(
    w: Walk, names: Sequence[str], key: str, cells: Sequence[Cell] | None = None
) -> dict[str, Any] | None:
    """The preregistered rule (docs/benchmarks.md, protocol v2), on the decision seeds' final
    *validation* loss (test loss decides nothing): on every cell, a candidate is *worse* when
    one of its decision runs diverged or its paired difference to the cell's best candidate
    has a 95 % interval above zero. The tied-best candidates are those worse on the fewest
    cells; among them the cheapest (step time within ``cost_tie`` counts as equal) wins, then
    the best mean rank over cells, then the earlier name (the current default is listed
    first). Also returned: the winner with each cell left out (does one cell decide?)."""
    p = w.proto
    costs = {n: cost(w, n) for n in names}
    known = {n: c for n, c in costs.items() if c is not None}
    if len(known) != len(costs):
        return None
    losses: dict[str, dict[str, list[float]]] = {}
    for cell in p.cells if cells is None else cells:
        acs = [w.get(n, cell.name) for n in names]
        decided = [ac.decide for ac in acs if ac is not None and ac.decide is not None]
        if len(decided) != len(names):
            return None
        losses[cell.name] = {n: _val_losses(rs) for n, rs in zip(names, decided, strict=True)}
    d = rule_with_stability(losses, names, known, p.cost_tie)
    return {"key": key, **d, "split": "validation", "seeds": "decision"}


def _final_arm(w: Walk, chosen: Arm, q: Any, dtype: str) -> Arm:
    opts = dict(chosen.options)
    opts.update(outlier_quantile=q, ns_dtype=dtype)
    for a in (*w.arms.values(), *COEFFICIENT_CANDIDATES, *REFERENCES):
        if a.optimizer == chosen.optimizer and dict(a.options) == opts:
            return a
    name = f"{chosen.name}{'-noq' if q is None else ''}{'-bf16' if dtype == 'bfloat16' else ''}"
    return chosen.with_options(name, f"{chosen.label}, q={q}, {dtype}", **opts)


def _q_arm(base: Arm, q: float) -> Arm:
    return base.with_options(f"{base.name}-q{q:g}", f"{base.label}, q={q:g}", outlier_quantile=q)


def walk(proto: Protocol, lookup: Lookup, timing_lookup: Callable[[str], Result | None]) -> Walk:
    """One pass over the protocol: what is known, and the jobs still needed."""
    w = Walk(proto)
    p = proto
    tasks = sorted({c.task for c in p.cells})
    cands = list(COEFFICIENT_CANDIDATES)
    refs = list(REFERENCES)
    for arm in (*cands, *refs):
        _cost_jobs(w, arm, tasks, timing_lookup)
    first = [c for c in p.cells if c.base is None]
    later = [c for c in p.cells if c.base is not None]

    def idx(cell: Cell) -> int:
        return p.all_cells.index(cell)

    for cell in first:
        for i, arm in enumerate(cands):
            pr = (P_DECIDE, idx(cell), i)
            _study_arm_cell(
                w, arm, cell, lookup, pr, decide_prio=pr, report_prio=(P_REPORT, idx(cell), i)
            )
        for i, arm in enumerate(refs):
            pr = (P_REPORT, idx(cell), 10 + i)
            _study_arm_cell(w, arm, cell, lookup, pr, report_prio=pr)
    names = [a.name for a in cands]
    screen = decide(w, names, "screening", first)
    d1 = None
    if screen is not None:
        survivors = [n for n in names if screen["worse_on_cells"][n] < p.screen_worse]
        w.decisions["screening"] = {**screen, "survivors": survivors}
        for cell in later:
            for i, n in enumerate(survivors):
                pr = (P_TRANSFER, idx(cell), i)
                _study_arm_cell(
                    w,
                    w.arms[n],
                    cell,
                    lookup,
                    pr,
                    decide_prio=pr,
                    report_prio=(P_REPORT, idx(cell), i),
                )
        d1 = decide(w, survivors, "ns_coefficients")
    for cell in later:
        for i, arm in enumerate(refs):
            pr = (P_REPORT, idx(cell), 10 + i)
            _study_arm_cell(w, arm, cell, lookup, pr, report_prio=pr)
    final: Arm | None = None
    if d1 is not None:
        w.decisions["ns_coefficients"] = d1
        chosen = w.arms[d1["winner"]]
        noq = _final_arm(w, chosen, None, chosen.option("ns_dtype"))
        bf16 = _final_arm(w, chosen, chosen.option("outlier_quantile"), "bfloat16")
        for arm in (noq, bf16):
            _cost_jobs(w, arm, tasks, timing_lookup)
        for cell in p.cells:
            for i, arm in enumerate((noq, bf16)):
                pr = (P_STAGE2, idx(cell), i)
                _study_arm_cell(
                    w,
                    arm,
                    cell,
                    lookup,
                    pr,
                    decide_prio=pr,
                    report_prio=(P_REPORT, idx(cell), 20 + i),
                )
        d2 = decide(w, [chosen.name, noq.name], "outlier_quantile")
        d3 = decide(w, [chosen.name, bf16.name], "ns_dtype")
        if d2 is not None and d3 is not None:
            w.decisions["outlier_quantile"] = d2
            w.decisions["ns_dtype"] = d3
            q = w.arms[d2["winner"]].option("outlier_quantile")
            dtype = w.arms[d3["winner"]].option("ns_dtype")
            final = _final_arm(w, chosen, q, dtype)
            _cost_jobs(w, final, tasks, timing_lookup)
            for cell in p.cells:
                pr = (P_REPORT, idx(cell), 30)
                _study_arm_cell(w, final, cell, lookup, pr, report_prio=pr)
            w.decisions["final"] = final.name
    # The robustness family, the long horizon and the autocast cell use ROOT as shipped when
    # protocol v2 was written (SHIPPED: Muon's coefficients, float32).
    for ci, cname in enumerate(p.robust_cells):
        for clip in (1.0, None):
            prio = P_ROBUST if clip is not None else P_ROBUST_NOCLIP
            for i, name in enumerate(ROBUST_ARMS):
                _robust(w, arm_by_name(name), p.cell(cname), clip, lookup, (prio, ci, i))
    shipped = arm_by_name(SHIPPED)
    if p.long_cell is not None:
        lc = p.long_cell
        base_cell = p.cell(lc.base) if lc.base else None
        for i, name in enumerate(LONG_ARMS):
            arm = arm_by_name(name)
            if base_cell is not None and base_cell.base is not None:
                # the base cell's own base (a transfer chain): tuned there if not already
                _study_arm_cell(w, arm, p.cell(base_cell.base), lookup, (P_LONG, 0, i))
                _study_arm_cell(w, arm, base_cell, lookup, (P_LONG, 0, i))
            pr = (P_LONG, 1, i)
            _study_arm_cell(w, arm, lc, lookup, pr, report_prio=pr)
        for i, q in enumerate(p.long_quantiles):
            pr = (P_LONG, 2, i)
            _study_arm_cell(
                w, _q_arm(shipped, q), lc, lookup, pr, report_prio=pr, base_arm=shipped.name
            )
    if p.amp_cell is not None:
        for i, name in enumerate(AMP_ARMS):
            pr = (P_AMP, 0, i)
            _study_arm_cell(w, arm_by_name(name), p.amp_cell, lookup, pr, report_prio=pr)
    # Equal compute: each arm gets the steps whose FLOPs equal AdamW's for the cell's steps.
    for cell in first:
        for i, name in enumerate(list(w.arms)):
            ac = w.get(name, cell.name)
            f_arm, f_ref = w.flops.get((name, cell.task)), w.flops.get(("adamw", cell.task))
            if ac is None or ac.tuned is None or not f_arm or not f_ref:
                continue
            steps = max(1, round(cell.steps * f_ref / f_arm))
            ac.equal_compute_steps = steps
            lk = w.tagged(lookup, name, cell.name, "equal compute")
            ac.equal_compute = _fetch(
                w,
                lk,
                _seed_specs(p, ac, p.report_seeds, REPORT_SUITE, steps=steps),
                (P_EQUAL, idx(cell), i),
            )
    if final is not None:
        chosen = w.arms[w.decisions["ns_coefficients"]["winner"]]
        abl = [*(_q_arm(chosen, q) for q in p.ablation_quantiles), *ABLATIONS]
        for cname in p.ablation_cells:
            for i, arm in enumerate(abl):
                pr = (P_ABLATION, 0, i)
                _study_arm_cell(w, arm, p.cell(cname), lookup, pr, report_prio=pr)
    w.jobs.sort(key=lambda pj: pj[0])
    # a run that two families ask for is one job, at the higher priority
    by_id: dict[str, tuple[tuple[int, ...], AnyJob]] = {}
    for pj in w.jobs:
        by_id.setdefault(pj[1].run_id, pj)
    w.jobs = list(by_id.values())
    w.complete = not w.jobs and final is not None
    return w


def capped_test_loss(r: Result) -> float:
    """A run's final test loss; a diverged run counts its initial test loss (the lr-stability
    rule of protocol v2)."""
    if not r["diverged"] and math.isfinite(r["final_test_loss"]):
        return float(r["final_test_loss"])
    init = r.get("initial_test_loss")
    return float(init) if init is not None and math.isfinite(init) else math.inf


def _robust(
    w: Walk, arm: Arm, cell: Cell, clip: float | None, lookup: Lookup, prio: tuple[int, ...]
) -> None:
    """One optimizer of the robustness family on one cell: the clean sweep over the common
    absolute lr grid (from ``sweep_k[0]`` until ``sweep_stop`` consecutive points diverge on
    every seed, or ``sweep_k[1]``), then each corruption at the sweep's optimum (lowest mean
    validation loss)."""
    p = w.proto
    w.arms.setdefault(arm.name, arm)
    tag = f"{arm.name}{'+clip' if clip is not None else ''}"
    entry: dict[str, Any] = {
        "arm": arm.name,
        "clip": clip,
        "sweep": {},
        "optimum": None,
        "conditions": {},
        "complete": False,
    }
    w.robust[(cell.name, arm.name, clip)] = entry
    lk = w.tagged(lookup, tag, cell.name, "lr sweep")
    lo, hi = p.sweep_k
    run_of_div = 0
    lookahead = 0
    done_sweep = False
    for k in range(lo, hi + 1):
        specs = [
            make_spec(
                arm,
                cell,
                Setting(k, 0, p.robust_wd),
                sd,
                p.per_decade,
                suite=SWEEP_SUITE,
                clip=clip,
            )
            for sd in p.report_seeds
        ]
        res = [lk(s) for s in specs]
        if any(r is None for r in res):
            w.need(prio, [s for s, r in zip(specs, res, strict=True) if r is None])
            lookahead += 1
            if lookahead >= 3:  # at most 3 unfinished points ahead (a sweep is sequential)
                break
            continue
        if lookahead:
            continue  # a later point is known but an earlier one is not: wait
        got = [r for r in res if r is not None]
        entry["sweep"][k] = got
        run_of_div = run_of_div + 1 if all(r["diverged"] for r in got) else 0
        if run_of_div >= p.sweep_stop:
            done_sweep = True
            break
    else:
        done_sweep = lookahead == 0
    if not done_sweep or not entry["sweep"]:
        return
    scores = {k: selection_score(rs) for k, rs in entry["sweep"].items()}
    kbest = min(scores, key=lambda k: (scores[k], k))
    if math.isinf(scores[kbest]):
        return
    entry["optimum"] = kbest
    lk2 = w.tagged(lookup, tag, cell.name, "corruption")
    ok = True
    for label, corr in p.robust_conditions:
        specs = [
            make_spec(
                arm,
                cell,
                Setting(kbest, 0, p.robust_wd),
                sd,
                p.per_decade,
                suite=ROBUST_SUITE,
                clip=clip,
                corruption=corr,
            )
            for sd in p.report_seeds
        ]
        got2 = _fetch(w, lk2, specs, prio)
        if got2 is None:
            ok = False
        else:
            entry["conditions"][label] = got2
    entry["complete"] = ok


# ----------------------------------------------------------------------------- running


def _run_job(job: Job, out_dir: str) -> Result:
    """Worker entry: one run, one timing or one FLOP count. A run that raises (e.g. an SVD
    that does not converge on a non-finite matrix) is recorded as diverged with the error,
    not retried."""
    from rootopt_analysis.bench.runner import FORMAT, run_one

    if isinstance(job, TimingSpec):
        return time_pair(job, out_dir)
    if isinstance(job, FlopSpec):
        return count_flops(job, out_dir)
    started = time.time()
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
            "evals": [],
            "train_loss": [],
            "diverged": True,
            "error": f"{type(exc).__name__}: {exc}"[:500],
            "steps_done": 0,
            "step_time_s": None,
            "train_cpu_s": 0.0,
            "wall_s": 0.0,
            "started": started,
            "ended": time.time(),
            "momentum_tail": {},
        }
        atomic_write(Path(out_dir) / "runs" / f"{job.run_id}.json", json.dumps(r).encode())
        return r


def open_store(out: Path) -> Store:
    from rootopt_analysis.bench.runner import FORMAT

    return Store(out, run_format=FORMAT)


def drive(
    replan: Callable[[], Any],
    run_job: Callable[[Any, str], Result],
    finished: Callable[[Any, Result], str],
    out: Path,
    *,
    workers: int,
    progress: bool,
    say: Callable[[str], None],
    label: str = "study",
) -> Any:
    """Keep ``workers`` processes busy with the jobs ``replan()`` lists (``.jobs``, highest
    priority first), re-planning after each finished one; ``finished(job, result)`` records a
    result and returns its progress line. Returns the last plan (no jobs left)."""
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait

    from rootopt_analysis.bench.runner import _worker_init

    w = replan()
    if not w.jobs:
        return w
    done, t0 = 0, time.perf_counter()
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init) as pool:
        pending: dict[Future[Result], Any] = {}
        while True:
            ids = {j.run_id for j in pending.values()}
            for _, job in w.jobs:
                if len(pending) >= workers + 1:
                    break
                if job.run_id not in ids:
                    pending[pool.submit(run_job, job, str(out))] = job
                    ids.add(job.run_id)
            if not pending:
                break
            ready, _ = wait(list(pending), return_when=FIRST_COMPLETED)
            for fut in ready:
                job = pending.pop(fut)
                line = finished(job, fut.result())
                done += 1
                if progress:
                    el = time.perf_counter() - t0
                    say(
                        f"[{label} {done} done, {len(pending)} running, {len(w.jobs)} ready, "
                        f"{el:.0f}s] {line}"
                    )
            w = replan()
    return w


def run_study(
    proto: Protocol,
    out: Path,
    *,
    workers: int,
    compute: bool = True,
    progress: bool = True,
    commit: str | None = None,
    log: Callable[[str], None] | None = None,
) -> tuple[Walk, Store]:
    """Run every job the protocol still needs (highest priority first, re-planning after each
    finished job) and return the final :class:`Walk` and the store. ``compute=False`` runs
    nothing. ``commit``: recorded with every run this call finishes (the run index)."""
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "timing").mkdir(parents=True, exist_ok=True)
    store = open_store(out)

    def lookup(spec: RunSpec) -> Result | None:
        return store.runs.get(spec.run_id)

    def replan() -> Walk:
        return walk(proto, lookup, store.timing.get)

    def finished(job: Job, r: Result) -> str:
        if isinstance(job, TimingSpec | FlopSpec):
            store.add_timings([r])
            what = f"×{r['ratio']:.3f} of AdamW" if "ratio" in r else f"{r['flops']:.3g} FLOP"
            return f"{r['kind']} {job.task} {job.arm.optimizer} {dict(job.arm.options)}: {what}"
        store.add_runs([r], commit=commit)
        status = (
            f"DIVERGED ({r['error'][:60]})" if r["diverged"] else f"val {r['final_val_loss']:.4f}"
        )
        return (
            f"{job.suite} {job.task}@{job.steps}{'-amp' if job.precision != 'fp32' else ''} "
            f"{job.optimizer} "
            f"{','.join(f'{k}={v}' for k, v in job.options if k != 'ortho_method')} "
            f"lr {job.lr:.3g} side ×{job.side_lr_mult:g} wd {job.weight_decay:g} "
            f"clip {job.clip} {job.corruption.tag} seed {job.seed}: {status} "
            f"({r['wall_s']:.0f}s)"
        )

    if not compute:
        return replan(), store
    w = drive(replan, _run_job, finished, out, workers=workers, progress=progress, say=say)
    return w, store


# ----------------------------------------------------------------------------- summary


def _losses(rs: Sequence[Result] | None, key: str = "final_test_loss") -> list[float] | None:
    if rs is None:
        return None
    return [float(r[key]) if not r["diverged"] else math.nan for r in rs]


def _ci_or_none(xs: Sequence[float] | None) -> dict[str, Any] | None:
    if xs is None or len(xs) < 2 or not all(map(math.isfinite, xs)):
        return None
    return mean_ci(xs).as_dict()


def _paired_or_none(a: Sequence[float] | None, b: Sequence[float] | None) -> dict[str, Any] | None:
    if a is None or b is None or len(a) != len(b) or len(a) < 2:
        return None
    if not all(map(math.isfinite, [*a, *b])):
        return None
    d = paired_ci(a, b).as_dict()
    d["p"] = paired_p(a, b)
    return d


COMPARISONS: tuple[tuple[str, str, str], ...] = (
    # (label, a, b): the paired difference a − b in test loss (negative: a is better)
    ("default − torch.optim.Muon", "@final", "muon-bf16"),
    ("ROOT fp32 − Muon fp32 (precision-matched)", "@chosen", "muon-fp32"),
    ("ROOT bf16 − Muon bf16 (precision-matched)", "@chosen-bf16", "muon-bf16"),
    ("default − AdamW", "@final", "adamw"),
    ("AdaNewton − Muon's coefficients (both ROOT, fp32)", "root-adanewton", "root-muon"),
    ("Polar Express − Muon's coefficients (both ROOT, fp32)", "root-polar", "root-muon"),
    ("threshold on − off", "@chosen", "@chosen-noq"),
    ("bf16 − fp32 iterations", "@chosen-bf16", "@chosen"),
    ("Muon bf16 − AdamW", "muon-bf16", "adamw"),
    ("ROOT, Muon's coefficients − torch.optim.Muon", SHIPPED, "muon-bf16"),
    ("ROOT, Muon's coefficients − Muon fp32 (precision-matched)", SHIPPED, "muon-fp32"),
    ("ROOT, Muon's coefficients, q = 0.8 − q = 0.9", f"{SHIPPED}-q0.8", SHIPPED),
    ("ROOT, Muon's coefficients, q = 0.95 − q = 0.9", f"{SHIPPED}-q0.95", SHIPPED),
)


def library_arm(arms: Iterable[Arm]) -> str | None:
    """The name of the ROOT arm whose options are the library's defaults (``ROOT``'s
    signature), or None when the study has no such arm."""
    import inspect

    from rootopt import ROOT

    signature = inspect.signature(ROOT).parameters
    defaults = {k: signature[k].default for k in ROOT_BASE}
    # ns_dtype="auto" is bfloat16 where the hardware multiplies it natively, float32
    # elsewhere (docs/optimizer.md); the study's arms name one dtype: a bfloat16 arm stands
    # for the default (on such hardware), else a float32 one
    dtypes = ["bfloat16", "float32"] if defaults["ns_dtype"] == "auto" else [defaults["ns_dtype"]]
    arms = [a for a in arms if a.optimizer == "root"]
    for dtype in dtypes:
        want = {**defaults, "ns_dtype": dtype}
        found = next((a.name for a in arms if dict(a.options) == want), None)
        if found is not None:
            return found
    return None


def default_arm(w: Walk) -> tuple[str, bool]:
    """The arm of the library's default and whether it is decided: the final decision when
    every decision is in, else the shipped setting (provisional)."""
    final = w.decisions.get("final")
    return (str(final), True) if final else (SHIPPED, False)


def _resolve_name(w: Walk, name: str) -> str | None:
    if not name.startswith("@"):
        return name
    if name == "@final":
        return default_arm(w)[0]
    d1 = w.decisions.get("ns_coefficients")
    chosen = w.arms[d1["winner"]] if d1 else arm_by_name(SHIPPED)
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


def _tail_summary(rs: Sequence[Result] | None) -> dict[str, Any] | None:
    """The momentum tail over the run, averaged over the seeds step by step."""
    cols = [r.get("momentum_tail") or {} for r in rs or []]
    cols = [c for c in cols if c.get("step")]
    if not cols or any(c["step"] != cols[0]["step"] for c in cols):
        return None
    keys = [k for k in cols[0] if k not in ("step", "matrices")]
    return {
        "step": cols[0]["step"],
        **{
            k: [statistics.fmean(c[k][i] for c in cols) for i in range(len(cols[0]["step"]))]
            for k in keys
        },
    }


def _arm_row(w: Walk, ac: ArmCell) -> dict[str, Any]:
    p = w.proto
    test = _losses(ac.report)
    val = _losses(ac.report, "final_val_loss")
    dval = _losses(ac.decide, "final_val_loss")
    eq = _losses(ac.equal_compute)
    return {
        "setting": ac.tuned.setting.as_dict(ac.arm, p.per_decade) if ac.tuned else None,
        "edge": ac.tuned.edge if ac.tuned else None,
        "tuned_from": ac.tuned_from,
        "history": ac.tuned.history if ac.tuned else None,
        "decision_val_loss": dval,
        "decision_val_ci": _ci_or_none(dval),
        "test_loss": test,
        "test_loss_ci": _ci_or_none(test),
        "val_loss": val,
        "test_acc": [r.get("final_test_acc") for r in ac.report] if ac.report else None,
        "diverged": sum(bool(r["diverged"]) for r in ac.report) if ac.report else None,
        "param_count": ac.report[0].get("param_count") if ac.report else None,
        "equal_compute_steps": ac.equal_compute_steps,
        "equal_compute_test_loss": eq,
        "equal_compute_ci": _ci_or_none(eq),
        "curves": [
            {"steps": r["evals"]["step"], "test_loss": r["evals"]["test_loss"]} for r in ac.report
        ]
        if ac.report
        else None,
        "smoothness": [r.get("smoothness") for r in ac.report] if ac.report else None,
        "momentum_tail": _tail_summary(ac.report),
        "lr_sensitivity": _lr_sensitivity(ac.tuned),
    }


def _pooled(per_cell: dict[str, dict[str, Any]], cells: Sequence[str]) -> dict[str, Any] | None:
    """Pooled over ``cells`` (all of them must be present): per report seed, the mean over
    cells of the paired difference; the interval is Student's t over those seed means."""
    got = [per_cell.get(c, {}).get("diffs") for c in cells]
    diffs = [d for d in got if d is not None]
    if not cells or len(diffs) != len(got):
        return None
    n = len(diffs[0])
    if any(len(d) != n for d in diffs):
        return None
    seed_means = [statistics.fmean(d[i] for d in diffs) for i in range(n)]
    if n < 2:
        return None
    ci = mean_ci(seed_means).as_dict()
    ci["cells"] = list(cells)
    zero = [0.0] * n
    ci["p"] = paired_p(seed_means, zero)
    return ci


def _comparisons(w: Walk, cells: dict[str, Any]) -> list[dict[str, Any]]:
    p = w.proto
    out: list[dict[str, Any]] = []
    decision_cells = [c.name for c in p.cells]
    base_cells = [c.name for c in p.cells if c.base is None]
    for label, a0, b0 in COMPARISONS:
        a, b = _resolve_name(w, a0), _resolve_name(w, b0)
        if a is None or b is None or a == b:
            continue
        per: dict[str, Any] = {}
        for c in p.all_cells:
            ra, rb = cells[c.name]["arms"].get(a), cells[c.name]["arms"].get(b)
            if not ra or not rb:
                continue
            row: dict[str, Any] = {}
            for kind, key in (
                ("equal steps", "test_loss"),
                ("equal compute", "equal_compute_test_loss"),
            ):
                d = _paired_or_none(ra[key], rb[key])
                if d is not None:
                    row[kind] = d
                    if kind == "equal steps":
                        row["diffs"] = [x - y for x, y in zip(ra[key], rb[key], strict=True)]
                    else:
                        row["diffs_equal_compute"] = [
                            x - y for x, y in zip(ra[key], rb[key], strict=True)
                        ]
            if row:
                per[c.name] = row
        pooled = _pooled(per, decision_cells)
        eq = {c: {"diffs": v.get("diffs_equal_compute")} for c, v in per.items()}
        pooled_eq = _pooled(eq, base_cells)
        out.append(
            {
                "label": label,
                "a": a,
                "b": b,
                "cells": per,
                "pooled": pooled,
                "pooled_equal_compute": pooled_eq,
            }
        )
    return out


def _robust_summary(w: Walk) -> dict[str, Any] | None:
    p = w.proto
    if not w.robust:
        return None
    cells: dict[str, Any] = {}
    seeds = list(p.report_seeds)
    for (cname, arm, clip), e in w.robust.items():
        tag = f"{arm}{'+clip' if clip is not None else ''}"
        sweep = []
        for k, rs in sorted(e["sweep"].items()):
            sweep.append(
                {
                    "k": k,
                    "lr": _lr(arm_by_name(arm), k, p.per_decade),
                    "val_loss": _losses(rs, "final_val_loss"),
                    "test_loss": _losses(rs),
                    "capped_test_loss": [capped_test_loss(r) for r in rs],
                    "diverged": sum(bool(r["diverged"]) for r in rs),
                    "above10rms_share": [
                        (r.get("momentum_tail") or {}).get("above10rms_share", [None])[-1]
                        for r in rs
                    ],
                }
            )
        row: dict[str, Any] = {
            "arm": arm,
            "clip": clip,
            "complete": e["complete"],
            "optimum_k": e["optimum"],
            "sweep": sweep,
            "conditions": {},
        }
        kbest = e["optimum"]
        clean = e["sweep"].get(kbest) if kbest is not None else None
        if clean is not None:
            clean_test = _losses(clean)
            clean_capped = [capped_test_loss(r) for r in clean]
            row["optimum_lr"] = _lr(arm_by_name(arm), kbest, p.per_decade)
            row["clean"] = {"test_loss": clean_test, "test_loss_ci": _ci_or_none(clean_test)}
            for label, rs in e["conditions"].items():
                # as in the lr sweep, a diverged run counts its initial test loss
                capped = [capped_test_loss(r) for r in rs]
                per_seed = [x - y for x, y in zip(capped, clean_capped, strict=True)]
                row["conditions"][label] = {
                    "test_loss": _losses(rs),
                    "diverged": sum(bool(r["diverged"]) for r in rs),
                    "degradation_per_seed": per_seed,
                    "degradation": _paired_or_none(capped, clean_capped),
                }
            # lr stability: mean over the region of (capped loss − the seed's optimum loss)
            if all(k in e["sweep"] for k in p.lr_region) or (
                e["sweep"] and max(e["sweep"]) < max(p.lr_region) and _stopped(e, p)
            ):
                best = [capped_test_loss(r) for r in clean]
                per_seed = []
                for i in range(len(seeds)):
                    vals = []
                    for k in p.lr_region:
                        rs = e["sweep"].get(k)
                        # past the sweep's stop every seed diverged: the initial loss
                        v = capped_test_loss(rs[i]) if rs else _initial(e, i)
                        vals.append(v - best[i])
                    per_seed.append(statistics.fmean(vals))
                row["lr_degradation_per_seed"] = per_seed
                row["lr_degradation"] = _ci_or_none(per_seed)
        cells.setdefault(cname, {})[tag] = row
    family = _holm_family(w, cells)
    return {
        "cells": cells,
        "conditions": [lbl for lbl, _ in p.robust_conditions],
        "lr_region": {
            "k": list(p.lr_region),
            "lr": [_lr(arm_by_name("adamw"), k, p.per_decade) for k in p.lr_region],
        },
        "weight_decay": p.robust_wd,
        "family": family,
    }


def _stopped(e: dict[str, Any], p: Protocol) -> bool:
    """The sweep ended by its stop rule (its last points diverged on every seed)."""
    ks = sorted(e["sweep"])
    tail = ks[-p.sweep_stop :]
    return len(tail) == p.sweep_stop and all(
        all(r["diverged"] for r in e["sweep"][k]) for k in tail
    )


def _initial(e: dict[str, Any], i: int) -> float:
    rs = e["sweep"][max(e["sweep"])]
    return capped_test_loss(rs[i])


def _holm_family(w: Walk, cells: dict[str, Any]) -> dict[str, Any]:
    """ROOT − comparator for every cell × clipping × comparator × degradation (protocol v2):
    paired t tests, Holm-adjusted over the whole family (only when all of it is in)."""
    p = w.proto
    metrics = [*(lbl for lbl, _ in p.robust_conditions), "lr stability"]
    rows: list[dict[str, Any]] = []
    for cname in p.robust_cells:
        for clip in (1.0, None):
            sfx = "+clip" if clip is not None else ""
            root = cells.get(cname, {}).get(f"{SHIPPED}{sfx}")
            for comp in ROBUST_ARMS[1:]:
                other = cells.get(cname, {}).get(f"{comp}{sfx}")
                for m in metrics:
                    row: dict[str, Any] = {
                        "cell": cname,
                        "clip": clip,
                        "a": SHIPPED,
                        "b": comp,
                        "metric": m,
                        "diff": None,
                    }
                    if root and other:
                        if m == "lr stability":
                            xa = root.get("lr_degradation_per_seed")
                            xb = other.get("lr_degradation_per_seed")
                        else:
                            ca, cb = root["conditions"].get(m), other["conditions"].get(m)
                            xa = ca and ca["degradation_per_seed"]
                            xb = cb and cb["degradation_per_seed"]
                        row["diff"] = _paired_or_none(xa, xb)
                    rows.append(row)
    complete = all(r["diff"] is not None for r in rows)
    if complete and rows:
        adj = holm([r["diff"]["p"] for r in rows])
        for r, a in zip(rows, adj, strict=True):
            r["p_holm"] = a
            r["significant"] = a <= 0.05
    return {"size": len(rows), "complete": complete, "alpha": 0.05, "rows": rows}


def _index(w: Walk, store: Store) -> dict[str, Any]:
    """Every run in the store: what it was, who ran it when, what it gave, and whether the
    protocol as it stands uses it (a run it does not use is superseded)."""
    cols = [
        "run_id",
        "suite",
        "uses",
        "cell",
        "seed",
        "setting",
        "commit",
        "started (UTC)",
        "ended (UTC)",
        "final_val_loss",
        "final_test_loss",
        "diverged",
        "used",
    ]
    rows = []
    sessions = read_sessions(store.out / "study-log.jsonl")
    for rid, r in sorted(store.runs.items(), key=lambda kv: (kv[1].get("started") or 0, kv[0])):
        spec = RunSpec.from_dict(r["spec"])
        uses = sorted(w.uses.get(rid, ()))
        amp = "-amp" if spec.precision == "bf16" else ""
        cell = uses[0][1] if uses else f"{spec.task}{amp}@{spec.steps}"
        setting = {
            "lr": spec.lr,
            "side_lr_mult": spec.side_lr_mult,
            "weight_decay": spec.weight_decay,
            "clip": spec.clip,
            "corruption": spec.corruption.tag,
            "lr_mult": spec.lr_mult,
            "steps": spec.steps,
            "precision": spec.precision,
            "options": dict(spec.options),
        }

        def fin(x: Any) -> float | None:
            return float(x) if isinstance(x, int | float) and math.isfinite(x) else None

        rows.append(
            [
                rid,
                spec.suite,
                ["|".join(u) for u in uses],
                cell,
                spec.seed,
                setting,
                commit_of(r, sessions),
                _utc_s(r.get("started")),
                _utc_s(r.get("ended")),
                fin(r.get("final_val_loss")),
                fin(r.get("final_test_loss")),
                bool(r["diverged"]),
                bool(uses),
            ]
        )
    return {
        "columns": cols,
        "rows": rows,
        "runs": len(rows),
        "superseded": sum(1 for row in rows if not row[-1]),
    }


def _utc_s(t: Any) -> str | None:
    if not isinstance(t, int | float):
        return None
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


FAMILIES = (
    (P_COST, "step-time ratios and FLOP counts"),
    (P_DECIDE, "tuning and decision runs, base cells"),
    (P_TRANSFER, "tuning and decision runs, transfer cells"),
    (P_STAGE2, "stage 2 (threshold off, bf16 iterations)"),
    (P_REPORT, "report runs"),
    (P_ROBUST, "robustness family, with clipping"),
    (P_LONG, "long horizon (stdlib@2400)"),
    (P_AMP, "bf16 autocast cell"),
    (P_ROBUST_NOCLIP, "robustness family, without clipping"),
    (P_EQUAL, "equal compute"),
    (P_ABLATION, "ablations"),
)


def _param_count(task_name: str) -> int:
    from rootopt.tasks import task

    return sum(p.numel() for p in task(task_name).model().parameters())


def summarize(w: Walk, store: Store, meta: dict[str, Any]) -> dict[str, Any]:
    """The study as JSON-able data: settings, per-arm results, decisions, comparisons, the
    robustness family, the run index, and what is still pending."""
    p = w.proto
    arms: dict[str, Any] = {}
    for name, arm in w.arms.items():
        arms[name] = {
            "label": arm.label,
            "optimizer": arm.optimizer,
            "options": dict(arm.options),
            "cost_vs_adamw": cost(w, name),
            "timing": {t: r for (a, t), r in w.timing.items() if a == name},
            "flops_per_step": {t: f for (a, t), f in w.flops.items() if a == name},
        }
    cells: dict[str, Any] = {}
    for c in p.all_cells:
        rows = {name: _arm_row(w, ac) for name in w.arms if (ac := w.get(name, c.name))}
        cells[c.name] = {
            "param_count": _param_count(c.task),
            "task": c.task,
            "steps": c.steps,
            "base": c.base,
            "precision": c.precision,
            "decision": c in p.cells,
            "arms": rows,
        }
    pending: dict[str, int] = {}
    for prio, _ in w.jobs:
        label = next((lbl for lv, lbl in FAMILIES if lv == prio[0]), str(prio[0]))
        pending[label] = pending.get(label, 0) + 1
    default, decided = default_arm(w)
    return {
        "format": 2,
        "meta": meta,
        "protocol": _protocol_dict(p),
        "complete": w.complete,
        "jobs_left": len(w.jobs),
        "pending": pending,
        # `shipped`: the arm of the setting ROOT() ships today; a decision that differs is a
        # change of defaults still to be made (docs/benchmarks.md), and the README shows the
        # shipped one
        "default": {"arm": default, "decided": decided, "shipped": library_arm(w.arms.values())},
        "arms": arms,
        "cells": cells,
        "decisions": w.decisions,
        "comparisons": _comparisons(w, cells),
        "robustness": _robust_summary(w),
        "index": _index(w, store),
    }


def _protocol_dict(p: Protocol) -> dict[str, Any]:
    d = asdict(p)
    d["robust_conditions"] = [
        {"label": lbl, "corruption": asdict(c)} for lbl, c in p.robust_conditions
    ]
    return d
