"""The defaults study v3 (docs/benchmarks.md, "Defaults study v3: protocol"): its rule on
plain numbers, and its plan over the committed v2 record (v2's tuning reused, new seeds only)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from rootopt_analysis.bench import study_v3 as v3

REPO = Path(__file__).resolve().parents[1]
CELLS = ("c1", "c2")


def _diff(per_seed_a: list[list[float]], per_seed_b: list[list[float]]) -> dict[str, object]:
    a = {c: per_seed_a[i] for i, c in enumerate(CELLS)}
    b = {c: per_seed_b[i] for i, c in enumerate(CELLS)}
    d = v3.pooled_difference(a, b, CELLS)
    assert d is not None
    return d


def test_the_pooled_difference_is_the_mean_over_cells_per_seed() -> None:
    d = _diff([[1.0, 2.0, 3.0], [2.0, 2.0, 2.0]], [[1.5, 2.0, 2.0], [2.0, 1.0, 2.0]])
    # per seed: mean(1-1.5, 2-2) = -0.25, mean(0, 1) = 0.5, mean(1, 0) = 0.5
    assert d["per_seed"] == pytest.approx([-0.25, 0.5, 0.5])
    assert d["mean"] == pytest.approx(0.25)
    assert d["lo"] < d["lo90"] < d["mean"] < d["hi90"] < d["hi"]
    # a missing cell or seed: no statistic
    assert v3.pooled_difference({"c1": [1.0, 2.0]}, {"c1": [1.0, 2.0]}, CELLS) is None
    # a diverged run: its side is worse, whatever the rest
    div = _diff([[math.nan, 1.0], [1.0, 1.0]], [[9.0, 9.0], [9.0, 9.0]])
    assert div["diverged"] == "a"


@pytest.mark.parametrize(
    ("mean", "half", "cost", "want", "why"),
    [
        (-0.010, 0.002, 1.0, "a", "better beyond the margin"),
        (+0.010, 0.002, 1.0, "b", "better beyond the margin"),
        # inside the margin, equivalent: the cheaper, then the simpler ("b" is simpler here)
        (-0.001, 0.002, 0.90, "a", "equivalent; cheaper"),
        (-0.001, 0.002, 1.10, "b", "equivalent; cheaper"),
        (-0.001, 0.002, 1.04, "b", "equivalent; equal cost, simpler"),
        # significant but inside the margin: still a tie
        (-0.0035, 0.001, 1.0, "b", "equivalent; equal cost, simpler"),
        # neither shown better nor equivalent
        (-0.004, 0.006, 0.5, "a", "not shown equivalent; cheaper"),
    ],
)
def test_the_rule(mean: float, half: float, cost: float, want: str, why: str) -> None:
    diff = {"mean": mean, "lo": mean - half, "hi": mean + half}
    diff |= {"lo90": mean - 0.8 * half, "hi90": mean + 0.8 * half}
    got = v3.verdict(diff, cost, "a", "b", simpler=("b", "a"))
    assert (got["winner"], got["why"]) == (want, why)


def test_v3_reuses_v2s_tuning_and_runs_new_seeds_only(tmp_path: Path) -> None:
    from collections import Counter

    store = v3.open_store(tmp_path / "v3")
    earlier = v3.v2.open_store(REPO / "docs" / "study")
    w = v3.walk(v3.reused_lookup(store, [earlier]), store.timing.get)
    kinds = Counter(type(job).__name__ for _, job in w.jobs)
    runs = [job for _, job in w.jobs if type(job).__name__ == "RunSpec"]
    # every arm's tuning is in v2's record: no selection run is asked for
    assert {r.suite for r in runs} == {v3.v2.DECIDE_SUITE}
    assert {r.seed for r in runs} == set(v3.DECISION)
    assert set(v3.DECISION).isdisjoint(v3.v2.Protocol.full().decision_seeds)
    assert set(v3.REPORT).isdisjoint(v3.v2.Protocol.full().report_seeds)
    # 7 arms on 7 cells, 10 seeds each, less the runs two arms share (the same setting)
    assert 400 < len(runs) <= 7 * 7 * 10
    assert kinds["CostSpec"] == len(v3.cost_specs()) == 7
    # the matched arms train at their parent's tuned setting on every cell
    for name, (_arm, parent) in v3.MATCHED.items():
        for cell in v3.LM_CELLS:
            mine, theirs = w.base.get(name, cell), w.base.get(parent.name, cell)
            assert mine is not None and theirs is not None and mine.tuned and theirs.tuned
            assert mine.tuned.setting == theirs.tuned.setting, (name, cell)
    assert not w.decisions  # nothing decided before its runs


def _fake_result(job: object) -> dict[str, object]:
    """A finished record for any v3 job: a loss that depends on the setting, so that tuning
    has an interior optimum, and costs that make bf16 cheaper on this CPU only."""
    from rootopt_analysis.bench import study_v3_real as real
    from rootopt_analysis.bench.runner import RunSpec

    if isinstance(job, v3.CostSpec):
        bf16 = dict(job.arm.options).get("ns_dtype") == "bfloat16"
        ratio = (0.9 if job.isa_cap is None else 3.0) if bf16 else 1.0
        machine = {"cpu": "test", "isa": "AVX-512-BF16", "native_bf16": job.isa_cap is None}
        spec = job.to_dict()
        return {
            "run_id": job.run_id,
            "kind": "cost",
            "ratio": ratio,
            "machine": machine,
            "spec": spec,
        }
    if isinstance(job, v3.v2.TimingSpec):
        return {"run_id": job.run_id, "kind": "timing", "ratio": 1.2}
    if isinstance(job, v3.v2.FlopSpec):
        return {"run_id": job.run_id, "kind": "flops", "flops": 10**9}
    if isinstance(job, real.DataJob):
        return {"run_id": job.run_id, "kind": "real-data"}
    if isinstance(job, real.TrainJob):
        loss = 4.0 + abs(math.log(job.lr / 4e-3)) + 0.001 * job.seed
        loss += 0.01 * (job.optimizer == "ROOT") * (job.seed % 2)  # some spread in the pair
        return {
            "run_id": job.run_id,
            "kind": "real-model",
            "final_val_loss": loss,
            "final_test_loss": loss,
            "diverged": False,
        }
    assert isinstance(job, RunSpec)
    opts = dict(job.options)
    steps = job.steps
    loss = 2.0 + 0.0001 * job.seed
    if job.suite == v3.v2.SELECT_SUITE:  # tuning: an interior lr optimum, no decay preferred
        loss += 0.1 * abs(math.log10(job.lr) + 2) + 0.01 * job.weight_decay
    loss += 0.002 * (opts.get("ns_dtype") == "bfloat16")  # a tie within the margin
    return {
        "run_id": job.run_id,
        "spec": job.to_dict(),
        "final_val_loss": loss,
        "final_test_loss": loss,
        "initial_val_loss": 5.0,
        "initial_test_loss": 5.0,
        "diverged": False,
        "evals": {"step": [0, steps], "test_loss": [5.0, loss]},
        "momentum_tail": _fake_tail(steps, opts.get("outlier_quantile")),
    }


def _fake_tail(steps: int, q: float | None) -> dict[str, list[float]]:
    """What the runner records of the momentum: every thresholded arm clips a tenth."""
    tail = {"step": [steps], "q90_over_rms_median": [1.6], "above10rms_share": [1e-5]}
    if q is None:
        return tail
    clip = {"clipped_share": 0.1, "clipped_over3rms": 0.02, "clipped_over10rms": 1e-4}
    return {**tail, **{k: [v] for k, v in clip.items()}, "clipped_norm2_share": [0.3]}


def test_after_the_decision_every_family_is_asked_for_and_the_walk_ends(tmp_path: Path) -> None:
    """With every job answered, the walk decides, then asks for the real-model cell, the
    re-tuning with equal time, the horizon, the q ablation and the report runs, and ends."""
    from collections import Counter

    earlier = v3.v2.open_store(REPO / "docs" / "study")
    done: dict[str, dict[str, object]] = {}

    def lookup(spec: object) -> dict[str, object] | None:
        rid = spec.run_id  # type: ignore[attr-defined]
        return done.get(rid) or (
            earlier.runs.get(rid) if spec.suite == v3.v2.SELECT_SUITE else None
        )  # type: ignore[attr-defined]

    families: Counter[int] = Counter()
    for _ in range(40):
        w = v3.walk(lookup, done.get)
        if not w.jobs:
            break
        for prio, job in w.jobs:
            families[prio[0]] += 1
            done[job.run_id] = _fake_result(job)
    assert not w.jobs and w.complete
    # bf16 costs 0.002 more, inside the margin, and is cheaper here only: bf16 here, float32
    # where it is emulated; Muon's coefficients tie with Polar Express's at equal cost
    d = w.decisions
    assert d["ns_coefficients"]["winner"] == "muon" and d["ns_coefficients"]["equivalent"]
    assert d["ns_dtype"]["difference"]["mean"] == pytest.approx(0.002)
    winners = {cls: v["winner"] for cls, v in d["ns_dtype"]["per_class"].items()}
    assert winners == {
        "native": "bfloat16",
        "AVX512_CORE": "float32",
        "AVX2": "float32",
        "cuda": "bfloat16",
    }
    assert v3.final_arms(w) == (v3.MATCHED["root-muon·bf16"][0], v3.ROOT_MUON)
    for family in (v3.P_COST, v3.P_DECIDE, v3.P_REAL, v3.P_RETUNE, v3.P_EQUAL_TIME, v3.P_HORIZON):
        assert families[family] > 0, family
    assert families[v3.P_QABL] > 0 and families[v3.P_REPORT] > 0
    assert w.real["arms"] and all("report" in a for a in w.real["arms"].values())
    assert set(w.equal_time) == set(v3.RETUNE_CELLS)
    for (arm, cell), entry in w.retuned.items():
        assert entry["setting"].wd == 0.0, (arm, cell)  # the fake loss prefers no decay
        assert entry["report"] is not None
    # the summary and its page render from the same walk
    import json

    empty = v3.open_store(tmp_path / "empty")
    summary = v3.summarize(w, empty, {})
    json.dumps(summary, allow_nan=True)
    page = v3.markdown(summary)
    assert "After the decision (the default here: `root-muon·bf16`)" in page
    assert "default − torch.optim.Muon" in page and "Real-model cell" in page
    rows = {r["label"]: r for r in summary["comparisons"]}
    assert set(rows["default − torch.optim.Muon"]["cells"]) >= {*v3.LM_CELLS, "stdlib@2400"}
    # the edge over the horizon runs: default − each arm at five points of the run
    curves = summary["horizon_curves"]
    assert set(curves) == {c.name for c in v3.HORIZON}
    for cell, e in curves.items():
        final = e["default − arm"]["muon-bf16"][-1]
        assert e["steps"][-1] == int(cell.split("@")[1]) and final["mean"] == pytest.approx(0.002)
        assert set(e["default − arm"]) >= {"muon-bf16", "adamw", "root-muon", "root-muon·bf16·noq"}
    assert "Over the run on stdlib@2400: default − arm" in v3.markdown(summary)
    # the README's table: every cell, the re-tuned ones at equal steps and equal time
    from rootopt_analysis.bench import study_v3_pages as readme

    summary = json.loads(json.dumps(summary))  # as the committed JSON reads back
    got = readme.rows(summary)
    assert got is not None and readme.ready(summary)
    assert [r.cell for r in got] == [
        *readme.SEVEN, *(c.name for c in v3.HORIZON), "llama-bpe@1000"
    ]  # fmt: skip
    assert {r.cell for r in got if r.equal_time} == set(v3.RETUNE_CELLS)
    for r in got:  # the fake losses: bf16 iterations cost 0.002, seeds 400.. add 0.0001 each
        if r.cell != "llama-bpe@1000":
            assert r.diff["mean"] == pytest.approx(0.002), r.cell
    real = next(r for r in got if r.cell == "llama-bpe@1000")
    assert real.diff["mean"] == pytest.approx(0.01 / 3) and real.diff["n"] == 3
    text = readme.headline(summary)
    table = [ln for ln in text.splitlines() if ln.startswith("| `")]
    assert len(table) == len(got)
    assert "Holm-corrected over the table's 13 differences" in " ".join(text.split())
    assert sum("†" in ln for ln in table) == 3
    from rootopt_analysis.bench.study_report import HEADLINE_BEGIN, HEADLINE_END, splice

    front = splice((REPO / "README.md").read_text(), text, HEADLINE_BEGIN, HEADLINE_END)
    assert len(front.splitlines()) <= 110  # the README's own limit (tests/test_readme.py)
    sentences = readme.threshold_sentences(summary)
    assert sentences is not None
    assert "clips 10.0 % of the momentum's entries, of which 2.0 % exceed" in sentences
    assert "at most 0.01 % 10 times; the clipped part is 30.0 % of" in sentences
    assert "changed by +0.000 [+0.000, +0.000] nats at 150 steps" in sentences
    claims = readme.claims(summary)
    assert claims[0].startswith('`ns_coefficients="muon"`') and len(claims) == 2 + 13
    assert "The README's claims, each with its interval" in v3.markdown(summary)
    # a diverged run is shown, not waited for: no interval, one test fewer in the correction
    import copy

    broken = copy.deepcopy(summary)
    broken["cells"]["kjv@150"]["arms"]["muon-bf16"]["test_loss"][2] = math.nan
    comp = next(c for c in broken["comparisons"] if c["label"] == "default − torch.optim.Muon")
    del comp["cells"]["kjv@150"]  # the summary leaves out a pair with a non-finite value
    shown = readme.headline(broken)
    row = next(ln for ln in shown.splitlines() if ln.startswith("| `kjv`, 150"))
    assert "1 of 5 diverged" in row and "— (a run diverged)" in row
    assert "Holm-corrected over the table's 12 differences" in " ".join(shown.split())
    assert any("kjv@150: ROOT" in c and "Muon 1 of 5 diverged" in c for c in readme.claims(broken))
    # with one report run of the real-model cell missing, the README keeps v2's block
    summary["real_model"]["arms"]["muon-bf16"]["test_loss"] = None
    assert readme.rows(summary) is None and len(readme.claims(summary)) == 2
    with pytest.raises(ValueError, match="pending"):
        readme.headline(summary)


def test_the_page_carries_the_block_rendered_from_the_committed_summary() -> None:
    """docs/benchmarks.md's v3 block is docs/study_results.json rendered, and that summary
    names the CPU and instruction set of every record."""
    import json

    from rootopt_analysis.bench.study_report import splice

    summary = json.loads((REPO / "docs" / "study_results.json").read_text(encoding="utf-8"))
    page = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert splice(page, v3.markdown(summary), v3.BEGIN, v3.END) == page
    assert summary["meta"]["cpus"] and all("(" in c for c in summary["meta"]["cpus"])
    assert summary["index"]["runs"] > 0


def test_the_committed_summary_is_the_committed_record_rendered_again() -> None:
    """docs/study_results.json is what docs/study-v3/ (with v2's record for the reused
    selection runs) gives, rendered again here with nothing trained; its run index names the
    commit and the machine (CPU and instruction set) of every run, as the run's record does."""
    import json

    from rootopt_analysis.bench.store import read_sessions
    from rootopt_analysis.bench.study_report import provenance

    record = REPO / "docs" / "study-v3"
    committed = json.loads((REPO / "docs" / "study_results.json").read_text(encoding="utf-8"))
    store = v3.open_store(record)
    lookup = v3.reused_lookup(store, [v3.v2.open_store(REPO / "docs" / "study")])
    w = v3.walk(lookup, store.timing.get)
    meta = provenance(read_sessions(record / "study-log.jsonl"), store)
    again = json.loads(json.dumps(v3.summarize(w, store, meta)))
    assert json.dumps(again, sort_keys=True) == json.dumps(committed, sort_keys=True)
    idx = committed["index"]
    col = {c: i for i, c in enumerate(idx["columns"])}
    assert len(idx["rows"]) == len(store.runs) == committed["index"]["runs"]
    for row in idx["rows"]:
        m = store.runs[row[col["run_id"]]]["machine"]
        assert row[col["machine"]].startswith(f"{m['cpu']} ({m['isa']}")
        assert len(row[col["commit"]]) == 40


def _row(cell: str, p: float, eq_p: float | None = None) -> object:
    from rootopt_analysis.bench import study_v3_pages as readme

    d = {"mean": -0.01, "lo": -0.02, "hi": 0.0, "n": 5, "sd": 0.01, "p": p}
    eq = None if eq_p is None else {**d, "p": eq_p, "steps": {"a": 100}}
    return readme.Row(cell, cell, [1.0, 1.1], [1.2, 1.3], d, None, eq is not None, eq)


def test_readme_bold_is_holm_over_every_difference_the_table_shows() -> None:
    """Bold needs the Holm-adjusted p of its test, over all the table's differences (equal
    steps and equal time together), at or below 0.05: a raw p of 0.02 among 4 tests is not
    enough, 0.01 is (0.04 after Holm), and the equal-time tests count in the family."""
    from rootopt_analysis.bench import study_v3_pages as readme

    rows = [_row("a", 0.01), _row("b", 0.02), _row("c", 0.5, eq_p=0.9)]
    adjusted = readme.adjusted_p(rows)  # type: ignore[arg-type]
    assert adjusted == {
        ("a", "steps"): pytest.approx(0.04),
        ("b", "steps"): pytest.approx(0.06),
        ("c", "steps"): pytest.approx(1.0),
        ("c", "time"): pytest.approx(1.0),
    }
    assert readme.bold(rows) == {("a", "steps")}  # type: ignore[arg-type]
    # without the equal-time test the family is 3: b's 0.02 × 2 = 0.04 is bold too
    rows = [_row("a", 0.01), _row("b", 0.02), _row("c", 0.5)]
    assert readme.bold(rows) == {("a", "steps"), ("b", "steps")}  # type: ignore[arg-type]


def test_readme_names_the_real_models_size_as_transformers_counts_it() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rootopt_analysis.bench import study_v3_pages as readme
    from rootopt_analysis.bench.study_v3_real import HF_CONFIG

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**HF_CONFIG))
    assert readme.llama_parameters() == sum(p.numel() for p in model.parameters()) == 7_309_568
    assert set(readme.SEVEN) == {*v3.LM_CELLS, *v3.CNN_CELLS}


def _publish_module() -> Any:
    import importlib.util

    path = REPO / "benchmarks" / "study_publish.py"
    spec = importlib.util.spec_from_file_location("study_publish", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _v3_pages(root: Path) -> dict[Path, str]:
    """The three pages publish_v3 writes, each with its markers, in a repository at ``root``."""
    from rootopt_analysis.bench.study_report import (
        HEADLINE_BEGIN,
        HEADLINE_END,
        THRESHOLD_BEGIN,
        THRESHOLD_END,
    )

    (root / "docs").mkdir()
    pages = {
        root / "docs" / "benchmarks.md": f"# page\n\n{v3.BEGIN}\nold\n{v3.END}\n\nkept\n",
        root / "README.md": f"# readme\n\n{HEADLINE_BEGIN}\nold\n{HEADLINE_END}\n",
        root / "docs" / "optimizer.md": (
            f"# optimizer\n\n{THRESHOLD_BEGIN}\nold\n{THRESHOLD_END}\n\n## Use\n"
        ),
    }
    for path, text in pages.items():
        path.write_text(text)
    return pages


@pytest.mark.parametrize("broken", ['{"broken', "[1, 2]", "\udcff"])
def test_publish_v3_refuses_a_summary_that_is_not_one(tmp_path: Path, broken: str) -> None:
    """A committed summary that is not a JSON object (torn, hand-edited, not UTF-8) stops the
    publisher with one line naming the file, before any page is written."""
    mod = _publish_module()
    pages = _v3_pages(tmp_path)
    docs = tmp_path / "docs"
    (docs / "study_results_v2.json").write_bytes(broken.encode("utf-8", "surrogateescape"))
    with pytest.raises(SystemExit, match=r"^study_publish: study_results_v2.json is not a study"):
        mod.publish_v3(tmp_path)
    assert all(path.read_text() == text for path, text in pages.items())
    assert not (docs / "study-v3").exists() and not (docs / "study_results.json").exists()


def test_publish_v3_writes_v2s_shared_blocks_until_v3s_runs_are_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """publish_v3 checks every page's markers before writing; while a run the README's table
    or the threshold sentences read is pending those blocks are v2's (from v2's committed
    summary); once v3's are ready they are v3's."""
    import json
    import shutil

    from rootopt_analysis.bench import study_report, study_v3_pages
    from rootopt_analysis.bench.study_report import HEADLINE_BEGIN, THRESHOLD_END

    mod = _publish_module()
    page, readme, optimizer = _v3_pages(tmp_path).values()
    docs = tmp_path / "docs"
    (docs / "study").symlink_to(REPO / "docs" / "study")  # v2's record, read only
    with pytest.raises(SystemExit, match="study_results_v2.json"):  # v2's summary is missing
        mod.publish_v3(tmp_path)
    assert (docs / "benchmarks.md").read_text() == page and not (docs / "study-v3").exists()
    shutil.copyfile(REPO / "docs" / "study_results_v2.json", docs / "study_results_v2.json")
    (tmp_path / "README.md").write_text("# readme\n\n" + HEADLINE_BEGIN + "\n")  # one marker
    with pytest.raises(SystemExit, match="README.md must hold"):
        mod.publish_v3(tmp_path)
    assert (docs / "benchmarks.md").read_text() == page and not (docs / "study-v3").exists()
    assert (docs / "optimizer.md").read_text() == optimizer
    (tmp_path / "README.md").write_text(readme)
    got = mod.publish_v3(tmp_path)
    assert got["readme"] == "v2" and got["threshold"] == "v2"
    v2_summary = json.loads((docs / "study_results_v2.json").read_text())
    assert (tmp_path / "README.md").read_text() == (
        "# readme\n\n" + study_report.headline(v2_summary)
    )
    assert "\nold\n" not in (docs / "benchmarks.md").read_text()
    text = (docs / "optimizer.md").read_text()
    assert "defaults study v2" in text and text.endswith(f"{THRESHOLD_END}\n\n## Use\n")
    monkeypatch.setattr(study_v3_pages, "ready", lambda s: True)
    monkeypatch.setattr(study_v3_pages, "headline", lambda s: "v3's table\n")
    monkeypatch.setattr(study_v3_pages, "threshold_sentences", lambda s: "v3's sentences.")
    assert mod.publish_v3(tmp_path)["readme"] == "v3"
    assert (tmp_path / "README.md").read_text() == "# readme\n\nv3's table\n"
    assert "\nv3's sentences.\n" in (docs / "optimizer.md").read_text()


def test_the_shared_blocks_are_the_committed_studies_rendered() -> None:
    """README.md's results block and docs/optimizer.md's threshold sentences are what the
    publisher renders from the committed v2 and v3 summaries."""
    import json

    from rootopt_analysis.bench.study_report import splice

    mod = _publish_module()
    v2 = json.loads((REPO / "docs" / "study_results_v2.json").read_text(encoding="utf-8"))
    v3_summary = json.loads((REPO / "docs" / "study_results.json").read_text(encoding="utf-8"))
    blocks = mod.shared_blocks(v2, v3_summary)
    for rel, begin, end in mod.SHARED:
        doc = (REPO / rel).read_text(encoding="utf-8")
        assert splice(doc, blocks[rel], begin, end) == doc, rel
