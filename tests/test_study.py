"""The defaults study's machinery: paired intervals, the tuner's grid rules, the decision rule,
and the whole pipeline on tiny runs (docs/benchmarks.md, "Defaults study")."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rootopt_analysis.bench import study
from rootopt_analysis.bench.runner import RunSpec
from rootopt_analysis.bench.stats import mean_ci, paired_ci
from rootopt_analysis.bench.study import (
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

PATHS = os.pathsep.join(str(Path(__file__).resolve().parents[1] / d) for d in ("src", "analysis"))


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
    assert all(s.suite == study.SELECT_SUITE and s.task == "kjv" and s.steps == 150 for s in specs)
    assert all(dict(s.options)["ns_coefficients"] == "adanewton" for s in specs)


def test_official_coefficients_are_muons_on_every_matrix_the_study_trains() -> None:
    """Why `root-official` is not a separate arm (docs/benchmarks.md)."""
    from rootopt.coeffs import MUON, resolve
    from rootopt.optim.routing import param_groups
    from rootopt.tasks import TASKS

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


def _walk_with(
    losses: dict[str, dict[str, list[float]]],
    costs: dict[str, float],
    test: dict[str, dict[str, list[float]]] | None = None,
) -> Walk:
    """A Walk whose decision runs have the given validation losses per (arm, cell), and whose
    report runs have the given test losses (default: the same numbers)."""
    cells = tuple(Cell(c.split("@")[0], int(c.split("@")[1])) for c in next(iter(losses.values())))
    w = Walk(_proto(cells=cells))
    for name, per in losses.items():
        arm = study.Arm(name, "root")
        w.arms[name] = arm
        for c in cells:
            ac = study.ArmCell(arm, c, study.Tuned(Setting(0)))
            ac.decide = [
                {"final_val_loss": x, "diverged": not math.isfinite(x)} for x in per[c.name]
            ]
            ac.report = [
                {"final_test_loss": x, "diverged": not math.isfinite(x)}
                for x in (test or losses)[name][c.name]
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
    w.cells[("y", "t@1")].decide = None
    assert decide(w, ["x", "y"], "k") is None


def test_decision_reads_validation_of_the_decision_seeds_never_test() -> None:
    """Protocol v2: the rule ranks on the decision runs' validation loss; the report runs'
    test loss (here the opposite ranking) changes nothing."""
    good = [2.00, 2.01, 1.99, 2.02, 2.00]
    bad = [x + 0.05 + 0.001 * i for i, x in enumerate(good)]
    val = {"x": {"t@1": good, "u@1": good}, "y": {"t@1": bad, "u@1": bad}}
    test = {"x": {"t@1": bad, "u@1": bad}, "y": {"t@1": good, "u@1": good}}
    d = decide(_walk_with(val, {"x": 1.0, "y": 1.0}, test), ["y", "x"], "k")
    assert d is not None and d["winner"] == "x" and d["split"] == "validation"
    assert d["worse_on_cells"] == {"y": 2, "x": 0}
    # swapping the test losses alone does not move the decision
    d2 = decide(_walk_with(val, {"x": 1.0, "y": 1.0}, val), ["y", "x"], "k")
    assert d2 is not None and d2["winner"] == "x" and d2["cells"] == d["cells"]


def test_decision_reports_whether_one_cell_decides() -> None:
    """The winner with each cell left out: a win carried by one cell is flagged."""
    base = [2.00, 2.01, 1.99, 2.02, 2.00]
    lower = [x - 0.05 - 0.001 * i for i, x in enumerate(base)]
    tie = [x + 0.001 * (-1) ** i for i, x in enumerate(base)]
    # x is better only on t@1; elsewhere tied, and y is listed first (wins exact ties)
    val = {
        "y": {"t@1": base, "u@1": base, "v@1": base},
        "x": {"t@1": lower, "u@1": tie, "v@1": tie},
    }
    d = decide(_walk_with(val, {"x": 1.0, "y": 1.0}), ["y", "x"], "k")
    assert d is not None and d["winner"] == "x"
    assert d["winner_without_cell"]["t@1"] == "y" and not d["stable"]
    assert d["winner_without_cell"]["u@1"] == "x"


# ----------------------------------------------------------------------------- end to end


def _quick_cli(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": PATHS, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "rootopt.cli", "bench", "study", "--quick", "--no-progress"]
    return subprocess.run(
        [*cmd, "--out", str(out), *extra], capture_output=True, text=True, timeout=900, env=env
    )


RECORD = ("runs.jsonl", "timing.jsonl", "study-log.jsonl", "bench-manifest.json")


def test_quick_study_runs_decides_resumes_and_renders(tmp_path: Path) -> None:
    out = tmp_path / "study"
    p = _quick_cli(out)
    assert p.returncode == 0, p.stderr[-2000:]
    s = json.loads((out / "study.json").read_text())
    assert s["complete"] and s["jobs_left"] == 0 and s["pending"] == {}
    assert set(s["decisions"]) == {
        "screening",
        "ns_coefficients",
        "outlier_quantile",
        "ns_dtype",
        "final",
    }
    # `shipped`: the study's arm equal to ROOT()'s defaults today, if the quick study ran one
    shipped = s["default"].pop("shipped")
    assert shipped is None or shipped in s["arms"]
    assert s["default"] == {"arm": s["decisions"]["final"], "decided": True}
    survivors = s["decisions"]["screening"]["survivors"]
    assert survivors and s["decisions"]["ns_coefficients"]["candidates"] == survivors
    assert all(d["split"] == "validation" for k, d in s["decisions"].items() if k != "final")
    proto = Protocol.quick()
    for cell in proto.cells:
        rows = s["cells"][cell.name]["arms"]
        names = [a.name for a in COEFFICIENT_CANDIDATES] if cell.base is None else survivors
        for name in names:
            r = rows[name]
            assert len(r["test_loss"]) == len(proto.report_seeds)
            assert len(r["decision_val_loss"]) == len(proto.decision_seeds)
            assert r["setting"]["lr"] > 0
    # the long horizon and the autocast cell ran their arms; the tail was recorded
    assert proto.long_cell is not None and proto.amp_cell is not None
    long_rows = s["cells"][proto.long_cell.name]["arms"]
    assert set(long_rows) >= {*study.LONG_ARMS, f"{study.SHIPPED}-q0.8"}
    assert long_rows[study.SHIPPED]["momentum_tail"]["step"]
    assert set(s["cells"][proto.amp_cell.name]["arms"]) == set(study.AMP_ARMS)
    # the robustness family: every optimizer with and without clipping, the Holm family whole
    rob = s["robustness"]
    tags = {f"{a}{sfx}" for a in study.ROBUST_ARMS for sfx in ("", "+clip")}
    assert set(rob["cells"][proto.robust_cells[0]]) == tags
    fam = rob["family"]
    n_metrics = len(proto.robust_conditions) + 1
    assert fam["complete"] and fam["size"] == 2 * (len(study.ROBUST_ARMS) - 1) * n_metrics
    assert all(0 <= x["diff"]["p"] <= x["p_holm"] <= 1 for x in fam["rows"])
    # the index lists every run of the record once, each with its commit and times
    idx = s["index"]
    ids = [row[0] for row in idx["rows"]]
    assert len(ids) == len(set(ids)) == s["meta"]["runs"] > 0
    col = {c: i for i, c in enumerate(idx["columns"])}
    assert all(row[col["commit"]] and row[col["started (UTC)"]] for row in idx["rows"])
    assert idx["superseded"] == 0
    md = (out / "study.md").read_text()
    assert md.startswith("<!-- study:begin")
    assert {"study_lr.png", "study_long.png", "study_tail.png"} <= {f.name for f in out.iterdir()}
    # Resume: a second invocation runs nothing and writes the same summary.
    before = (out / "runs.jsonl").read_bytes()
    p2 = _quick_cli(out)
    assert p2.returncode == 0, p2.stderr[-2000:]
    assert (out / "runs.jsonl").read_bytes() == before
    s2 = json.loads((out / "study.json").read_text())
    assert s2["cells"] == s["cells"] and s2["decisions"] == s["decisions"]
    # Resume from the committed record alone (a fresh checkout has only these files): nothing
    # runs, and the summary is the same.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    for name in RECORD:
        (fresh / name).write_bytes((out / name).read_bytes())
    p3 = _quick_cli(fresh)
    assert p3.returncode == 0, p3.stderr[-2000:]
    assert (fresh / "runs.jsonl").read_bytes() == before
    assert not list((fresh / "runs").glob("*.json"))  # nothing was trained
    s3 = json.loads((fresh / "study.json").read_text())
    for key in ("cells", "decisions", "comparisons", "robustness", "index"):
        assert s3[key] == s[key], key
    # --import adds what a directory lacks, and only that
    part = tmp_path / "part"
    part.mkdir()
    (part / "bench-manifest.json").write_bytes((out / "bench-manifest.json").read_bytes())
    lines = before.decode().splitlines(keepends=True)
    (part / "runs.jsonl").write_text("".join(lines[:10]))
    p4 = _quick_cli(part, "--import", str(out), "--finished-only")
    assert p4.returncode == 0, p4.stderr[-2000:]
    assert f"imported {len(lines) - 10} runs" in p4.stdout
    got = sorted((part / "runs.jsonl").read_text().splitlines())
    assert got == sorted(before.decode().splitlines())


def test_study_refuses_flags_that_would_change_its_protocol(tmp_path: Path) -> None:
    from rootopt_analysis.commands.bench import main

    assert main(["study", "--out", str(tmp_path / "o"), "--seeds", "2"]) == 2
    assert not (tmp_path / "o").exists()


def test_selection_runs_evaluate_only_at_the_end_with_the_same_losses(tmp_path: Path) -> None:
    from rootopt_analysis.bench.runner import run_one

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
    record; its end is the end of the last run it finished before the next session started."""
    from rootopt_analysis.bench.store import read_sessions
    from rootopt_analysis.bench.study_report import provenance

    out = tmp_path / "study"
    out.mkdir()
    base = {"command": "rootopt bench study --out OUT", "machine": "m", "compute": True}
    a = {**base, "commit": "aaa", "session": "a", "start": 1000.0, "end": None}
    b = {**base, "commit": "bbb", "session": "b", "start": 5000.0, "end": None}
    log = out / "study-log.jsonl"
    # a was killed (start entry only); b finished (its end entry follows); one torn line
    lines = [json.dumps(a), json.dumps(b), '{"torn', json.dumps({**b, "end": 6000.0})]
    log.write_text("\n".join(lines) + "\n")
    store = study.open_store(out)
    store.add_runs(
        [
            {"run_id": n, "format": 2, "spec": {}, "ended": t, "wall_s": wall, "smoothness": 0.0}
            for n, t, wall in (("r1", 1500.0, 10.0), ("r2", 2500.0, 20.0), ("r3", 5500.0, 5.0))
        ]
    )
    sessions = read_sessions(log)
    assert len(sessions) == 2
    assert [s["end"] for s in sessions] == [None, 6000.0]
    meta = provenance(sessions, store)
    assert meta["commits"] == ["aaa", "bbb"]
    assert meta["commands"] == ["rootopt bench study --out OUT"]
    assert meta["sessions stopped before their end"] == 1
    # a: 1000 → 2500 (its last run), b: 5000 → 6000
    assert meta["wall_s"] == 1500 + 1000
    assert meta["runs"] == 3 and meta["run_s (sum over runs)"] == 35


def test_benchmarks_page_is_the_committed_study() -> None:
    """docs/benchmarks-v2.md carries exactly the tables rendered from docs/study_results_v2.json."""
    from rootopt_analysis.bench.study_report import BEGIN, END, markdown, splice

    docs = Path(__file__).resolve().parents[1] / "docs"
    summary = json.loads((docs / "study_results_v2.json").read_text(encoding="utf-8"))
    page = (docs / "benchmarks-v2.md").read_text(encoding="utf-8")
    assert page.count(BEGIN) == 1 and page.count(END) == 1
    block = markdown(summary)
    assert "#### Decisions" in block
    if "ns_coefficients" in summary["decisions"]:
        assert (
            f"**ns_coefficients** → `{summary['decisions']['ns_coefficients']['winner']}`" in block
        )
    else:
        assert "**not decided yet**" in block and not summary["default"]["decided"]
    assert splice(page, block) == page


def test_v1_rereading_is_v1s_summary() -> None:
    """The corrections to v1 on docs/benchmarks-v1.md are rendered from v1's committed
    summary, and read validation where v1 read test."""
    from rootopt_analysis.bench.study_report import (
        V1_BEGIN,
        V1_END,
        splice,
        v1_markdown,
        v1_rereading,
    )

    docs = Path(__file__).resolve().parents[1] / "docs"
    v1 = json.loads((docs / "study_results_v1.json").read_text(encoding="utf-8"))
    page = (docs / "benchmarks-v1.md").read_text(encoding="utf-8")
    assert splice(page, v1_markdown(v1), V1_BEGIN, V1_END) == page
    r = v1_rereading(v1)
    # v1's published decision is what its rule gives on test loss
    assert r["rule"]["test"]["winner"] == v1["decisions"]["ns_coefficients"]["winner"]
    cell = "kjv@150"
    val = {
        n: v1["cells"][cell]["arms"][n]["val_loss"] for n in r["rule"]["validation"]["candidates"]
    }
    best = r["rule"]["validation"]["cells"][cell]["best"]
    assert best == min(val, key=lambda n: statistics.fmean(val[n]))


# ----------------------------------------------------------------------------- v2 machinery


def test_holm_matches_the_step_down_procedure() -> None:
    from rootopt_analysis.bench.stats import holm

    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([]) == [] and holm([0.7]) == [0.7] and holm([0.6, 0.9]) == [1.0, 1.0]
    rng = __import__("random").Random(0)
    for _ in range(200):
        ps = [rng.random() ** 3 for _ in range(rng.randint(1, 12))]
        adj = holm(ps)
        # Holm's procedure: walk up the sorted p, reject while p_(i) <= a / (m - i)
        order = sorted(range(len(ps)), key=lambda i: ps[i])
        rejected = set()
        for rank, i in enumerate(order):
            if ps[i] > 0.05 / (len(ps) - rank):
                break
            rejected.add(i)
        assert {i for i, a in enumerate(adj) if a <= 0.05} == rejected
        assert all(a >= q for a, q in zip(adj, ps, strict=True))


def test_paired_p_agrees_with_the_interval() -> None:
    from rootopt_analysis.bench.stats import paired_p

    rng = __import__("random").Random(1)
    for _ in range(100):
        a = [rng.gauss(0, 1) for _ in range(5)]
        b = [x + rng.gauss(0.5, 0.6) for x in a]
        ci = paired_ci(a, b)
        assert (paired_p(a, b) < 0.05) == ci.excludes_zero
    assert paired_p([1.0, 2.0], [1.0, 2.0]) == 1.0
    with pytest.raises(ValueError, match="differ in length"):
        paired_p([1.0], [1.0, 2.0])


def test_pooled_estimate_is_t_over_the_seed_means() -> None:
    per = {"a@1": {"diffs": [0.1, 0.2, 0.0]}, "b@1": {"diffs": [0.3, 0.0, 0.1]}}
    got = study._pooled(per, ["a@1", "b@1"])
    assert got is not None
    want = mean_ci([0.2, 0.1, 0.05])
    assert (got["mean"], got["lo"], got["hi"]) == pytest.approx((want.mean, want.lo, want.hi))
    assert study._pooled(per, ["a@1", "b@1", "c@1"]) is None  # a cell without the pair


def test_run_ids_of_earlier_specs_do_not_change() -> None:
    """The precision field is left out of a default spec, so runs finished before it existed
    keep their ids (the id below was computed by the code before the field)."""
    kw: dict[str, Any] = dict(
        suite="study", task="stdlib", optimizer="root", lr=0.03, seed=0, steps=150,
        weight_decay=0.1, options=(("ns_coefficients", "muon"),), side_lr_mult=0.316228,
    )  # fmt: skip
    assert RunSpec(**kw).run_id == "stdlib-root-lr0.03-s0-clean-x1-10dddf310e"
    amp = RunSpec(**kw, precision="bf16")
    assert amp.run_id != RunSpec(**kw).run_id and amp.run_id.startswith("stdlib-amp-")
    assert RunSpec.from_dict(amp.to_dict()) == amp
    with pytest.raises(ValueError, match="unknown precision"):
        RunSpec(**kw, precision="fp8")


def _sweep_lookup(diverge_from: int, optimum: int) -> Any:
    def lookup(spec: RunSpec) -> dict[str, Any]:
        k = round(4 * math.log10(spec.lr / 3e-3))
        div = k >= diverge_from
        v = 2.0 + 0.01 * (k - optimum) ** 2 + 0.001 * spec.seed
        return {
            "final_val_loss": math.nan if div else v,
            "final_test_loss": math.nan if div else v + 0.01,
            "initial_test_loss": 5.5,
            "diverged": div,
        }

    return lookup


def test_lr_sweep_stops_after_consecutive_divergence_and_corrupts_at_its_optimum() -> None:
    p = _proto()
    cell = Cell("stdlib", 150)
    w = Walk(p)
    arm = study.arm_by_name("muon-fp32")
    seen: list[RunSpec] = []
    base = _sweep_lookup(diverge_from=9, optimum=5)

    def lookup(spec: RunSpec) -> dict[str, Any] | None:
        seen.append(spec)
        return base(spec) if spec.suite == study.SWEEP_SUITE else None

    study._robust(w, arm, cell, None, lookup, (1,))
    e = w.robust[("stdlib@150", "muon-fp32", None)]
    assert sorted(e["sweep"]) == list(range(0, 11))  # 9 and 10 diverged: stop
    assert e["optimum"] == 5
    sweep_specs = [s for s in seen if s.suite == study.SWEEP_SUITE]
    assert {s.weight_decay for s in sweep_specs} == {p.robust_wd}
    assert {s.side_lr_mult for s in sweep_specs} == {1.0} and {s.clip for s in seen} == {None}
    assert {s.seed for s in seen} == set(p.report_seeds)
    wanted = [s for _, s in w.jobs]
    assert len(wanted) == len(p.robust_conditions) * len(p.report_seeds)
    assert all(s.suite == study.ROBUST_SUITE and s.lr == study._lr(arm, 5, 4) for s in wanted)
    assert {s.corruption for s in wanted} == {c for _, c in p.robust_conditions}


def test_lr_sweep_asks_for_at_most_three_points_ahead() -> None:
    p = _proto()
    w = Walk(p)
    study._robust(w, study.arm_by_name("adamw"), Cell("kjv", 150), 1.0, lambda s: None, (1,))
    ks = {round(4 * math.log10(s.lr / 3e-3)) for _, s in w.jobs}
    assert ks == {0, 1, 2} and all(s.clip == 1.0 for _, s in w.jobs)


def test_lr_stability_counts_diverged_points_at_their_initial_loss() -> None:
    p = _proto()
    w = Walk(p)
    cell = Cell("stdlib", 150)
    base = _sweep_lookup(diverge_from=8, optimum=5)

    def lookup(spec: RunSpec) -> dict[str, Any] | None:
        r = base(spec)
        if spec.suite == study.ROBUST_SUITE:
            r = {**r, "final_test_loss": r["final_test_loss"] + 0.1}
        return r

    study._robust(w, study.arm_by_name("muon-fp32"), cell, 1.0, lookup, (1,))
    s = study._robust_summary(w)
    assert s is not None
    row = s["cells"]["stdlib@150"]["muon-fp32+clip"]
    # region k = 6..10: 6 and 7 finite (+0.01, +0.04 above the optimum), 8, 9 diverged
    # (initial 5.5), 10 past the stop: initial too
    for i, seed in enumerate(p.report_seeds):
        best = 2.01 + 0.001 * seed
        want = statistics.fmean([2.02 + 0.001 * seed - best, 2.05 + 0.001 * seed - best,
                                 *[5.5 - best] * 3])  # fmt: skip
        assert row["lr_degradation_per_seed"][i] == pytest.approx(want)
    deg = row["conditions"][p.robust_conditions[0][0]]["degradation"]
    assert deg["mean"] == pytest.approx(0.1)


def test_store_closes_a_torn_line_and_imports_stray_files(tmp_path: Path) -> None:
    out = tmp_path / "s"
    (out / "runs").mkdir(parents=True)
    losses = [3.0 / (1 + i) for i in range(20)]
    rec = {"run_id": "a", "format": 2, "spec": {"steps": 20}, "train_loss": losses}
    store = study.open_store(out)
    store.add_runs([rec], commit="c1")
    with open(out / "runs.jsonl", "a") as f:
        f.write('{"run_id": "torn", "form')  # a kill during an append
    (out / "runs" / "b.json").write_text(json.dumps({**rec, "run_id": "b"}))
    (out / "runs" / "c.json").write_text('{"run_id": "c", "format": 2, "sp')  # torn file
    again = study.open_store(out)
    assert set(again.runs) == {"a", "b"}
    assert again.runs["a"]["commit"] == "c1" and "train_loss" not in again.runs["a"]
    assert again.runs["a"]["smoothness"] == again.runs["b"]["smoothness"] > 0
    lines = (out / "runs.jsonl").read_text().splitlines()
    assert [json.loads(x)["run_id"] for x in lines if x.startswith('{"run_id":"')] == ["a", "b"]
    assert study.open_store(out).runs.keys() == again.runs.keys()  # nothing imported twice


def test_index_lists_runs_the_protocol_no_longer_uses(tmp_path: Path) -> None:
    p = Protocol.quick()
    store = study.open_store(tmp_path)
    old = RunSpec(suite="study-report-v2", task="digits", optimizer="adamw", lr=0.01, seed=0,
                  steps=6, weight_decay=0.1)  # fmt: skip
    store.add_runs([{"run_id": old.run_id, "format": 2, "spec": old.to_dict(),
                     "final_val_loss": 1.0, "final_test_loss": 1.1, "diverged": False,
                     "started": 0.0, "ended": 1.0, "smoothness": 0.0}], commit="old")  # fmt: skip
    w = study.walk(p, lambda s: store.runs.get(s.run_id), store.timing.get)
    idx = study._index(w, store)
    assert idx["runs"] == 1 and idx["superseded"] == 1
    row = dict(zip(idx["columns"], idx["rows"][0], strict=True))
    assert row["run_id"] == old.run_id and row["commit"] == "old" and row["used"] is False
    assert row["cell"] == "digits@6" and row["final_test_loss"] == 1.1
    assert row["started (UTC)"] == "1970-01-01 00:00:00"


def test_index_names_the_commit_of_the_session_that_started_a_run_recorded_without_one(
    tmp_path: Path,
) -> None:
    """A worker's result file imported by the next session has no commit (its session stopped
    between the file and the log's line): the index names the commit of the session running
    when it started; a record's own commit wins; before any session, none."""
    p = Protocol.quick()
    log = tmp_path / "study-log.jsonl"
    sessions = [
        {"session": "1", "start": 100.0, "end": None, "commit": "c1", "dirty": False},
        {"session": "2", "start": 200.0, "end": None, "commit": "c2", "dirty": True},
        {"session": "2", "start": 200.0, "end": 300.0, "commit": "c2", "dirty": True},
        {"session": "3", "start": "soon", "end": None, "commit": "c3"},  # a hand-edited line
    ]
    log.write_text("".join(json.dumps(e) + "\n" for e in sessions))
    store = study.open_store(tmp_path)
    base = {"format": 2, "final_val_loss": 1.0, "final_test_loss": 1.1, "diverged": False,
            "ended": 1.0, "smoothness": 0.0}  # fmt: skip
    want = {}
    cases = [(150.0, None, "c1"), (199.0, None, "c1"), (250.0, None, "c2+dirty"),
             (250.0, "mine", "mine"), (50.0, None, None)]  # fmt: skip
    for i, (started, commit, expect) in enumerate(cases):
        spec = RunSpec(suite="study-report-v2", task="digits", optimizer="adamw", lr=0.01,
                       seed=i, steps=6, weight_decay=0.1)  # fmt: skip
        store.add_runs([{**base, "run_id": spec.run_id, "spec": spec.to_dict(),
                         "started": started}], commit=commit)  # fmt: skip
        want[spec.run_id] = expect
    w = study.walk(p, lambda s: store.runs.get(s.run_id), store.timing.get)
    idx = study._index(w, store)
    got = {row[0]: row[idx["columns"].index("commit")] for row in idx["rows"]}
    assert got == want


def test_momentum_tail_sees_what_root_thresholds() -> None:
    import torch

    from rootopt.optim import ROOT
    from rootopt_analysis.bench.runner import _orthogonalized, momentum_tail

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 100))
    opt = ROOT([w], lr=1e-3, momentum=0.9, nesterov=True)
    g = torch.randn(64, 100)
    g.view(-1)[:32] = 1e3  # 0.5 % of the entries are far out in the tail
    w.grad = g.clone()
    opt.step()
    ((p, v),) = _orthogonalized(opt)
    buf = opt.state[w]["momentum_buffer"]
    assert p is w and torch.equal(v, g + 0.9 * buf)  # the threshold's input (sum form)
    t = momentum_tail(opt, 1)
    assert t is not None and t["matrices"] == 1
    assert t["above10rms_share"] == pytest.approx(0.005, rel=1e-3)
    assert t["kurtosis_max"] > 100  # far from a Gaussian's 3
    w.grad = torch.randn(64, 100)
    opt.state[w]["momentum_buffer"].zero_()
    opt.step()
    t2 = momentum_tail(opt, 2)
    assert t2 is not None and 2.5 < t2["kurtosis_median"] < 3.5 and t2["above10rms_share"] == 0
    assert momentum_tail(torch.optim.AdamW([w]), 1) is None


def test_flops_count_the_optimizer_and_do_not_depend_on_load(tmp_path: Path) -> None:
    (tmp_path / "timing").mkdir()
    cell = Cell("digits", 6)
    got = {}
    for name in ("adamw", "root-muon"):
        spec = study.FlopSpec("digits", make_spec(study.arm_by_name(name), cell, Setting(0), 0, 4))
        a = study.count_flops(spec, str(tmp_path))["flops"]
        assert study.count_flops(spec, str(tmp_path))["flops"] == a  # a count, not a clock
        got[name] = a
    assert got["root-muon"] > got["adamw"] > 0  # the Newton-Schulz products are counted


def test_bf16_autocast_runs_train_under_autocast(tmp_path: Path) -> None:
    from rootopt_analysis.bench.runner import run_one

    (tmp_path / "runs").mkdir()
    kw: dict[str, Any] = dict(suite=study.REPORT_SUITE, task="digits", optimizer="adamw",
                              lr=3e-3, seed=1, steps=8, weight_decay=0.1)  # fmt: skip
    fp = run_one(RunSpec(**kw), str(tmp_path))
    amp = run_one(RunSpec(**kw, precision="bf16"), str(tmp_path))
    assert fp["initial_val_loss"] == amp["initial_val_loss"]  # same model, fp32 evaluation
    assert fp["train_loss"] != amp["train_loss"]  # the forward ran in bfloat16
    assert abs(fp["final_val_loss"] - amp["final_val_loss"]) < 0.05


def test_committed_summary_is_rendered_from_the_committed_record() -> None:
    """docs/study_results_v2.json is what the committed record (docs/study/: one line per run)
    gives, rendered again here: every number, decision and index row, nothing trained."""
    from rootopt_analysis.bench.store import read_sessions
    from rootopt_analysis.bench.study_report import provenance

    docs = Path(__file__).resolve().parents[1] / "docs"
    committed = json.loads((docs / "study_results_v2.json").read_text(encoding="utf-8"))
    record = docs / "study"
    store = study.open_store(record)
    assert len(store.runs) == committed["index"]["runs"]
    w = study.walk(Protocol.full(), lambda s: store.runs.get(s.run_id), store.timing.get)
    meta = provenance(read_sessions(record / "study-log.jsonl"), store)
    again = json.loads(json.dumps(study.summarize(w, store, meta)))
    # compared as canonical JSON: a diverged run's loss is NaN, which equals nothing
    assert json.dumps(again, sort_keys=True) == json.dumps(committed, sort_keys=True)


def _publish_module() -> Any:
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "study_publish.py"
    spec = importlib.util.spec_from_file_location("study_publish", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _mini_repo(root: Path, *, readme_markers: bool = True) -> None:
    from rootopt_analysis.bench.study_report import (
        BEGIN,
        END,
        HEADLINE_BEGIN,
        HEADLINE_END,
        THRESHOLD_BEGIN,
        THRESHOLD_END,
    )

    (root / "docs" / "study").mkdir(parents=True)
    (root / "docs" / "img").mkdir()
    (root / "docs" / "study" / "bench-manifest.json").write_text('{"tool": "rootopt bench"}')
    (root / "docs" / "benchmarks-v2.md").write_text(
        f"# page\n\nkept\n\n{BEGIN}\nold\n{END}\n\nkept too\n"
    )
    markers = f"{HEADLINE_BEGIN}\nold\n{HEADLINE_END}\n" if readme_markers else "| a table |\n"
    (root / "README.md").write_text(f"# readme\n\n## Measured\n\n{markers}\nafter\n")
    (root / "docs" / "optimizer.md").write_text(
        f"# optimizer\n\n{THRESHOLD_BEGIN}\nold\n{THRESHOLD_END}\n\n## Use\n"
    )


def test_publish_rewrites_only_the_generated_blocks(tmp_path: Path) -> None:
    from rootopt_analysis.bench.study_report import headline, markdown

    mod = _publish_module()
    _mini_repo(tmp_path)
    got = mod.publish(tmp_path)
    assert got["runs"] == 0 and got["complete"] is False
    summary = json.loads((tmp_path / "docs" / "study_results_v2.json").read_text())
    page = (tmp_path / "docs" / "benchmarks-v2.md").read_text()
    assert page.startswith("# page\n\nkept\n\n") and page.endswith("\n\nkept too\n")
    assert markdown(summary).rstrip("\n") in page and "\nold\n" not in page
    readme = (tmp_path / "README.md").read_text()
    assert readme == f"# readme\n\n## Measured\n\n{headline(summary)}\nafter\n"
    assert "Still running: stdlib@150" in readme
    optimizer = (tmp_path / "docs" / "optimizer.md").read_text()
    assert "\nold\n" not in optimizer and optimizer.endswith("-->\n\n## Use\n")
    assert "has not measured what the threshold does yet" in optimizer


def test_rendering_the_record_adds_no_session_to_its_log(tmp_path: Path) -> None:
    """Publishing renders from the finished runs and trains nothing: the committed session log
    (what provenance reads) stays as it was, however often the pages are regenerated."""
    mod = _publish_module()
    _mini_repo(tmp_path)
    log = tmp_path / "docs" / "study" / "study-log.jsonl"
    entry = {"command": "c", "commit": "aaa", "session": "s", "start": 1.0, "end": 2.0}
    log.write_text(json.dumps({**entry, "compute": True}) + "\n")
    before = log.read_bytes()
    mod.publish(tmp_path)
    mod.publish(tmp_path)
    assert log.read_bytes() == before


def test_publish_refuses_a_page_without_its_markers_and_writes_nothing(tmp_path: Path) -> None:
    mod = _publish_module()
    _mini_repo(tmp_path, readme_markers=False)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit, match="README.md must hold"):
        mod.publish(tmp_path)
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before


COMMITTED = Path(__file__).resolve().parents[1] / "docs" / "study"  # the committed record


def _committed_runs(n: int) -> str:
    """The first ``n`` lines of the committed record's runs.jsonl (finished runs to import)."""
    runs = (COMMITTED / "runs.jsonl").read_text(encoding="utf-8")
    return "".join(runs.splitlines(keepends=True)[:n])


@pytest.mark.parametrize("name", ["runs.jsonl", "timing.jsonl", "study-log.jsonl"])
def test_a_link_planted_where_the_study_appends_is_refused_and_its_target_kept(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Importing into (or running in) a study directory with a symbolic link at a file it
    appends to: one line, status 2, nothing written through the link."""
    from rootopt_analysis.commands.bench import main

    out, src = tmp_path / "o", tmp_path / "src"
    src.mkdir()
    (src / "runs.jsonl").write_text(_committed_runs(3))
    (src / "study-log.jsonl").write_text((COMMITTED / "study-log.jsonl").read_text())
    out.mkdir()
    (out / "bench-manifest.json").write_text('{"tool": "rootopt bench", "format": 1}')
    mine = tmp_path / "mine.txt"
    mine.write_text("the user's\n")
    (out / name).symlink_to(mine)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    argv = ["study", "--out", str(out), "--import", str(src), "--finished-only"]
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "symbolic link" in err, err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_a_second_session_that_appends_is_refused_while_the_first_is_live(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A live session holds the study directory: a second run or import is refused with one
    line and writes nothing; a render of what has finished may run beside it."""
    from rootopt.checkpoint import DirLock
    from rootopt_analysis.commands.bench import main

    out, src = tmp_path / "o", tmp_path / "src"
    src.mkdir()
    (src / "runs.jsonl").write_text(_committed_runs(3))
    assert main(["study", "--out", str(out), "--import", str(src), "--finished-only"]) == 0
    capsys.readouterr()
    (src / "runs.jsonl").write_text(_committed_runs(6))
    live = DirLock(out)
    live.acquire()  # the first session
    try:
        before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        for extra in (["--import", str(src), "--finished-only"], ["--quick"]):
            assert main(["study", "--out", str(out), "--no-progress", *extra]) == 2
            err = capsys.readouterr().err
            assert len(err.strip().splitlines()) == 1 and "in use by another" in err, err
            assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
        assert main(["study", "--out", str(out), "--finished-only", "--no-progress"]) == 0
        assert (out / "runs.jsonl").read_bytes() == before[out / "runs.jsonl"]
    finally:
        live.release()
    assert main(["study", "--out", str(out), "--import", str(src), "--finished-only"]) == 0
    assert "imported 3 runs" in capsys.readouterr().out


def test_study_refuses_an_import_that_is_not_a_study_directory(tmp_path: Path) -> None:
    from rootopt_analysis.commands.bench import main

    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    assert main(["study", "--out", str(tmp_path / "o"), "--import", str(tmp_path / "foreign")]) == 2
    assert not (tmp_path / "o").exists()
    assert (tmp_path / "foreign" / "notes.txt").read_text() == "mine"


def test_summary_text_is_json_with_one_index_row_per_line() -> None:
    from rootopt_analysis.bench.study_report import dump_summary

    s = {
        "a": [1, 2],
        "index": {"columns": ["x", "y"], "rows": [[1, {"k": 2}], [3, None]], "runs": 2},
    }
    text = dump_summary(s)
    assert json.loads(text) == s
    assert '  [1,{"k":2}],\n  [3,null]\n' in text
    empty = {"a": 1, "index": {"columns": [], "rows": [], "runs": 0}}
    assert json.loads(dump_summary(empty)) == empty
    assert json.loads(dump_summary({"a": 1})) == {"a": 1}


def test_headline_shows_the_shipped_setting_until_the_defaults_equal_the_decision() -> None:
    """A decision the code's defaults do not equal (a later study overturned it) is named in
    the README's text; the ROOT column stays what ``ROOT()`` gives, compared with
    ``torch.optim.Muon`` as shipped."""
    import copy

    from rootopt_analysis.bench.study_report import headline

    docs = Path(__file__).resolve().parents[1] / "docs"
    s = json.loads((docs / "study_results_v2.json").read_text(encoding="utf-8"))
    s = copy.deepcopy(s)
    c = next(c for c in s["cells"].values() if c["arms"].get("muon-bf16"))
    c["arms"]["decided-arm"] = {"test_loss_ci": {"mean": 9.0, "lo": 8.9, "hi": 9.1}}
    c["arms"]["shipped-arm"] = {"test_loss_ci": {"mean": 7.0, "lo": 6.9, "hi": 7.1}}
    s["comparisons"] = [
        {"label": "default − torch.optim.Muon", "cells": {}, "pooled": None},
        {"label": "ROOT, Muon's coefficients − torch.optim.Muon", "cells": {}, "pooled": None},
    ]
    s["default"] = {"arm": "decided-arm", "decided": True, "shipped": "shipped-arm"}
    text = headline(s)
    row = next(ln for ln in text.splitlines() if ln.startswith(f"| `{c['task']}`"))
    assert "7.000 ± 0.100" in row and "9.000" not in row
    assert "own decision, `decided-arm`, was overturned" in " ".join(text.split())
    s["default"]["shipped"] = "decided-arm"  # the defaults equal it: the decision is shown
    row = next(ln for ln in headline(s).splitlines() if ln.startswith(f"| `{c['task']}`"))
    assert "9.000 ± 0.100" in row
    assert "overturned" not in headline(s)


def test_headline_of_a_finished_study_reports_the_cells_without_the_default_arm() -> None:
    """Once the study is complete, a cell that ran only the earlier ROOT setting (the long
    horizon, the autocast cell) is not called "still running": the headline gives that
    setting's paired difference with ``torch.optim.Muon`` and its interval, from the JSON."""
    import copy

    from rootopt_analysis.bench.study_report import (
        SHIPPED_COMPARISON,
        _ci,
        headline,
        headline_view,
    )

    docs = Path(__file__).resolve().parents[1] / "docs"
    s = json.loads((docs / "study_results_v2.json").read_text(encoding="utf-8"))
    # the decided arm stands in the README's column here, so the cells without it are
    # those the earlier setting ran alone
    s["default"]["shipped"] = s["default"]["arm"]
    arm = headline_view(s)[0]
    without = [n for n, c in s["cells"].items() if arm not in c["arms"]]
    comp = next(c for c in s["comparisons"] if c["label"] == SHIPPED_COMPARISON)
    diffs = [comp["cells"][n]["equal steps"] for n in without if n in comp["cells"]]
    assert s["complete"] and len(diffs) == len(without) >= 1
    text = " ".join(headline(s).split())
    assert "Still running" not in text
    for d in diffs:
        assert _ci(d) in text
    unfinished = copy.deepcopy(s)
    unfinished["complete"] = False
    assert "Still running" in " ".join(headline(unfinished).split())
