"""AdaNewton: shipped table stability, lookup for any shape, cache handling."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rootopt.coeffs import PAPER_TABLE, check_stability, resolve
from rootopt.coeffs import adanewton as an
from rootopt.coeffs.stability import apply_schedule, verify_schedule

_, ENTRIES = an.load_table()
ENTRY_KEYS = sorted(ENTRIES)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Every test gets an empty cache dir and fresh in-process lookups."""
    monkeypatch.setenv("ROOTOPT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ROOTOPT_ADANEWTON_FIT", raising=False)
    an.clear_memory_caches()
    yield
    an.clear_memory_caches()


@pytest.fixture
def fast_fit(monkeypatch):
    """A tiny run-time fit budget so tests that fit stay well under a second or two."""
    monkeypatch.setattr(an, "RUNTIME_FIT", {"per_family": 2, "max_dim": 32, "max_iter": 15})


@pytest.fixture
def stub_fit(monkeypatch):
    """Replace the fitter by an instant one (for tests about the cache, not the fit)."""
    from rootopt.coeffs import fit as fit_mod

    calls = []

    def fake(rows, cols, config=None, **kw):
        calls.append((rows, cols))
        sched = (fit_mod.YOU.tuples[-1],) * config.steps
        return fit_mod.FitResult(rows, cols, sched, "single", 0.5, 1.2, {}, config, "stub", 0.0)

    monkeypatch.setattr(fit_mod, "fit_coefficients", fake)
    return calls


# ------------------------------------------------------------------------ shipped table


def test_table_present_and_covers_model_families():
    from rootopt.coeffs.shapes import table_shapes

    header, entries = an.load_table()
    assert header["format"] == an.TABLE_FORMAT
    prov = header["provenance"]
    for field in ("objective", "fit_config", "spectra", "fitter_version", "code_version"):
        assert field in prov
    cfg = prov["fit_config"]
    assert cfg["steps"] == 5 and cfg["dtype"] == "float32" and cfg["delta"] == 0.25
    keys = {(m, n) for (m, n, k, dt) in entries if k == 5 and dt == "float32"}
    assert set(table_shapes()) <= keys
    assert set(PAPER_TABLE) <= keys  # the four paper shapes


@pytest.mark.parametrize("key", ENTRY_KEYS, ids=[f"{m}x{n}" for m, n, _, _ in ENTRY_KEYS])
def test_every_shipped_entry_is_stable(key):
    e = ENTRIES[key]
    assert len(e.schedule) == e.steps
    rep = check_stability(e.schedule)  # the plain checker ...
    assert rep.stable, rep.reason
    strict = verify_schedule(e.schedule, prefix_bound=an.PREFIX_BOUND)  # ... and the refined one
    assert strict.stable, strict.reason
    assert strict.peak <= 1.25
    assert strict.peak == pytest.approx(e.raw["peak"], abs=1e-3)
    # plateau: a dominant direction (sigma in [0.3, 1]) is never suppressed below 0.6
    assert apply_schedule(e.schedule, np.linspace(0.3, 1.0, 4001)).min() >= 0.6


@settings(max_examples=300, deadline=None)
@given(
    idx=st.integers(min_value=0, max_value=max(0, len(ENTRY_KEYS) - 1)),
    x=st.floats(min_value=0.0, max_value=1.0, allow_nan=False),
)
def test_property_composition_bounded_for_any_sigma(idx, x):
    e = ENTRIES[ENTRY_KEYS[idx]]
    ys = np.array([x])
    for k in range(len(e.schedule)):
        ys = apply_schedule(e.schedule[k : k + 1], ys)
        bound = 1.25 if k == len(e.schedule) - 1 else an.PREFIX_BOUND
        assert -1e-12 <= ys[0] <= bound + 1e-12


def test_paper_2048_square_flagged_unstable_by_same_checkers():
    sched = (PAPER_TABLE[(2048, 2048)],) * 5
    rep = check_stability(sched)
    assert not rep.stable and rep.peak == pytest.approx(3.31, abs=0.01)
    assert not verify_schedule(sched, prefix_bound=an.PREFIX_BOUND).stable
    # ... and AdaNewton's entry for that shape is stable.
    assert verify_schedule(an.lookup(2048, 2048, 5).schedule).stable


def test_paper_shapes_served_from_table_and_differ_from_paper():
    for m, n in PAPER_TABLE:
        res = an.lookup(m, n, 5, fit=False)
        assert res.source == "table"
        assert res.schedule != (PAPER_TABLE[(m, n)],) * 5


def test_fitter_version_in_sync():
    from rootopt.coeffs.fit import FITTER_VERSION

    assert an._fitter_version() == FITTER_VERSION


# -------------------------------------------------------------------------------- lookup


def test_resolve_uses_adanewton_and_tall_wide_symmetry():
    wide = resolve("adanewton", 768, 3072, 5)
    tall = resolve("adanewton", 3072, 768, 5)
    assert wide == tall == an.lookup(768, 3072, 5).schedule


@pytest.mark.parametrize("shape", [(1, 7), (7, 1), (1, 1), (33, 17), (97, 1000), (5000, 3)])
def test_nearest_mode_any_shape_no_fit(shape, monkeypatch):
    monkeypatch.setenv("ROOTOPT_ADANEWTON_FIT", "0")
    res = an.lookup(*shape, 5)
    assert res.source == "nearest"
    assert verify_schedule(res.schedule).stable
    assert not (an.cache_dir()).exists()  # nothing fitted, nothing written


def test_nearest_entry_prefers_close_min_dim_and_aspect():
    e = an.nearest_entry(2000, 8100, 5)
    assert e is not None and (e.rows, e.cols) == (2048, 8192)


def test_no_entry_for_steps_falls_back_to_muon(monkeypatch):
    monkeypatch.setenv("ROOTOPT_ADANEWTON_FIT", "0")
    res = an.lookup(100, 300, 7)
    assert res.source == "muon" and len(res.schedule) == 7
    assert check_stability(res.schedule).stable


def test_module_switch_disables_fit(monkeypatch):
    monkeypatch.setattr(an, "FIT_AT_RUNTIME", False)
    assert an.lookup(45, 91, 5).source == "nearest"


def test_invalid_shapes_rejected():
    with pytest.raises(ValueError, match="positive"):
        an.lookup(0, 5, 5)
    with pytest.raises(ValueError, match="steps"):
        an.lookup(5, 5, 0)


@pytest.mark.parametrize("shape", [(1, 9), (9, 1)])
def test_vector_fit_maps_one_to_one(shape, fast_fit):
    # A vector's only normalised singular value is 1: the fitted map must send 1 near 1.
    res = an.lookup(*shape, 5)
    assert res.source == "fit"
    assert abs(apply_schedule(res.schedule, np.array([1.0]))[0] - 1.0) < 0.05
    assert verify_schedule(res.schedule).stable


def test_fit_then_cache_then_log_once(fast_fit, caplog):
    caplog.set_level(logging.INFO, logger="rootopt.coeffs")
    first = an.lookup(37, 101, 5)
    assert first.source == "fit"
    path = an.cache_path(37, 101, 5, "float32")
    assert path.exists()
    raw = json.loads(path.read_text())
    assert raw["shape"] == [37, 101] and raw["provenance"]["config"]["steps"] == 5
    an.lookup(37, 101, 5)  # same process: logged once
    assert sum("37x101" in r.getMessage() for r in caplog.records) == 1
    an.clear_memory_caches()
    second = an.lookup(101, 37, 5)  # transposed shape, new process state
    assert second.source == "cache" and second.schedule == first.schedule
    # no temp files left behind by the atomic write
    assert [p.name for p in path.parent.iterdir()] == [path.name]


@pytest.mark.parametrize(
    "corrupt",
    [
        "",  # empty file
        "{not json",
        json.dumps({"format": "rootopt.adanewton_cache/1", "shape": [37, 101], "steps": 5}),
        json.dumps(
            {
                "format": "rootopt.adanewton_cache/1",
                "shape": [38, 101],
                "steps": 5,
                "dtype": "float32",
                "schedule": [[3.4445, -4.775, 2.0315]] * 5,
            }
        ),
        # parses and matches the key, but unstable (the paper's 2048² tuple): never trusted
        json.dumps(
            {
                "format": "rootopt.adanewton_cache/1",
                "shape": [37, 101],
                "steps": 5,
                "dtype": "float32",
                "schedule": [[3.4916, -4.8224, 2.1095]] * 5,
            }
        ),
        json.dumps(
            {
                "format": "rootopt.adanewton_cache/1",
                "shape": [37, 101],
                "steps": 5,
                "dtype": "float32",
                "schedule": [[math.inf, 0, 0]] * 5,
            }
        ),
    ],
)
def test_corrupt_cache_entry_is_refitted(corrupt, stub_fit, caplog):
    path = an.cache_path(37, 101, 5, "float32")
    path.parent.mkdir(parents=True)
    path.write_text(corrupt)
    res = an.lookup(37, 101, 5)
    assert res.source == "fit" and stub_fit == [(37, 101)]
    assert verify_schedule(res.schedule).stable
    assert an.read_cache(path, (37, 101, 5, "float32")) == res.schedule  # rewritten, valid
    assert any("refitting" in r.getMessage() for r in caplog.records)


def test_unwritable_cache_still_returns(stub_fit, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("ROOTOPT_CACHE_DIR", str(blocker))  # a file, not a directory
    res = an.lookup(29, 61, 5)
    assert res.source == "fit" and "not cached" in res.detail


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv("ROOTOPT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert an.cache_dir() == tmp_path / "xdg" / "rootopt"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert an.cache_dir().parts[-2:] == (".cache", "rootopt")


def test_lookup_import_does_not_import_fitter():
    import subprocess
    import sys

    code = (
        "import sys, rootopt.coeffs.adanewton as a; a.lookup(768, 3072, 5, fit=False);"
        "print('rootopt.coeffs.fit' in sys.modules, 'scipy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
