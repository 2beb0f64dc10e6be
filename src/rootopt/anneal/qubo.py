"""The ternary-step QUBO, its samplers, and the curvature estimate.

Encoding (two binaries per variable): ``δᵢ = s (aᵢ − bᵢ)`` with ``aᵢ, bᵢ ∈ {0, 1}``. Every ternary
value is reachable and the objective depends on ``δ`` only, so the binary minimum equals the
ternary minimum; ``(aᵢ, bᵢ) = (1, 1)`` decodes to 0 like ``(0, 0)``, and a penalty ``P aᵢ bᵢ``
(``P > 0``) makes ``(0, 0)`` the unique minimiser of that pair, so a ground state decodes
unambiguously. With ``z = [a; b]`` and ``E = [I, −I]`` (``δ = s E z``)::

    f(z) = s (Eᵀg)ᵀ z + ½ s² zᵀ (Eᵀ H E) z + P Σ aᵢ bᵢ,   zᵢ² = zᵢ

so the linear biases are ``s Eᵀg + ½ s² diag(EᵀHE)`` and the coupling of ``zᵢ, zⱼ`` (i < j) is
``s² (EᵀHE)ᵢⱼ``. ``H = diag(d) + V Vᵀ`` is dense in the block, so the model has
``n(2n−1)`` couplings at most; blocks stay small.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

# Largest number of binary variables each built-in sampler accepts. ExactSolver enumerates
# all 2^N states (memory O(2^N)); the annealers are heuristics whose cost grows with the
# number of couplings, which is dense (O(N²)) here.
BUILTIN_SAMPLERS = {"sa": 2048, "tabu": 2048, "exact": 20}


class AnnealError(ValueError):
    """A block or sampler that cannot be used (one line naming it)."""


def ternary_bqm(
    g: np.ndarray, diag: np.ndarray, factor: np.ndarray, s: float, *, penalty: float | None = None
) -> Any:
    """``dimod.BinaryQuadraticModel`` of ``min_δ gᵀδ + ½ δᵀ(diag(d) + V Vᵀ)δ``, ``δ ∈ {−s,0,s}ⁿ``.

    ``g``: (n,), ``diag``: (n,) ≥ 0, ``factor`` V: (n, r). Variables ``0..n−1`` are ``a``,
    ``n..2n−1`` are ``b``. ``penalty`` defaults to ``s² · max(dᵢ + ‖Vᵢ‖²) + s·max|g|`` (any
    positive value is correct; see the module docstring).
    """
    import dimod

    g = np.asarray(g, dtype=np.float64).reshape(-1)
    n = g.size
    d = np.asarray(diag, dtype=np.float64).reshape(-1)
    v = np.asarray(factor, dtype=np.float64).reshape(n, -1)
    if d.shape != (n,):
        raise ValueError(f"diag has shape {d.shape}, expected ({n},)")
    if not s > 0:
        raise ValueError(f"step s must be > 0, got {s}")
    h = v @ v.T + np.diag(d)
    e = np.concatenate([np.eye(n), -np.eye(n)], axis=1)  # δ = s E z
    qz = 0.5 * s * s * (e.T @ h @ e)
    linear = s * (e.T @ g) + np.diag(qz)
    quad = 2.0 * np.triu(qz, 1)
    if penalty is None:
        penalty = s * s * float(np.max(np.diag(h), initial=0.0)) + s * float(
            np.max(np.abs(g), initial=0.0)
        )
        penalty = max(penalty, 1e-12)
    if not penalty > 0:
        raise ValueError(f"penalty must be > 0, got {penalty}")
    idx = np.arange(n)
    quad[idx, idx + n] += penalty
    return dimod.BinaryQuadraticModel(linear, quad, 0.0, dimod.BINARY)


def decode(sample: Any, n: int, s: float) -> np.ndarray:
    """``δ = s (a − b)`` of a sample (a mapping variable → 0/1)."""
    a = np.array([sample[i] for i in range(n)], dtype=np.float64)
    b = np.array([sample[n + i] for i in range(n)], dtype=np.float64)
    return s * (a - b)


def quadratic_model(
    delta: np.ndarray, g: np.ndarray, diag: np.ndarray, factor: np.ndarray
) -> float:
    """``gᵀδ + ½ δᵀ(diag(d) + VVᵀ)δ`` evaluated directly (the oracle for the encoding)."""
    vd = factor.T @ delta
    return float(g @ delta + 0.5 * (delta * diag) @ delta + 0.5 * vd @ vd)


def make_sampler(spec: str) -> tuple[Any, int | None, str]:
    """``(sampler, max binaries or None, description)`` for ``sa`` | ``tabu`` | ``exact`` |
    ``module:Class`` (any importable ``dimod`` sampler, e.g. a QPU or hybrid sampler from
    ``dwave-system`` — it then runs remotely under the user's own account)."""
    if spec == "exact":
        import dimod

        return dimod.ExactSolver(), BUILTIN_SAMPLERS["exact"], "dimod.ExactSolver (brute force)"  # type: ignore[no-untyped-call]
    if spec in ("sa", "tabu"):
        try:
            from dwave.samplers import SimulatedAnnealingSampler, TabuSampler
        except ModuleNotFoundError:
            raise AnnealError(
                f"sampler {spec!r} needs the 'dwave-samplers' package; install with: "
                "pip install 'rootopt[anneal]'"
            ) from None
        if spec == "sa":
            desc = "dwave-samplers SimulatedAnnealingSampler (classical simulated annealing, local CPU)"
            return SimulatedAnnealingSampler(), BUILTIN_SAMPLERS["sa"], desc  # type: ignore[no-untyped-call]
        return TabuSampler(), BUILTIN_SAMPLERS["tabu"], "dwave-samplers TabuSampler (classical)"  # type: ignore[no-untyped-call]
    if ":" not in spec:
        raise AnnealError(
            f"unknown sampler {spec!r} (choose sa, tabu, exact, or module:Class of a dimod sampler)"
        )
    mod_name, _, cls_name = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        raise AnnealError(f"sampler {spec!r}: module {exc.name!r} is not installed") from None
    cls = getattr(mod, cls_name, None)
    if cls is None:
        raise AnnealError(f"sampler {spec!r}: {mod_name} has no {cls_name!r}")
    try:
        sampler = cls()
    except Exception as exc:  # e.g. no solver access configured
        raise AnnealError(
            f"sampler {spec!r} could not be created: {type(exc).__name__}: {exc}"
        ) from None
    if not hasattr(sampler, "sample"):
        raise AnnealError(f"sampler {spec!r} is not a dimod sampler (no .sample)")
    props = getattr(sampler, "properties", {}) or {}
    limit = props.get("maximum_number_of_biases") or props.get("num_qubits")
    return sampler, (int(limit) if limit else None), spec


def check_size(n_binaries: int, limit: int | None, sampler: str) -> None:
    if limit is not None and n_binaries > limit:
        raise AnnealError(
            f"block too large for sampler {sampler!r}: {n_binaries} binary variables "
            f"(2 per parameter) > its limit {limit}; choose a smaller block"
        )


@dataclass
class Solve:
    delta: np.ndarray
    energy: float  # the quadratic model at δ (penalty excluded: a decoded δ pays none)
    seconds: float
    binaries: int
    couplings: int


def solve_ternary(
    sampler: Any,
    g: np.ndarray,
    diag: np.ndarray,
    factor: np.ndarray,
    s: float,
    *,
    limit: int | None = None,
    name: str = "",
    **sample_kw: Any,
) -> Solve:
    """Build the BQM, sample it, decode the lowest-energy sample."""
    n = int(np.asarray(g).size)
    check_size(2 * n, limit, name or type(sampler).__name__)
    bqm = ternary_bqm(g, diag, factor, s)
    t0 = time.perf_counter()
    best = sampler.sample(bqm, **sample_kw).first.sample
    dt = time.perf_counter() - t0
    delta = decode(best, n, s)
    return Solve(delta, quadratic_model(delta, g, diag, factor), dt, 2 * n, bqm.num_interactions)


def curvature(per_sample: np.ndarray, rank: int, damping: float) -> tuple[np.ndarray, np.ndarray]:
    """Low-rank + diagonal estimate of the empirical Fisher ``F = GᵀG / B`` of ``G`` (B, n).

    ``V`` = the top-``rank`` right singular directions of ``G/√B`` times their singular values
    (so ``VVᵀ`` is the best rank-``rank`` part of ``F``); ``d`` = the remaining diagonal of ``F``
    (non-negative) plus ``damping``. Returns ``(d, V)``.
    """
    b, n = per_sample.shape
    gs = per_sample.astype(np.float64) / np.sqrt(max(b, 1))
    _, sv, vt = np.linalg.svd(gs, full_matrices=False)
    r = min(rank, sv.size)
    v = (vt[:r].T * sv[:r]) if r > 0 else np.zeros((n, 0))
    d = np.maximum((gs * gs).sum(0) - (v * v).sum(1), 0.0) + damping
    return d, v
