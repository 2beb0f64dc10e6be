"""The defaults study, v3 (protocol: docs/benchmarks.md, "Defaults study v3: protocol").

v2 (:mod:`rootopt_analysis.bench.study`) chose ROOT's defaults on ties. v3 asks two questions
again with 10 new decision seeds and a pooled, equivalence-tested statistic: Q1 Polar
Express or Muon's coefficients, Q2 bfloat16 or float32 iterations per hardware class, a tie
going to the setting that is cheaper on that hardware (measured with its instruction set),
then to the simpler. It reuses v2's machinery and v2's tuning (the same selection specs, read
from v2's committed record), and adds matched arms: the parent's tuned setting with one option
changed, so that a dtype difference is not a tuning difference.

Like v2 the study is plain data and pure functions over the finished runs: :func:`walk`
says what is known and which jobs are still needed; :func:`run_study` keeps worker processes
busy and re-plans after each finished job; every finished run is a line of ``runs.jsonl``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from rootopt_analysis.bench import study as v2
from rootopt_analysis.bench import study_v3_pages
from rootopt_analysis.bench.runner import RunSpec
from rootopt_analysis.bench.stats import mean_ci
from rootopt_analysis.bench.store import Store
from rootopt_analysis.bench.study import (
    Arm,
    ArmCell,
    Cell,
    Lookup,
    Result,
    Setting,
    Tuned,
    Walk,
    arm_by_name,
    make_spec,
    root_arm,
)

# ----------------------------------------------------------------------------- protocol data

SELECTION = (100, 101)  # v2's tuning, reused
DECISION = tuple(range(300, 310))
REPORT = (400, 401, 402, 403, 404)
MARGIN = 0.005  # nats: the equivalence margin of the TOST
COST_TIE = 0.05  # a step-cost ratio within 1 ± this is equal cost
LM_CELLS = ("stdlib@150", "kjv@150", "stdlib@600", "kjv@600", "stdlib-large@200")
CNN_CELLS = ("digits@200", "digits@800")
# oneDNN ISA caps standing for hardware classes (docs/results/ns_dtype.md): None = this CPU
# as it is; below AVX512_CORE_BF16 the bf16 units stay unused.
ISA_CLASSES: tuple[str | None, ...] = (None, "AVX512_CORE", "AVX2")
# The model users train on a CPU (the real-model cell's): the cost unit.
LLAMA: dict[str, Any] = {
    "vocab_size": 8192,
    "hidden_size": 256,
    "intermediate_size": 672,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
LLAMA_BATCH = (8, 128)
COST_STEPS, COST_WARMUP = 20, 3


def matched(parent: Arm, suffix: str, label: str, **opts: Any) -> Arm:
    """``parent`` with ``opts`` changed, trained at the parent's tuned setting."""
    return parent.with_options(f"{parent.name}·{suffix}", f"{parent.label}, {label}", **opts)


ROOT_MUON = arm_by_name("root-muon")
ROOT_POLAR = arm_by_name("root-polar")
ROOT_POLAR_BF16 = root_arm("root-polar-bf16", "ROOT, Polar Express, bf16 (tuned apart)",
                           ns_coefficients="polar_express", ns_dtype="bfloat16")  # fmt: skip
TUNED: tuple[Arm, ...] = (ROOT_MUON, ROOT_POLAR, ROOT_POLAR_BF16)
# matched arm -> its parent (whose tuned setting it trains at)
MATCHED: dict[str, tuple[Arm, Arm]] = {}
for _parent, _suffix, _label, _opts in (
    (ROOT_MUON, "bf16", "bf16 iterations", {"ns_dtype": "bfloat16"}),
    (ROOT_POLAR, "bf16", "bf16 iterations", {"ns_dtype": "bfloat16"}),
    (ROOT_POLAR, "plain", "plain iteration", {"ns_gram": "off"}),
    (ROOT_POLAR, "bf16·plain", "bf16, plain iteration", {"ns_dtype": "bfloat16", "ns_gram": "off"}),
):
    _m = matched(_parent, _suffix, _label, **_opts)
    MATCHED[_m.name] = (_m, _parent)
COEFFICIENTS = {"muon": ROOT_MUON, "polar_express": ROOT_POLAR}
SIMPLER_COEFFICIENTS = ("muon", "polar_express")  # a tie at equal cost: the first
SIMPLER_DTYPES = ("float32", "bfloat16")


def protocol() -> v2.Protocol:
    """v2's grids (so that its tuning is found again) with v3's seeds."""
    return replace(v2.Protocol.full(), decision_seeds=DECISION, report_seeds=REPORT)


# ----------------------------------------------------------------------------- cost


@dataclass(frozen=True)
class CostSpec:
    """CPU time of one whole training step of the cost model (:data:`LLAMA`) with ``arm``'s
    optimizer over ``ref``'s, interleaved in one fresh process under oneDNN's ISA cap
    ``isa_cap`` (None: this CPU as it is)."""

    arm: RunSpec
    ref: RunSpec
    isa_cap: str | None
    steps: int = COST_STEPS
    warmup: int = COST_WARMUP

    @property
    def task(self) -> str:
        return "llama-cost"

    @property
    def run_id(self) -> str:
        import hashlib

        blob = json.dumps(
            {
                "arm": self.arm.to_dict(),
                "ref": self.ref.to_dict(),
                "isa_cap": self.isa_cap,
                "steps": self.steps,
                "warmup": self.warmup,
                "model": LLAMA,
                "batch": LLAMA_BATCH,
                "code": 1,
            },
            sort_keys=True,
        )
        digest = hashlib.sha256(blob.encode()).hexdigest()[:10]
        return f"cost-{self.isa_cap or 'native'}-{self.arm.optimizer}-{digest}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "arm": self.arm.to_dict(),
            "ref": self.ref.to_dict(),
            "isa_cap": self.isa_cap,
            "steps": self.steps,
            "warmup": self.warmup,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> CostSpec:
        return CostSpec(
            RunSpec.from_dict(d["arm"]),
            RunSpec.from_dict(d["ref"]),
            d["isa_cap"],
            d["steps"],
            d["warmup"],
        )


def _cost_child(spec: CostSpec) -> Result:
    """Measure ``spec`` in this process (its ISA cap already in the environment)."""
    import warnings

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rootopt._threads import one_thread
    from rootopt_analysis.bench.runner import build_optimizer
    from rootopt_analysis.provenance import instruction_set

    warnings.simplefilter("ignore", RuntimeWarning)  # the emulated-bf16 warning: measured here
    with one_thread():
        sides = []
        for rs in (spec.arm, spec.ref):
            torch.manual_seed(0)
            model = LlamaForCausalLM(LlamaConfig(**LLAMA))
            sides.append((model, build_optimizer(rs, model), torch.Generator().manual_seed(7)))
        times: list[list[float]] = [[], []]
        for i in range(spec.warmup + spec.steps):
            for which in (0, 1) if i % 2 == 0 else (1, 0):
                model, opt, gen = sides[which]
                x = torch.randint(0, LLAMA["vocab_size"], LLAMA_BATCH, generator=gen)
                c0 = time.process_time()
                loss = model(input_ids=x, labels=x).loss
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
                opt.step()
                if i >= spec.warmup:
                    times[which].append(time.process_time() - c0)
    arm_s, ref_s = (statistics.median(ts) for ts in times)
    return {
        "run_id": spec.run_id,
        "kind": "cost",
        "task": spec.task,
        "spec": spec.to_dict(),
        "arm_step_s": arm_s,
        "ref_step_s": ref_s,
        "ratio": arm_s / ref_s,
        "steps": spec.steps,
        "machine": instruction_set(),
    }


def measure_cost(spec: CostSpec, out_dir: str) -> Result:
    """Run :class:`CostSpec` in a fresh process (the ISA cap must be set before oneDNN
    starts) and write ``<out_dir>/timing/<run_id>.json``."""
    from rootopt._atomic import atomic_write

    env = {
        k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
    }
    if spec.isa_cap:
        env["ONEDNN_MAX_CPU_ISA"] = spec.isa_cap
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rootopt_analysis.bench.study_v3",
            "--cost",
            json.dumps(spec.to_dict()),
        ],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"cost measurement failed: {proc.stderr.strip()[-500:]}")
    result: Result = json.loads(proc.stdout)
    atomic_write(Path(out_dir) / "timing" / f"{spec.run_id}.json", json.dumps(result).encode())
    return result


def _with_machine(job: Any, out_dir: str) -> Result:
    """v2's timing and FLOP jobs, their record naming the machine's instruction set."""
    from rootopt._atomic import atomic_write
    from rootopt_analysis.provenance import instruction_set

    r = v2._run_job(job, out_dir)
    r["machine"] = instruction_set()
    sub = "timing" if isinstance(job, v2.TimingSpec | v2.FlopSpec) else "runs"
    atomic_write(Path(out_dir) / sub / f"{job.run_id}.json", json.dumps(r).encode())
    return r


def _run_job(job: Any, out_dir: str) -> Result:
    """Worker entry for every v3 job."""
    from rootopt_analysis.bench import study_v3_real as real

    if isinstance(job, CostSpec):
        return measure_cost(job, out_dir)
    if isinstance(job, real.DataJob | real.TrainJob):
        return real.run_job(job, out_dir)
    return _with_machine(job, out_dir)


def _job_line(job: Any, r: Result) -> str:
    """One progress line for a finished job."""
    from rootopt_analysis.bench import study_v3_real as real

    if isinstance(job, real.DataJob):
        return f"real-model data prepared: {r['data']['splits']} (test {r['test']['splits']})"
    if isinstance(job, real.TrainJob):
        what = "FAILED " + r["error"] if r["diverged"] else f"val {r['final_val_loss']:.4f}"
        return f"real-model {job.role} {job.optimizer} lr {job.lr:g} seed {job.seed}: {what}"
    if isinstance(job, CostSpec | v2.TimingSpec | v2.FlopSpec):
        what = f"×{r['ratio']:.3f}" if "ratio" in r else f"{r['flops']:.3g} FLOP"
        return f"{r['kind']} {job.task} {job.arm.optimizer} {dict(job.arm.options)}: {what}"
    status = "DIVERGED" if r["diverged"] else f"val {r['final_val_loss']:.4f}"
    return (
        f"{job.suite} {job.task}@{job.steps} {job.optimizer} "
        f"{','.join(f'{k}={v}' for k, v in job.options if k != 'ortho_method')} "
        f"lr {job.lr:.3g} side ×{job.side_lr_mult:g} wd {job.weight_decay:g} "
        f"seed {job.seed}: {status} ({r['wall_s']:.0f}s)"
    )


# ----------------------------------------------------------------------------- statistics


def pooled_difference(
    a: dict[str, list[float]], b: dict[str, list[float]], cells: Sequence[str]
) -> dict[str, Any] | None:
    """a − b pooled over ``cells``: per seed the mean over cells of the paired difference;
    the 95 % and 90 % t intervals over seeds. None when a value is missing; a diverged run
    (NaN or inf) makes the difference +inf for the side that diverged."""
    if any(c not in a or c not in b for c in cells) or not cells:
        return None
    n = len(a[cells[0]])
    if any(len(a[c]) != n or len(b[c]) != n for c in cells) or n < 2:
        return None
    per_seed = []
    for i in range(n):
        ds = []
        for c in cells:
            x, y = a[c][i], b[c][i]
            x = x if math.isfinite(x) else math.inf
            y = y if math.isfinite(y) else math.inf
            ds.append(x - y if math.isfinite(x - y) else (math.inf if x > y else -math.inf))
        per_seed.append(statistics.fmean(ds))
    if not all(map(math.isfinite, per_seed)):
        worse = "a" if any(d == math.inf for d in per_seed) else "b"
        return {"diverged": worse, "per_seed": per_seed, "cells": list(cells)}
    ci95, ci90 = mean_ci(per_seed, 0.95), mean_ci(per_seed, 0.90)
    return {
        "mean": ci95.mean,
        "lo": ci95.lo,
        "hi": ci95.hi,
        "lo90": ci90.lo,
        "hi90": ci90.hi,
        "n": n,
        "sd": ci95.sd,
        "per_seed": per_seed,
        "cells": list(cells),
    }


def verdict(
    diff: dict[str, Any],
    cost_ratio: float | None,
    a: str,
    b: str,
    simpler: Sequence[str],
    margin: float = MARGIN,
    cost_tie: float = COST_TIE,
) -> dict[str, Any]:
    """The v3 rule on a − b: better beyond the margin wins; otherwise the cheaper (cost
    ratio a/b outside 1 ± ``cost_tie``), then the simpler (earlier in ``simpler``)."""
    if "diverged" in diff:
        winner = b if diff["diverged"] == "a" else a
        return {"winner": winner, "why": f"{diff['diverged']} diverged", "equivalent": False}
    if diff["hi"] < -margin:
        return {"winner": a, "why": "better beyond the margin", "equivalent": False}
    if diff["lo"] > margin:
        return {"winner": b, "why": "better beyond the margin", "equivalent": False}
    equivalent = -margin < diff["lo90"] and diff["hi90"] < margin
    label = "equivalent" if equivalent else "not shown equivalent"
    if cost_ratio is not None and cost_ratio < 1 - cost_tie:
        return {"winner": a, "why": f"{label}; cheaper", "equivalent": equivalent}
    if cost_ratio is not None and cost_ratio > 1 + cost_tie:
        return {"winner": b, "why": f"{label}; cheaper", "equivalent": equivalent}
    first = min((a, b), key=simpler.index)
    return {"winner": first, "why": f"{label}; equal cost, simpler", "equivalent": equivalent}


# ----------------------------------------------------------------------------- the walk

# Priorities (lower first; docs/benchmarks.md, v3 "Priority"). v2's P_COST (0) marks v2's
# own timing jobs, which v3 runs last (information only).
P_COST, P_DECIDE, P_REAL, P_RETUNE, P_EQUAL_TIME = 1, 10, 20, 30, 35
P_HORIZON, P_QABL, P_REPORT, P_TASK_TIMING = 40, 50, 60, 80
RETUNE_CELLS = ("stdlib@600", "kjv@600", "stdlib-large@200")
RETUNE_SEEDS = (100, 101, 102)
RETUNE_WD = (0.0, 0.03, 0.1, 0.3)
RETUNE_SIDE = (-2, 0, 2)  # offsets of the AdamW-side exponent j around the arm's
HORIZON = (
    Cell("stdlib", 2400, base="stdlib@600"),
    Cell("stdlib-large", 800, base="stdlib-large@200"),
)
QABL_CELLS = ("stdlib@150", "stdlib@2400")
QABL = (0.8, 0.95, 0.99, None)  # beside q = 0.9, the default's
MUON = arm_by_name("muon-bf16")  # torch.optim.Muon (bf16 iterations), AdamW for the rest
ADAMW = arm_by_name("adamw")


@dataclass
class WalkV3:
    """v2's :class:`Walk` (cells, tuning, index) plus v3's costs, decisions and the
    families that follow the decision."""

    base: Walk
    costs: dict[str, Result] = field(default_factory=dict)  # run id -> cost record
    cost_of: dict[tuple[str, str], float] = field(default_factory=dict)
    decisions: dict[str, Any] = field(default_factory=dict)
    # (arm, cell) -> {"start", "setting", "history", "report", "equal_time"}
    retuned: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    equal_time: dict[str, dict[str, Any]] = field(default_factory=dict)  # cell -> timing, steps
    real: dict[str, Any] = field(default_factory=dict)  # the real-model cell
    complete: bool = False

    @property
    def jobs(self) -> list[tuple[tuple[int, ...], Any]]:
        return self.base.jobs


def _llama_spec(arm: Arm) -> RunSpec:
    """``arm``'s optimizer for the cost model (its lr does not change a step's cost)."""
    return RunSpec(
        suite="v3-cost",
        task="llama-cost",
        optimizer=arm.optimizer,
        lr=1e-3,
        seed=0,
        steps=0,
        weight_decay=0.1,
        options=arm.options,
    )


def cost_specs() -> list[tuple[str, str, CostSpec]]:
    """(question, class, spec): Q1 on this CPU; Q2 for both coefficient sets per class."""
    out = [
        (
            "ns_coefficients",
            "native",
            CostSpec(_llama_spec(ROOT_POLAR), _llama_spec(ROOT_MUON), None),
        )
    ]
    for coeff, parent in COEFFICIENTS.items():
        bf16 = MATCHED[f"{parent.name}·bf16"][0]
        for cap in ISA_CLASSES:
            spec = CostSpec(_llama_spec(bf16), _llama_spec(parent), cap)
            out.append((f"ns_dtype/{coeff}", cap or "native", spec))
    return out


def _matched_cell(w: Walk, arm: Arm, parent: Arm, cell: Cell) -> ArmCell:
    ac = w.cells.setdefault((arm.name, cell.name), ArmCell(arm, cell))
    w.arms.setdefault(arm.name, arm)
    src = w.get(parent.name, cell.name)
    if src is not None and src.tuned is not None and ac.tuned is None:
        ac.tuned = Tuned(src.tuned.setting, [], src.tuned.edge)
        ac.tuned_from = parent.name
    return ac


def _decide_runs(w: Walk, ac: ArmCell, lookup: Lookup, prio: tuple[int, ...]) -> None:
    if ac.tuned is None or ac.decide is not None:
        return
    lk = w.tagged(lookup, ac.arm.name, ac.cell.name, "decision")
    specs = v2._seed_specs(w.proto, ac, w.proto.decision_seeds, v2.DECIDE_SUITE)
    ac.decide = v2._fetch(w, lk, specs, prio)


def _val(w: Walk, arm: str, cells: Sequence[str]) -> dict[str, list[float]]:
    out = {}
    for c in cells:
        ac = w.get(arm, c)
        if ac is not None and ac.decide is not None:
            out[c] = v2._val_losses(ac.decide)
    return out


def walk(lookup: Lookup, timing_lookup: Callable[[str], Result | None]) -> WalkV3:
    p = protocol()
    w = WalkV3(Walk(p))
    b = w.base
    # (1) cost on the model users train, per hardware class
    for question, cls, spec in cost_specs():
        r = timing_lookup(spec.run_id)
        if r is None:
            b.need((P_COST,), [spec])
        else:
            w.costs[spec.run_id] = r
            w.cost_of[(question, cls)] = float(r["ratio"])
    # (2) decision runs: the tuned arms (v2's tuning) and the matched ones, on all 7 cells
    for ci, cell in enumerate(p.cells):
        for i, arm in enumerate(TUNED):
            v2._study_arm_cell(
                b, arm, cell, lookup, (P_DECIDE, ci, i), decide_prio=(P_DECIDE, ci, i)
            )
        for i, (arm, parent) in enumerate(MATCHED.values()):
            ac = _matched_cell(b, arm, parent, cell)
            _decide_runs(b, ac, lookup, (P_DECIDE, ci, 10 + i))
    _decisions(w)
    final = final_arms(w)
    if final is not None:
        from rootopt_analysis.bench import study_v3_real as real

        real.walk(w, final[0], timing_lookup)
        _retune_family(w, final[0], lookup, timing_lookup)
        _horizon_family(w, final, lookup)
        _qablation_family(w, final[0], lookup)
        _report_family(w, final, lookup)
    # information: the study tasks' step cost of every decision arm against AdamW
    tasks = sorted({c.task for c in p.cells})
    for arm in (*TUNED, *(m for m, _ in MATCHED.values())):
        v2._cost_jobs(b, arm, tasks, timing_lookup)
    b.jobs = [
        (prio if prio[0] != v2.P_COST else (P_TASK_TIMING, *prio[1:]), j) for prio, j in b.jobs
    ]
    b.jobs.sort(key=lambda pj: pj[0])
    by_id: dict[str, tuple[tuple[int, ...], Any]] = {}
    for pj in b.jobs:
        by_id.setdefault(pj[1].run_id, pj)
    b.jobs = list(by_id.values())
    w.complete = not b.jobs and final_arms(w) is not None
    return w


def final_arms(w: WalkV3) -> tuple[Arm, Arm] | None:
    """(the decided default for this machine's CPU class, its float32 form C), once both
    questions are decided."""
    d2 = w.decisions.get("ns_dtype")
    if d2 is None:
        return None
    c = COEFFICIENTS[w.decisions["ns_coefficients"]["winner"]]
    if d2["per_class"]["native"]["winner"] == "bfloat16":
        return MATCHED[f"{c.name}·bf16"][0], c
    return c, c


def _report(
    b: Walk,
    ac: ArmCell,
    lookup: Lookup,
    prio: tuple[int, ...],
    *,
    steps: int | None = None,
    role: str = "report",
) -> list[Result] | None:
    """The report seeds' runs of ``ac`` at its tuned setting (``steps``: another length)."""
    if ac.tuned is None:
        return None
    lk = b.tagged(lookup, ac.arm.name, ac.cell.name, role)
    specs = v2._seed_specs(b.proto, ac, b.proto.report_seeds, v2.REPORT_SUITE, steps=steps)
    return v2._fetch(b, lk, specs, prio)


def _arm_cell(w: WalkV3, arm: Arm, cell: Cell, lookup: Lookup, prio: tuple[int, ...]) -> ArmCell:
    """``arm`` on ``cell``: a matched arm takes its parent's setting there, a tuned one is
    tuned (or transferred from its base cell) as v2 does."""
    b = w.base
    if arm.name in MATCHED or arm.name in _EXTRA:
        _, parent = MATCHED.get(arm.name) or _EXTRA[arm.name]
        _arm_cell(w, parent, cell, lookup, prio)
        return _matched_cell(b, arm, parent, cell)
    if cell.base is not None:  # the base cell's setting first (a transfer chain)
        _arm_cell(w, arm, _cell(w, cell.base), lookup, prio)
    return v2._study_arm_cell(b, arm, cell, lookup, prio)


# matched arms made after the decision (q ablation, no threshold): name -> (arm, parent)
_EXTRA: dict[str, tuple[Arm, Arm]] = {}


def _derived(parent: Arm, suffix: str, label: str, **opts: Any) -> Arm:
    arm = matched(parent, suffix, label, **opts)
    _EXTRA.setdefault(arm.name, (arm, parent))
    return _EXTRA[arm.name][0]


def _retune_family(
    w: WalkV3, final: Arm, lookup: Lookup, timing_lookup: Callable[[str], Result | None]
) -> None:
    """Weight decay × AdamW-side multiple at each arm's tuned lr, then the lr again, on
    RETUNE_SEEDS; report seeds at equal steps and at equal measured time."""
    b, p = w.base, w.base.proto
    for ci, cname in enumerate(RETUNE_CELLS):
        cell = p.cell(cname)
        settings: dict[str, Setting] = {}
        for i, arm in enumerate((final, MUON)):
            ac = _arm_cell(w, arm, cell, lookup, (P_RETUNE, ci, i))
            if ac.tuned is None:
                continue
            entry = w.retuned.setdefault((arm.name, cname), {"start": ac.tuned.setting})
            got = _retune(b, arm, cell, ac.tuned.setting, lookup, (P_RETUNE, ci, i))
            if got is None:
                continue
            entry["setting"], entry["history"] = got
            settings[arm.name] = got[0]
            rt = ArmCell(arm, cell, Tuned(got[0]))
            entry["report"] = _report(b, rt, lookup, (P_RETUNE, ci, 10 + i), role="re-tuned")
        if len(settings) == 2:
            _equal_time(w, final, cell, settings, lookup, timing_lookup, (P_EQUAL_TIME, ci))


def _retune(
    b: Walk, arm: Arm, cell: Cell, start: Setting, lookup: Lookup, prio: tuple[int, ...]
) -> tuple[Setting, list[dict[str, Any]]] | None:
    p = b.proto
    lk = b.tagged(lookup, arm.name, cell.name, "re-tuning")

    def scores(points: Sequence[Setting]) -> dict[Setting, float] | None:
        out: dict[Setting, float] = {}
        for s in points:
            specs = [make_spec(arm, cell, s, sd, p.per_decade) for sd in RETUNE_SEEDS]
            got = v2._fetch(b, lk, specs, prio)
            if got is not None:
                out[s] = v2.selection_score(got)
        return out if len(out) == len(points) else None

    sides = [start.j + o for o in RETUNE_SIDE] if arm.side else [start.j]
    grid = [Setting(start.k, j, wd) for wd in RETUNE_WD for j in sides]
    first = scores(grid)
    if first is None:
        return None
    best = min(grid, key=lambda s: (first[s], s.wd, abs(s.j - start.j)))
    lrs = [replace(best, k=best.k + o) for o in (-1, 0, 1)]
    second = scores(lrs)
    if second is None:
        return None
    chosen = min(lrs, key=lambda s: (second[s], abs(s.k - best.k)))
    history = [
        {
            "phase": phase,
            "points": [{**s.as_dict(arm, p.per_decade), "val_loss": v} for s, v in sc.items()],
        }
        for phase, sc in (("weight decay × AdamW-side multiple", first), ("lr", second))
    ]
    return chosen, history


def _equal_time(
    w: WalkV3,
    final: Arm,
    cell: Cell,
    settings: dict[str, Setting],
    lookup: Lookup,
    timing_lookup: Callable[[str], Result | None],
    prio: tuple[int, ...],
) -> None:
    """Both re-tuned arms timed interleaved on ``cell``'s task; the slower one trained for
    ``round(steps · t_fast / t_slow)`` steps on the report seeds."""
    b, p = w.base, w.base.proto
    spec = v2.TimingSpec(
        cell.task,
        make_spec(final, cell, settings[final.name], 0, p.per_decade),
        make_spec(MUON, cell, settings[MUON.name], 0, p.per_decade),
        p.timing_steps,
        p.timing_warmup,
    )
    r = timing_lookup(spec.run_id)
    if r is None:
        b.need(prio, [spec])
        return
    ratio = float(r["ratio"])  # t_final / t_muon
    steps = {
        final.name: round(cell.steps / ratio) if ratio > 1 else cell.steps,
        MUON.name: round(cell.steps * ratio) if ratio < 1 else cell.steps,
    }
    entry: dict[str, Any] = {"timing": r, "steps": steps, "report": {}}
    for i, arm in enumerate((final, MUON)):
        rt = ArmCell(arm, cell, Tuned(settings[arm.name]))
        entry["report"][arm.name] = _report(
            b, rt, lookup, (*prio, i), steps=steps[arm.name], role="equal time"
        )
    w.equal_time[cell.name] = entry


def _horizon_family(w: WalkV3, final: tuple[Arm, Arm], lookup: Lookup) -> None:
    """The default, it in float32, it without the threshold, torch.optim.Muon and AdamW at
    the horizon cells (transferred from their base cells), on the report seeds."""
    default, c = final
    noq = _derived(default, "noq", "no threshold", outlier_quantile=None)
    arms = list(dict.fromkeys((default, c, noq, MUON, ADAMW)))
    for hi, cell in enumerate(HORIZON):
        for i, arm in enumerate(arms):
            ac = _arm_cell(w, arm, cell, lookup, (P_HORIZON, hi, i))
            if ac.report is None:
                ac.report = _report(w.base, ac, lookup, (P_HORIZON, hi, 10 + i))


def _qablation_family(w: WalkV3, default: Arm, lookup: Lookup) -> None:
    for ci, cname in enumerate(QABL_CELLS):
        cell = _cell(w, cname)
        for i, q in enumerate(QABL):
            tag = "noq" if q is None else f"q{q:g}"
            arm = _derived(
                default, tag, "no threshold" if q is None else f"q={q:g}", outlier_quantile=q
            )
            ac = _arm_cell(w, arm, cell, lookup, (P_QABL, ci, i))
            if ac.report is None:
                ac.report = _report(w.base, ac, lookup, (P_QABL, ci, i))
        ac = _arm_cell(w, default, cell, lookup, (P_QABL, ci, 9))
        if ac.report is None:
            ac.report = _report(w.base, ac, lookup, (P_QABL, ci, 9))


def _report_family(w: WalkV3, final: tuple[Arm, Arm], lookup: Lookup) -> None:
    """The README's table: the default, its float32 form, torch.optim.Muon and AdamW on the
    seven cells, report seeds, at the v2 tuning."""
    default, c = final
    for ci, cell in enumerate(w.base.proto.cells):
        for i, arm in enumerate(dict.fromkeys((default, c, MUON, ADAMW))):
            ac = _arm_cell(w, arm, cell, lookup, (P_REPORT, ci, i))
            if ac.report is None:
                ac.report = _report(w.base, ac, lookup, (P_REPORT, ci, i))


def _cell(w: WalkV3, name: str) -> Cell:
    for c in (*w.base.proto.cells, *HORIZON):
        if c.name == name:
            return c
    raise KeyError(name)


def _decisions(w: WalkV3) -> None:
    b = w.base
    polar, muon = _val(b, ROOT_POLAR.name, LM_CELLS), _val(b, ROOT_MUON.name, LM_CELLS)
    d1 = pooled_difference(polar, muon, LM_CELLS)
    cost1 = w.cost_of.get(("ns_coefficients", "native"))
    if d1 is None or cost1 is None:
        return
    v1 = verdict(d1, cost1, "polar_express", "muon", SIMPLER_COEFFICIENTS)
    w.decisions["ns_coefficients"] = {
        "a": ROOT_POLAR.name,
        "b": ROOT_MUON.name,
        "difference": d1,
        "cost_ratio": cost1,
        **v1,
        "cnn": pooled_difference(
            _val(b, ROOT_POLAR.name, CNN_CELLS), _val(b, ROOT_MUON.name, CNN_CELLS), CNN_CELLS
        ),
    }
    parent = COEFFICIENTS[v1["winner"]]
    bf16 = MATCHED[f"{parent.name}·bf16"][0]
    d2 = pooled_difference(_val(b, bf16.name, LM_CELLS), _val(b, parent.name, LM_CELLS), LM_CELLS)
    if d2 is None:
        return
    per_class: dict[str, Any] = {}
    for cap in ISA_CLASSES:
        cls = cap or "native"
        ratio = w.cost_of.get((f"ns_dtype/{v1['winner']}", cls))
        if ratio is None:
            return
        per_class[cls] = {
            "cost_ratio": ratio,
            **verdict(d2, ratio, "bfloat16", "float32", SIMPLER_DTYPES),
        }
    # CUDA: bfloat16 is the cheaper by the documented tensor-core peaks (not measured here)
    per_class["cuda"] = {
        "cost_ratio": None,
        **verdict(d2, 0.5, "bfloat16", "float32", SIMPLER_DTYPES),
    }
    plain = pooled_difference(
        _val(b, f"{ROOT_POLAR.name}·bf16·plain", LM_CELLS),
        _val(b, f"{ROOT_POLAR.name}·plain", LM_CELLS),
        LM_CELLS,
    )
    tuned_bf16 = pooled_difference(_val(b, ROOT_POLAR_BF16.name, LM_CELLS), polar, LM_CELLS)
    w.decisions["ns_dtype"] = {
        "a": bf16.name,
        "b": parent.name,
        "difference": d2,
        "per_class": per_class,
        "same_form": plain,
        "tuned_apart": tuned_bf16,
        "cnn": pooled_difference(
            _val(b, bf16.name, CNN_CELLS), _val(b, parent.name, CNN_CELLS), CNN_CELLS
        ),
    }


# ----------------------------------------------------------------------------- running


def open_store(out: Path) -> Store:
    return v2.open_store(out)


def reused_lookup(store: Store, earlier: Sequence[Store]) -> Lookup:
    """Look a run up in this study's store, then (selection runs only) in v2's record."""

    def lookup(spec: RunSpec) -> Result | None:
        r = store.runs.get(spec.run_id)
        if r is None and spec.suite == v2.SELECT_SUITE:
            for s in earlier:
                r = s.runs.get(spec.run_id)
                if r is not None:
                    break
        return r

    return lookup


def run_study(
    out: Path,
    earlier: Sequence[Path],
    *,
    workers: int,
    compute: bool = True,
    progress: bool = True,
    commit: str | None = None,
    log: Callable[[str], None] | None = None,
) -> tuple[WalkV3, Store]:
    """Run every job v3 still needs, highest priority first, re-planning after each."""
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "timing").mkdir(parents=True, exist_ok=True)
    store = open_store(out)
    lookup = reused_lookup(store, [v2.open_store(e) for e in earlier])

    def replan() -> WalkV3:
        return walk(lookup, store.timing.get)

    def finished(job: Any, r: Result) -> str:
        if isinstance(job, RunSpec):
            store.add_runs([r], commit=commit)
        else:  # every other record: timing.jsonl
            store.add_timings([{**r, "commit": commit}])
        return _job_line(job, r)

    if not compute:
        return replan(), store
    w = v2.drive(
        replan, _run_job, finished, out, workers=workers, progress=progress, say=say, label="v3"
    )
    return w, store


# ----------------------------------------------------------------------------- summary


BEGIN = "<!-- study-v3:begin (generated by `rootopt bench study --protocol v3`; do not edit by hand) -->"
END = "<!-- study-v3:end -->"


FAMILY_LABELS = {
    P_COST: "cost",
    P_DECIDE: "decision runs",
    P_REAL: "real-model cell",
    P_RETUNE: "re-tuning",
    P_EQUAL_TIME: "equal time",
    P_HORIZON: "horizon",
    P_QABL: "q ablation",
    P_REPORT: "report runs",
    P_TASK_TIMING: "task timings",
}


def _comparisons(w: WalkV3, cells: dict[str, Any]) -> list[dict[str, Any]]:
    """Paired differences in test loss (report seeds) per cell, a − b, where both ran; the
    default − Muon row Holm-corrected over its cells (the README's bold rule)."""
    final = final_arms(w)
    if final is None:
        return []
    default, c = final
    pairs = [
        ("default − torch.optim.Muon", default.name, MUON.name),
        ("default − AdamW", default.name, ADAMW.name),
        ("default − its float32 form", default.name, c.name),
        ("no threshold − default", f"{default.name}·noq", default.name),
        *(
            (f"q = {q:g} − q = 0.9", f"{default.name}·q{q:g}", default.name)
            for q in QABL
            if q is not None
        ),
    ]
    out = []
    for label, a, b in pairs:
        if a == b:
            continue
        per: dict[str, Any] = {}
        for cname, cell in cells.items():
            ra, rb = cell["arms"].get(a), cell["arms"].get(b)
            d = v2._paired_or_none(ra and ra["test_loss"], rb and rb["test_loss"])
            if d is not None:
                per[cname] = d
        row: dict[str, Any] = {"label": label, "a": a, "b": b, "cells": per}
        if label == "default − torch.optim.Muon" and per:
            from rootopt_analysis.bench.stats import holm

            names = list(per)
            for n, p_adj in zip(names, holm([per[n]["p"] for n in names]), strict=True):
                per[n]["p_holm"] = p_adj
                per[n]["bold"] = p_adj <= 0.05
        out.append(row)
    return out


def _retuned_summary(w: WalkV3) -> dict[str, Any]:
    p = w.base.proto
    out: dict[str, Any] = {}
    for (arm, cell), e in w.retuned.items():
        a = w.base.arms.get(arm) or arm_by_name(arm)
        out[f"{arm}|{cell}"] = {
            "arm": arm,
            "cell": cell,
            "start": e["start"].as_dict(a, p.per_decade),
            "setting": e["setting"].as_dict(a, p.per_decade) if "setting" in e else None,
            "history": e.get("history"),
            "test_loss": v2._losses(e.get("report")),
        }
    return out


CURVE_AT = (0.1, 0.25, 0.5, 0.75, 1.0)  # fractions of a horizon run's steps


def _horizon_curves(w: WalkV3, cells: dict[str, Any]) -> dict[str, Any]:
    """Per horizon cell, the paired test-loss difference of the default against each other
    arm at the evaluations nearest 10 %, 25 %, 50 %, 75 % and 100 % of the run: where the
    edge over Muon goes with the horizon."""
    final = final_arms(w)
    if final is None:
        return {}
    default = final[0].name
    out: dict[str, Any] = {}
    for cell in (c.name for c in HORIZON):
        arms = (cells.get(cell) or {}).get("arms", {})
        mine = (arms.get(default) or {}).get("curves")
        if not mine:
            continue
        steps = mine[0]["steps"]
        at = [min(range(len(steps)), key=lambda i: abs(steps[i] - f * steps[-1])) for f in CURVE_AT]
        rows: dict[str, Any] = {}
        for other, r in arms.items():
            theirs = r.get("curves")
            if other == default or not theirs or theirs[0]["steps"] != steps:
                continue
            rows[other] = [
                v2._paired_or_none(
                    [c["test_loss"][i] for c in mine], [c["test_loss"][i] for c in theirs]
                )
                for i in at
            ]
        out[cell] = {"steps": [steps[i] for i in at], "default − arm": rows}
    return out


def _retuned_comparison(w: WalkV3) -> dict[str, Any]:
    """Per re-tuned cell, default − torch.optim.Muon at the re-tuned settings (equal steps)."""
    final = final_arms(w)
    if final is None:
        return {}
    out: dict[str, Any] = {}
    for cell in RETUNE_CELLS:
        mine, theirs = (
            v2._losses((w.retuned.get((a, cell)) or {}).get("report"))
            for a in (final[0].name, MUON.name)
        )
        out[cell] = v2._paired_or_none(mine, theirs)
    return out


def _equal_time_summary(w: WalkV3) -> dict[str, Any]:
    out: dict[str, Any] = {}
    final = final_arms(w)
    for cell, e in w.equal_time.items():
        tests = {arm: v2._losses(rs) for arm, rs in e["report"].items()}
        row: dict[str, Any] = {
            "ratio": e["timing"]["ratio"],
            "machine": e["timing"].get("machine"),
            "steps": e["steps"],
            "test_loss": tests,
        }
        if final is not None:
            row["default − torch.optim.Muon"] = v2._paired_or_none(
                tests.get(final[0].name), tests.get(MUON.name)
            )
        out[cell] = row
    return out


def _real_summary(w: WalkV3) -> dict[str, Any]:
    if not w.real:
        return {}
    arms: dict[str, Any] = {}
    for arm, e in w.real.get("arms", {}).items():
        reports = e.get("report")
        arms[arm] = {
            "optimizer": e["optimizer"],
            "options": e["options"],
            "selection": {lr: r.get("final_val_loss") for lr, r in e.get("selection", {}).items()},
            "lr": e.get("lr"),
            "test_loss": [r.get("final_test_loss", math.nan) for r in reports] if reports else None,
            "val_loss": [r.get("final_val_loss") for r in reports] if reports else None,
            "val_curves": [r.get("val_curve") for r in reports] if reports else None,
            "wall_s": [r.get("wall_s") for r in reports] if reports else None,
        }
    final = final_arms(w)
    diffs = {}
    if final is not None:
        mine = arms.get(final[0].name, {}).get("test_loss")
        for other in (MUON.name, ADAMW.name):
            diffs[other] = v2._paired_or_none(mine, arms.get(other, {}).get("test_loss"))
    return {
        "cell": w.real.get("cell"),
        "data": w.real.get("data"),
        "arms": arms,
        "default − other": diffs,
    }


def summarize(w: WalkV3, store: Store, meta: dict[str, Any]) -> dict[str, Any]:
    """v3 as JSON-able data: costs with their machines, decisions with pooled intervals,
    per-arm results, the families after the decision, the run index and what is pending."""
    b = w.base
    cells: dict[str, Any] = {}
    names = list(dict.fromkeys(c for _, c in b.cells))
    for cname in names:
        c = _cell(w, cname)
        rows = {name: v2._arm_row(b, ac) for name in b.arms if (ac := b.get(name, cname))}
        if rows:
            cells[cname] = {"task": c.task, "steps": c.steps, "base": c.base, "arms": rows}
    pending: dict[str, int] = {}
    for prio, _ in b.jobs:
        label = FAMILY_LABELS.get(prio[0], str(prio[0]))
        pending[label] = pending.get(label, 0) + 1
    final = final_arms(w)
    machines = sorted(
        {
            _cpu_label(m)
            for r in (*store.runs.values(), *store.timing.values())
            if isinstance(m := r.get("machine"), dict) and not m.get("onednn_max_cpu_isa")
        }
    )
    return {
        "format": 3,
        "meta": {**meta, "cpus": machines},
        "protocol": {
            "seeds": {"selection": SELECTION, "decision": DECISION, "report": REPORT},
            "margin": MARGIN,
            "cost_tie": COST_TIE,
            "lm_cells": LM_CELLS,
            "cnn_cells": CNN_CELLS,
            "isa_classes": [c or "native" for c in ISA_CLASSES],
            "cost_model": {"llama": LLAMA, "batch": LLAMA_BATCH, "steps": COST_STEPS},
            "grids": asdict(b.proto)["lr_grid"],
            "retune": {
                "cells": RETUNE_CELLS,
                "seeds": RETUNE_SEEDS,
                "wd": RETUNE_WD,
                "side": RETUNE_SIDE,
            },
            "horizon": [c.name for c in HORIZON],
            "q_ablation": {"cells": QABL_CELLS, "q": QABL},
        },
        "complete": w.complete,
        "jobs_left": len(b.jobs),
        "pending": pending,
        "costs": list(w.costs.values()),
        "decisions": w.decisions,
        "default": {"arm": final[0].name, "float32": final[1].name} if final else None,
        "cells": cells,
        "comparisons": _comparisons(w, cells),
        "retuned": _retuned_summary(w),
        "retuned_comparison": _retuned_comparison(w),
        "horizon_curves": _horizon_curves(w, cells),
        "equal_time": _equal_time_summary(w),
        "real_model": _real_summary(w),
        "index": _index(b, store),
    }


def _cpu_label(m: dict[str, Any]) -> str:
    """``CPU (instruction set)`` of one record's machine, with oneDNN's cap where a run set one."""
    cap = f"; oneDNN capped at {m['onednn_max_cpu_isa']}" if m.get("onednn_max_cpu_isa") else ""
    return f"{m.get('cpu')} ({m.get('isa')}{cap})"


def _machine_label(m: Any) -> str | None:
    return _cpu_label(m) if isinstance(m, dict) else None


def _index(b: v2.Walk, store: Store) -> dict[str, Any]:
    """v2's run index with the machine each run ran on (CPU and instruction set: the protocol's
    "every run and timing record names the CPU"; the timing records carry theirs in ``costs``
    and ``equal_time``)."""
    idx = v2._index(b, store)
    idx["columns"] = [*idx["columns"], "machine"]
    idx["rows"] = [[*row, _machine_label(store.runs[row[0]].get("machine"))] for row in idx["rows"]]
    return idx


_iv = study_v3_pages._iv  # one format for a pooled interval on the page and in the claims


def markdown(s: dict[str, Any]) -> str:
    """The summary as the page block of docs/benchmarks.md (v3)."""
    meta = s.get("meta") or {}
    lines = [BEGIN, "", "#### Provenance", ""]
    for key in ("commits", "machine", "cpus", "ran", "runs"):
        value = meta.get(key)
        if value:
            shown = ", ".join(f"`{v}`" for v in value) if isinstance(value, list) else value
            lines.append(f"- {key}: {shown}")
    status = (
        "complete"
        if s["complete"]
        else "running: " + ", ".join(f"{k} {v}" for k, v in s["pending"].items())
    )
    lines += [f"- status: {status}", ""]
    lines += ["#### Cost on the model users train (one training step, arm over reference)", ""]
    lines += [
        "| arm / reference | oneDNN cap | CPU (class) | bf16 units used | step ratio |",
        "|---|---|---|---|---|",
    ]
    for r in s["costs"]:
        m, spec = r["machine"], r["spec"]
        arm, ref = (dict(spec[k].get("options", [])) for k in ("arm", "ref"))
        pair = " / ".join(f"{o.get('ns_coefficients')}, {o.get('ns_dtype')}" for o in (arm, ref))
        lines.append(
            f"| {pair} | {spec['isa_cap'] or 'none'} | {m['cpu']} ({m['isa']}) | "
            f"{'yes' if m['native_bf16'] else 'no'} | {r['ratio']:.3f} |"
        )
    lines += ["", "#### Decisions (validation loss, decision seeds, pooled over the LM cells)", ""]
    d = s["decisions"]
    q1 = d.get("ns_coefficients")
    if q1 is None:
        lines.append("- **ns_coefficients**: pending")
    else:
        lines.append(
            f"- **ns_coefficients** → `{q1['winner']}` ({q1['why']}): `{q1['a']}` − `{q1['b']}` "
            f"{_iv(q1['difference'])}; step cost ratio {q1['cost_ratio']:.3f}; CNN cells beside: "
            f"{_iv(q1['cnn'])}"
        )
    q2 = d.get("ns_dtype")
    if q2 is None:
        lines.append("- **ns_dtype**: pending")
    else:
        per = "; ".join(
            f"{cls}: `{v['winner']}` ({v['why']}"
            + (f", cost ×{v['cost_ratio']:.3f}" if v["cost_ratio"] is not None else "")
            + ")"
            for cls, v in q2["per_class"].items()
        )
        lines += [
            f"- **ns_dtype**: `{q2['a']}` − `{q2['b']}` {_iv(q2['difference'])}. Per class: {per}.",
            f"  - same iteration form (plain, both dtypes): {_iv(q2['same_form'])}",
            f"  - v2's separately tuned bf16 arm − `root-polar`: {_iv(q2['tuned_apart'])}",
            f"  - CNN cells beside: {_iv(q2['cnn'])}",
        ]
    lines += _after_decision_md(s)
    lines += _mechanism_md(s)
    claims = study_v3_pages.claims(s)
    if claims:
        lines += ["", "#### The README's claims, each with its interval", ""]
        lines += [f"- {c}" for c in claims]
    lines += ["", "#### Mean final validation loss of the decision runs", ""]
    decided = [n for n in s["cells"] if n in (*LM_CELLS, *CNN_CELLS)]
    arms = sorted({a for n in decided for a in s["cells"][n]["arms"]})
    names = decided
    lines += ["| arm | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for a in arms:
        cells = []
        for c in names:
            row = s["cells"][c]["arms"].get(a)
            vals = row and row.get("decision_val_loss")
            ok = vals and all(math.isfinite(v) for v in vals)
            cells.append(f"{statistics.fmean(vals):.4f}" if ok else ("diverged" if vals else ""))
        lines.append(f"| `{a}` | " + " | ".join(cells) + " |")
    lines += ["", END]
    return "\n".join(lines) + "\n"


def _ci(d: dict[str, Any] | None) -> str:
    if d is None:
        return "pending"
    text = f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]"
    return f"**{text}**" if d.get("bold") else text


def _mean(xs: Sequence[float] | None) -> str:
    ok = (
        xs is not None
        and len(xs) > 0
        and all(isinstance(x, float) and math.isfinite(x) for x in xs)
    )
    return (
        f"{statistics.fmean(xs):.3f}"
        if ok and xs is not None
        else ("pending" if not xs else "diverged")
    )


def _setting(d: dict[str, Any]) -> str:
    return f"{d['lr']:.3g}, {d['side_lr_mult']}, {d['weight_decay']:g}"


def _after_decision_md(s: dict[str, Any]) -> list[str]:
    if not s.get("default"):
        return []
    lines = ["", f"#### After the decision (the default here: `{s['default']['arm']}`)", ""]
    lines += ["Paired differences a − b in final test loss (report seeds; 95 % t interval; "
              "bold: Holm-corrected over the row's cells, p <= 0.05).", ""]  # fmt: skip
    cells = sorted({c for row in s["comparisons"] for c in row["cells"]})
    if cells:
        lines += ["| a − b | " + " | ".join(cells) + " |", "|---|" + "---|" * len(cells)]
        for row in s["comparisons"]:
            vals = [_ci(row["cells"].get(c)) if c in row["cells"] else "" for c in cells]
            lines.append(f"| {row['label']} | " + " | ".join(vals) + " |")
    rt = s.get("retuned") or {}
    if rt:
        lines += ["", "Re-tuned (weight decay × AdamW-side multiple, then lr; seeds 100–102):", ""]
        lines += [
            "| arm | cell | from (lr, side, wd) | to (lr, side, wd) | test loss (mean) |",
            "|---|---|---|---|---|",
        ]
        for e in rt.values():
            to = e["setting"]
            lines.append(
                f"| `{e['arm']}` | {e['cell']} | {_setting(e['start'])} | "
                f"{_setting(to) if to else 'pending'} | {_mean(e['test_loss'])} |"
            )
        pairs = (s.get("retuned_comparison") or {}).items()
        lines += ["", *(f"- {c}, re-tuned, equal steps: default − Muon {_ci(d)}" for c, d in pairs)]
    et = s.get("equal_time") or {}
    if et:
        lines += ["", "Equal measured time (re-tuned settings; the slower arm's steps cut):", ""]
        lines += [
            "| cell | step time default / Muon | steps | default − Muon |",
            "|---|---|---|---|",
        ]
        for cell, e in et.items():
            steps = ", ".join(f"`{a}` {n}" for a, n in e["steps"].items())
            lines.append(
                f"| {cell} | {e['ratio']:.3f} | {steps} | {_ci(e.get('default − torch.optim.Muon'))} |"
            )
    for cell, e in (s.get("horizon_curves") or {}).items():
        steps = " | ".join(f"step {n:,}" for n in e["steps"])
        lines += ["", f"Over the run on {cell}: default − arm, paired test loss:", ""]
        lines += [f"| arm | {steps} |", "|---|" + "---|" * len(e["steps"])]
        for arm, ds in e["default − arm"].items():
            lines.append(f"| `{arm}` | " + " | ".join(_ci(d) for d in ds) + " |")
    real = s.get("real_model") or {}
    if real.get("arms"):
        lines += [
            "",
            f"Real-model cell `{real['cell']}` (test loss through `rootopt export` and "
            "transformers). Validation holds out blocks of the training files, the test split "
            "whole files no run trained on, so test loss is the higher:",
            "",
        ]
        lines += [
            "| arm | optimizer | lr (selection val losses) | val loss (mean) | test loss (mean) |",
            "|---|---|---|---|---|",
        ]
        for arm, e in real["arms"].items():
            sel = ", ".join(
                f"{lr}: {v:.3f}" if isinstance(v, float) else f"{lr}: –"
                for lr, v in e["selection"].items()
            )
            lines.append(
                f"| `{arm}` | {e['optimizer']} | {e['lr'] or 'pending'} ({sel}) | "
                f"{_mean(e['val_loss'])} | {_mean(e['test_loss'])} |"
            )
        for other, d in (real.get("default − other") or {}).items():
            lines.append(f"- default − `{other}`: {_ci(d)}")
    return lines


def _mechanism_md(s: dict[str, Any]) -> list[str]:
    """What the default's threshold clipped at the last evaluation of its report runs, per
    cell (mean over seeds; docs/benchmarks.md, v3 "Mechanism")."""
    arm = (s.get("default") or {}).get("arm")
    rows = []
    for cname, c in s["cells"].items():
        t = (c["arms"].get(arm) or {}).get("momentum_tail") if arm else None
        if not t or not t.get("clipped_share"):
            continue
        rows.append(
            f"| {cname} | {100 * t['clipped_share'][-1]:.1f} % | "
            f"{100 * t['clipped_over3rms'][-1]:.2f} % | {100 * t['clipped_over10rms'][-1]:.3f} % | "
            f"{100 * t['clipped_norm2_share'][-1]:.2f} % | {t['q90_over_rms_median'][-1]:.2f} |"
        )
    if not rows:
        return []
    return [
        "",
        f"What the threshold clips (`{arm}`, the momentum it orthogonalizes, last evaluation, "
        "mean over report seeds; a Gaussian's 0.9-quantile is 1.64 RMS):",
        "",
        "| cell | entries clipped | of them > 3× RMS | of them > 10× RMS | "
        "clipped part of ‖M‖² | q0.9 / RMS (median matrix) |",
        "|---|---|---|---|---|---|",
        *rows,
    ]


def _cost_main(arg: str) -> int:
    print(json.dumps(_cost_child(CostSpec.from_dict(json.loads(arg)))))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--cost":
        sys.exit(_cost_main(sys.argv[2]))
    sys.exit(2)
