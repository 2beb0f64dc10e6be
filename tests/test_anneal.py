"""Ternary-step QUBO: the encoding's optimum equals brute force; samplers; bad inputs."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

dimod = pytest.importorskip("dimod")
pytest.importorskip("dwave.samplers")

import numpy as np  # noqa: E402

from rootopt.anneal.qubo import (  # noqa: E402
    AnnealError,
    curvature,
    decode,
    make_sampler,
    quadratic_model,
    solve_ternary,
    ternary_bqm,
)

SRC = Path(__file__).resolve().parents[1] / "src"


def _instance(n: int, seed: int, rank: int = 2) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=n), rng.uniform(0.0, 1.0, n), rng.normal(size=(n, rank))


def _brute(g: np.ndarray, d: np.ndarray, v: np.ndarray, s: float) -> tuple[float, np.ndarray]:
    best = min(
        (quadratic_model(s * np.array(t, dtype=float), g, d, v), t)
        for t in itertools.product((-1, 0, 1), repeat=g.size)
    )
    return best[0], s * np.array(best[1], dtype=float)


@pytest.mark.parametrize("seed", range(4))
def test_exact_solver_finds_brute_force_optimum(seed: int) -> None:
    g, d, v = _instance(5, seed)
    s = 0.3 + 0.2 * seed
    opt, arg = _brute(g, d, v, s)
    sol = solve_ternary(dimod.ExactSolver(), g, d, v, s)
    assert sol.energy == pytest.approx(opt, abs=1e-9)
    np.testing.assert_allclose(sol.delta, arg)  # random instance: the optimum is unique
    assert sol.binaries == 10 and sol.couplings == 45


def test_every_binary_state_decodes_to_its_ternary_energy_plus_penalty() -> None:
    g, d, v = _instance(4, 7)
    s, pen = 0.5, 0.25
    bqm = ternary_bqm(g, d, v, s, penalty=pen)
    states = dimod.ExactSolver().sample(bqm)
    assert len(states) == 2**8
    for sample, energy in states.data(["sample", "energy"]):
        both = sum(sample[i] * sample[4 + i] for i in range(4))
        assert energy == pytest.approx(quadratic_model(decode(sample, 4, s), g, d, v) + pen * both)


def test_simulated_annealing_with_enough_reads_is_optimal() -> None:
    sampler, limit, desc = make_sampler("sa")
    assert "simulated annealing" in desc and limit is not None
    for seed in range(3):
        g, d, v = _instance(8, 100 + seed)
        opt, _ = _brute(g, d, v, 0.5)
        sol = solve_ternary(sampler, g, d, v, 0.5, limit=limit, num_reads=50, seed=seed)
        assert sol.energy == pytest.approx(opt, abs=1e-9)


def test_curvature_is_exact_at_full_rank_and_nonnegative() -> None:
    rng = np.random.default_rng(0)
    gs = rng.normal(size=(6, 10))
    d, v = curvature(gs, rank=6, damping=0.0)
    np.testing.assert_allclose(v @ v.T + np.diag(d), gs.T @ gs / 6, atol=1e-10)
    d2, v2 = curvature(gs, rank=2, damping=1e-3)
    assert v2.shape == (10, 2) and (d2 >= 1e-3).all()
    np.testing.assert_allclose(np.diag(v2 @ v2.T) + d2 - 1e-3, (gs * gs).sum(0) / 6, atol=1e-10)


def test_bad_inputs_named() -> None:
    g, d, v = _instance(11, 0)
    with pytest.raises(AnnealError, match="block too large for sampler 'exact': 22 binary"):
        solve_ternary(dimod.ExactSolver(), g, d, v, 0.1, limit=20, name="exact")
    with pytest.raises(AnnealError, match="module 'no_such_ocean_pkg' is not installed"):
        make_sampler("no_such_ocean_pkg:Sampler")
    with pytest.raises(AnnealError, match="unknown sampler 'qpu'"):
        make_sampler("qpu")
    with pytest.raises(AnnealError, match="has no 'Nope'"):
        make_sampler("dimod:Nope")
    sampler, _, _ = make_sampler("dimod:ExactSolver")  # any importable dimod sampler
    assert type(sampler) is dimod.ExactSolver


def test_quantized_head_stays_on_grid() -> None:
    from rootopt.anneal.experiment import HeadConfig, run_head

    for method in ("qubo", "sign", "rounded-root"):
        r = run_head(HeadConfig(method=method, steps=4, num_reads=2, num_sweeps=50))
        assert r["head_on_grid"] and np.isfinite(r["final_val_loss"]), r
        assert r["block_vars"] == 160
        if method == "qubo":
            assert r["binaries"] == 320 and r["solver_s_per_step"] > 0


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rootopt.cli", "anneal", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )


def test_cli_check_and_bad_inputs() -> None:
    r = _cli("check", "--n", "6", "--sampler", "exact")
    assert r.returncode == 0 and "-> optimal" in r.stdout, r.stdout + r.stderr
    r = _cli("head", "--sampler", "exact")  # 320 binaries > ExactSolver's 20
    assert r.returncode == 2 and "block too large" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    r = _cli("head", "--sampler", "dwave.system:DWaveSampler")
    assert r.returncode == 2 and "'dwave.system:DWaveSampler'" in r.stderr


def test_missing_sampler_package_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "dwave.samplers", None)
    with pytest.raises(AnnealError, match=r"sampler 'sa' needs the 'dwave-samplers' package"):
        make_sampler("sa")
