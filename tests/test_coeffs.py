from __future__ import annotations

import pytest

from rootopt.coeffs import (
    MUON,
    NAMED_SETS,
    PAPER_TABLE,
    apply_schedule,
    available,
    check_stability,
    official_schedule,
    resolve,
)


@pytest.mark.parametrize("name", sorted(NAMED_SETS))
def test_published_sets_are_stable(name: str) -> None:
    rep = check_stability(NAMED_SETS[name].schedule(5))
    assert rep.stable, rep.reason


def test_paper_2048_square_entry_is_unstable() -> None:
    coeff = PAPER_TABLE[(2048, 2048)]
    rep = check_stability((coeff,) * 5)
    assert not rep.stable
    # the reference facts: 5 iterations map x≈0.559 to ≈3.31
    assert rep.peak == pytest.approx(3.31, abs=0.01)
    six = apply_schedule((coeff,) * 6, [0.559])
    assert six[0] > 600


@pytest.mark.parametrize("key", [k for k in PAPER_TABLE if k != (2048, 2048)])
def test_other_paper_entries_are_stable(key: tuple[int, int]) -> None:
    assert check_stability((PAPER_TABLE[key],) * 5).stable


def test_official_uses_table_then_muon() -> None:
    assert official_schedule(3072, 2048, 5) == (PAPER_TABLE[(2048, 3072)],) * 5
    assert official_schedule(2048, 2048, 5) == (PAPER_TABLE[(2048, 2048)],) * 5
    assert official_schedule(100, 37, 3) == MUON.tuples * 3


@pytest.mark.parametrize("rows,cols", [(2048, 2048), (64, 64), (1, 7), (7, 1), (3000, 5)])
def test_adanewton_is_always_stable(rows: int, cols: int) -> None:
    sched = resolve("adanewton", rows, cols, 5)
    assert len(sched) == 5
    assert check_stability(sched).stable


def test_resolve_forms() -> None:
    assert resolve((1.5, -0.5, 0.0), 4, 4, 3) == ((1.5, -0.5, 0.0),) * 3
    two = [(3.0, -3.0, 1.0), (1.5, -0.5, 0.0)]
    assert resolve(two, 4, 4, 2) == tuple(two)
    assert resolve(lambda r, c, k: [(1.0, 0.0, 0.0)] * k, 4, 4, 2) == ((1.0, 0.0, 0.0),) * 2
    assert resolve("polar_express", 4, 4, 10)[-1] == (1.875, -1.25, 0.375)
    assert {"muon", "official", "adanewton", "polar_express", "you", "cans"} <= set(available())


@pytest.mark.parametrize(
    "spec,match",
    [
        ("nope", "unknown"),
        ((1.0, 2.0), r"\(a, b, c\)"),
        ([(1.0, 0.0, 0.0)] * 3, "ns_steps=2"),
        (42, "not a name"),
    ],
)
def test_resolve_rejects(spec: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve(spec, 4, 4, 2)  # type: ignore[arg-type]
