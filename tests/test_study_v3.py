"""The defaults study v3 (docs/benchmarks.md, "Defaults study v3: protocol"): its rule on
plain numbers, and its plan over the committed v2 record (v2's tuning reused, new seeds only)."""

from __future__ import annotations

import math
from pathlib import Path

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
