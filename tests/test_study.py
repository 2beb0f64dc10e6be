"""The defaults study's machinery: paired intervals, the tuner's grid rules, the decision rule,
and the whole pipeline on tiny runs (docs/benchmarks.md, "Defaults study")."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rootopt.bench import study
from rootopt.bench.runner import RunSpec
from rootopt.bench.stats import mean_ci, paired_ci
from rootopt.bench.study import (
    COEFFICIENT_CANDIDATES,
    Cell,
    Protocol,
    Setting,
    Tuner,
    Walk,
    decide,
    make_spec,
    selection_score,
)

SRC = str(Path(__file__).resolve().parents[1] / "src")


# ----------------------------------------------------------------------------- statistics


def test_paired_interval_matches_scipy_and_pairs_by_seed() -> None:
    from scipy import stats

    a = [2.01, 1.98, 2.05, 2.00, 1.97]
    b = [2.05, 2.03, 2.06, 2.04, 2.02]
    ci = paired_ci(a, b)
    d = [x - y for x, y in zip(a, b, strict=True)]
    res = stats.ttest_rel(a, b)
    lo, hi = res.confidence_interval(0.95)
    assert ci.mean == pytest.approx(sum(d) / 5)
    assert (ci.lo, ci.hi) == (pytest.approx(lo), pytest.approx(hi))
    assert ci.hi < 0 and ci.excludes_zero
    # Pairing matters: the same numbers unpaired would not exclude zero this tightly.
    assert ci.hi - ci.lo < (mean_ci(a).hi - mean_ci(a).lo)


def test_intervals_refuse_mismatched_or_non_finite_samples() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        paired_ci([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="non-finite"):
        mean_ci([1.0, math.nan])
    with pytest.raises(ValueError, match="at least 2"):
        mean_ci([1.0])


# ----------------------------------------------------------------------------- tuning


def _proto(**kw: Any) -> Protocol:
    base = Protocol.full()
    return Protocol(**{**base.__dict__, **kw})


def _fake(optimum_k: float, diverge_above: float = math.inf, optimum_j: float = 0.0) -> Any:
    """A lookup whose validation loss is a parabola in the lr exponent k (and side j)."""
    calls: list[RunSpec] = []

    def lookup(spec: RunSpec) -> dict[str, Any]:
        calls.append(spec)
        k = 4 * math.log10(spec.lr / 3e-3)
        j = 4 * math.log10(spec.side_lr_mult)
        loss = 2.0 + 0.01 * (k - optimum_k) ** 2 + 0.002 * (j - optimum_j) ** 2
        loss += 0.001 * (spec.seed % 2)  # the two selection seeds differ a little
        div = k > diverge_above
        return {"final_val_loss": math.nan if div else loss, "diverged": div}

    return lookup, calls


def test_tuner_extends_the_grid_past_an_edge_and_stops_inside() -> None:
    p = _proto()
    lookup, calls = _fake(optimum_k=6.2)  # beyond the grid's top (k = 4)
    arm = study.REFERENCES[-1]  # adamw: lr then weight decay
    t = Tuner(p, arm, Cell("stdlib", 150), lookup).tune(None)
    assert t.setting.k == 6 and not t.edge
    lr_phase = t.history[0]
    ks = [round(4 * math.log10(pt["lr"] / 3e-3)) for pt in lr_phase["points"]]
    assert ks == [-1, 0, 1, 2, 3, 4, 5, 6, 7]  # two extensions, then an interior optimum
    assert t.history[-1]["phase"] == "weight decay"
    assert {s.seed for s in calls} == set(p.selection_seeds)  # never a report seed


def test_tuner_flags_an_optimum_still_on_the_edge_after_the_last_extension() -> None:
    p = _proto(max_extensions=1)
    lookup, _ = _fake(optimum_k=-20)
    t = Tuner(p, study.REFERENCES[-1], Cell("stdlib", 150), lookup).tune(None)
    assert t.setting.k == -2 and t.edge


def test_divergence_scores_infinite_and_is_never_chosen() -> None:
    p = _proto()
    lookup, _ = _fake(optimum_k=4.0, diverge_above=2.5)
    t = Tuner(p, study.REFERENCES[-1], Cell("stdlib", 150), lookup).tune(None)
    assert t.setting.k == 2
    assert selection_score([{"final_val_loss": 1.0, "diverged": False}] * 2) == 1.0
    assert selection_score([{"final_val_loss": 1.0, "diverged": True}] * 2) == math.inf


def test_side_lr_and_transfer_from_a_base_cell() -> None:
    p = _proto()
    lookup, _ = _fake(optimum_k=2.0, optimum_j=-4.0)
    arm = COEFFICIENT_CANDIDATES[0]
    base = Tuner(p, arm, Cell("stdlib", 150), lookup).tune(None)
    assert (base.setting.k, base.setting.j) == (2, -4)
    phases = [h["phase"] for h in base.history]
    assert phases == ["lr", "AdamW-side lr multiple", "weight decay"]
    lookup2, calls = _fake(optimum_k=1.0, optimum_j=-4.0)
    long = Tuner(p, arm, Cell("stdlib", 600, base="stdlib@150"), lookup2).tune(base)
    assert long.setting.k == 1 and long.setting.j == base.setting.j
    assert long.setting.wd == base.setting.wd
    assert {round(4 * math.log10(s.lr / 3e-3)) for s in calls} == {0, 1, 2, 3}
    # 1, 2, 3 around the base's optimum; the best (1) on the lower edge adds 0.


def test_only_runs_without_a_result_are_requested() -> None:
    """A grid point with one seed finished asks for the other seed only."""
    p = _proto()
    lookup, _ = _fake(optimum_k=1.0)
    arm = COEFFICIENT_CANDIDATES[0]
    cell = Cell("stdlib", 150)
    done = {
        s.run_id for s in [make_spec(arm, cell, Setting(k), 100, p.per_decade) for k in p.lr_grid]
    }

    def partial(spec: RunSpec) -> dict[str, Any] | None:
        return lookup(spec) if spec.run_id in done else None

    with pytest.raises(study.Needs) as exc:
        Tuner(p, arm, cell, partial).tune(None)
    assert sorted(s.seed for s in exc.value.specs) == [101] * len(p.lr_grid)


def test_missing_runs_are_requested_not_guessed() -> None:
    p = _proto()
    with pytest.raises(study.Needs) as exc:
        Tuner(p, COEFFICIENT_CANDIDATES[1], Cell("kjv", 150), lambda s: None).tune(None)
    specs = exc.value.specs
    assert len(specs) == len(p.lr_grid) * len(p.selection_seeds)
    assert all(s.suite == "study" and s.task == "kjv" and s.steps == 150 for s in specs)
    assert all(dict(s.options)["ns_coefficients"] == "muon" for s in specs)


def test_official_coefficients_are_muons_on_every_matrix_the_study_trains() -> None:
    """Why `root-official` is not a separate arm (docs/benchmarks.md)."""
    from rootopt.bench.tasks import TASKS
    from rootopt.coeffs import MUON, resolve
    from rootopt.optim.routing import param_groups

    shapes = set()
    for name in {c.task for c in Protocol.full().cells}:
        groups, _ = param_groups(TASKS[name].model())
        for g in groups:
            if g["algorithm"] == "root":
                shapes |= {(p.shape[0], p[0].numel()) for p in g["params"]}
    assert len(shapes) >= 6
    for rows, cols in shapes:
        assert resolve("official", rows, cols, 5) == MUON.schedule(5), (rows, cols)


# ----------------------------------------------------------------------------- decisions


def _walk_with(losses: dict[str, dict[str, list[float]]], costs: dict[str, float]) -> Walk:
    """A Walk whose report runs have the given test losses per (arm, cell)."""
    cells = tuple(Cell(c.split("@")[0], int(c.split("@")[1])) for c in next(iter(losses.values())))
    w = Walk(_proto(cells=cells))
    for name, per in losses.items():
        arm = study.Arm(name, "root")
        w.arms[name] = arm
        for c in cells:
            ac = study.ArmCell(arm, c, study.Tuned(Setting(0)))
            ac.report = [
                {"final_test_loss": x, "diverged": not math.isfinite(x)} for x in per[c.name]
            ]
            w.cells[(name, c.name)] = ac
        for t in {c.task for c in cells}:
            w.timing[(name, t)] = costs[name]
    return w


def test_decision_worse_by_ci_then_cost_then_rank() -> None:
    a = [2.00, 2.01, 1.99, 2.02, 2.00]
    worse = [x + 0.05 + 0.001 * i for i, x in enumerate(a)]
    tie = [x + 0.001 * (-1) ** i for i, x in enumerate(a)]
    w = _walk_with(
        {
            "old": {"t@1": worse, "u@1": a},
            "cheap": {"t@1": tie, "u@1": tie},
            "best": {"t@1": a, "u@1": a},
        },
        {"old": 1.0, "cheap": 1.0, "best": 1.3},
    )
    d = decide(w, ["old", "cheap", "best"], "x")
    assert d is not None
    assert d["worse_on_cells"] == {"old": 1, "cheap": 0, "best": 0}
    assert d["tied_best"] == ["cheap", "best"]
    assert d["winner"] == "cheap"  # tied within the intervals, 30 % cheaper
    # With equal costs the better mean rank wins.
    w2 = _walk_with(
        {"old": {"t@1": worse}, "cheap": {"t@1": tie}, "best": {"t@1": a}},
        {"old": 1.0, "cheap": 1.0, "best": 1.02},
    )
    d2 = decide(w2, ["old", "cheap", "best"], "x")
    assert d2 is not None and d2["winner"] == "best"


def test_a_divergence_makes_a_candidate_worse_on_that_cell() -> None:
    a = [2.0, 2.1, 2.0, 2.1, 2.0]
    w = _walk_with(
        {"x": {"t@1": [math.nan, *a[1:]]}, "y": {"t@1": [v + 0.5 for v in a]}},
        {"x": 1.0, "y": 1.0},
    )
    d = decide(w, ["x", "y"], "k")
    assert d is not None and d["worse_on_cells"]["x"] == 1 and d["winner"] == "y"


def test_decision_waits_for_every_cell() -> None:
    w = _walk_with({"x": {"t@1": [1.0, 1.1]}, "y": {"t@1": [1.0, 1.2]}}, {"x": 1, "y": 1})
    w.cells[("y", "t@1")].report = None
    assert decide(w, ["x", "y"], "k") is None


# ----------------------------------------------------------------------------- end to end


def test_quick_study_runs_decides_resumes_and_renders(tmp_path: Path) -> None:
    out = tmp_path / "study"
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "rootopt.cli", "bench", "study", "--quick", "--no-progress"]
    p = subprocess.run(
        [*cmd, "--out", str(out)], capture_output=True, text=True, timeout=600, env=env
    )
    assert p.returncode == 0, p.stderr[-2000:]
    s = json.loads((out / "study.json").read_text())
    assert s["complete"] and s["jobs_left"] == 0
    assert set(s["decisions"]) == {
        "screening",
        "ns_coefficients",
        "outlier_quantile",
        "ns_dtype",
        "final",
    }
    survivors = s["decisions"]["screening"]["survivors"]
    assert survivors and s["decisions"]["ns_coefficients"]["candidates"] == survivors
    proto = Protocol.quick()
    for cell in proto.cells:
        rows = s["cells"][cell.name]["arms"]
        names = [a.name for a in COEFFICIENT_CANDIDATES] if cell.base is None else survivors
        for name in names:
            r = rows[name]
            assert len(r["test_loss"]) == len(proto.report_seeds)
            assert r["setting"]["lr"] > 0
    assert s["meta"]["commands"] and s["meta"]["runs"] > 0
    rob = s["robustness"]
    assert set(rob["arms"]) >= {"muon-bf16", "muon-bf16+clip", "adamw", "adamw+clip"}
    md = (out / "study.md").read_text()
    assert md.startswith("<!-- study:begin")
    # Resume: a second invocation runs nothing and rewrites the same tables.
    files = sorted((out / "runs").glob("*.json"))
    before = {f: f.stat().st_mtime_ns for f in files}
    p2 = subprocess.run(
        [*cmd, "--out", str(out)], capture_output=True, text=True, timeout=600, env=env
    )
    assert p2.returncode == 0, p2.stderr[-2000:]
    assert sorted((out / "runs").glob("*.json")) == files
    assert all(f.stat().st_mtime_ns == t for f, t in before.items())
    s2 = json.loads((out / "study.json").read_text())
    assert s2["cells"] == s["cells"] and s2["decisions"] == s["decisions"]


def test_study_refuses_flags_that_would_change_its_protocol(tmp_path: Path) -> None:
    from rootopt.commands.bench import main

    assert main(["study", "--out", str(tmp_path / "o"), "--seeds", "2"]) == 2
    assert not (tmp_path / "o").exists()


def test_selection_runs_evaluate_only_at_the_end_with_the_same_losses(tmp_path: Path) -> None:
    from rootopt.bench.runner import run_one

    (tmp_path / "runs").mkdir()
    kw: dict[str, Any] = dict(task="digits", optimizer="root", lr=3e-3, seed=1, steps=40)
    sel = run_one(RunSpec(suite="study", weight_decay=0.1, **kw), str(tmp_path))
    rep = run_one(RunSpec(suite=study.REPORT_SUITE, weight_decay=0.1, **kw), str(tmp_path))
    assert [e["step"] for e in sel["evals"]] == [0, 40]
    assert [e["step"] for e in rep["evals"]] == [0, 20, 40]
    for key in ("final_val_loss", "final_test_loss", "train_loss"):
        assert sel[key] == rep[key]


def test_a_session_stopped_before_its_end_stays_on_record(tmp_path: Path) -> None:
    """A session logs at its start, so a kill (or a reboot) leaves its commit and command on
    record; its end is the last result it wrote before the next session started."""
    from rootopt.bench.study_report import provenance, read_sessions

    out = tmp_path / "study"
    (out / "runs").mkdir(parents=True)
    (out / "timing").mkdir()
    base = {"command": f"rootopt bench study --out {out}", "machine": "m", "compute": True}
    a = {**base, "commit": "aaa", "session": "a", "start": 1000.0, "end": None}
    b = {**base, "commit": "bbb", "session": "b", "start": 5000.0, "end": None}
    log = out / "study-log.jsonl"
    # a was killed (start entry only); b finished (its end entry follows); one torn line
    lines = [json.dumps(a), json.dumps(b), '{"torn', json.dumps({**b, "end": 6000.0})]
    log.write_text("\n".join(lines) + "\n")
    for name, t, wall in (("r1", 1500.0, 10.0), ("r2", 2500.0, 20.0), ("r3", 5500.0, 5.0)):
        f = out / "runs" / f"{name}.json"
        f.write_text(json.dumps({"run_id": name, "wall_s": wall}))
        os.utime(f, (t, t))
    sessions = read_sessions(log)
    assert len(sessions) == 2
    assert [s["end"] for s in sessions] == [None, 6000.0]
    meta = provenance(sessions, out)
    assert meta["commits"] == ["aaa", "bbb"]
    assert meta["commands"] == ["rootopt bench study --out OUT"]
    assert meta["sessions stopped before their end"] == 1
    # a: 1000 → 2500 (its last run), b: 5000 → 6000
    assert meta["wall_s"] == 1500 + 1000
    assert meta["runs"] == 3 and meta["run_s (sum over runs)"] == 35


def test_benchmarks_page_is_the_committed_study() -> None:
    """docs/benchmarks.md carries exactly the tables rendered from docs/study_results.json."""
    from rootopt.bench.study_report import BEGIN, END, markdown, splice

    docs = Path(__file__).resolve().parents[1] / "docs"
    summary = json.loads((docs / "study_results.json").read_text(encoding="utf-8"))
    page = (docs / "benchmarks.md").read_text(encoding="utf-8")
    assert page.count(BEGIN) == 1 and page.count(END) == 1
    block = markdown(summary)
    assert "#### Decisions" in block and summary["decisions"]["ns_coefficients"]["winner"]
    assert splice(page, block) == page
