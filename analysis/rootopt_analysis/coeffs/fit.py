"""AdaNewton fitter: shape-specific Newton–Schulz coefficients, stable by construction.

Offline tool (float64, CPU, deterministic given a seed and the library versions); the
runtime never imports it. ``rootopt coeffs fit|build-table`` run it, and the opt-in
``ROOT(..., ns_fit=True)`` reaches it through :mod:`rootopt_analysis.coeffs.fitcache` while the
optimizer is built, for a shape that neither the shipped table nor the user cache holds.

Objective. For a shape ``(m, n)`` and ``K`` iterations, minimise the expected relative
Frobenius error ``E ||X_K − U Vᵀ||_F / ||U Vᵀ||_F`` over a spectrum mix
(:mod:`rootopt_analysis.coeffs.spectra`). After Frobenius normalisation the error depends only on
the singular values, ``err(σ)² = mean_i (p_K(σ_i) − 1)²`` with ``p_K`` the K-fold
composition of ``p_k(x) = a_k x + b_k x³ + c_k x⁵``, so the objective is evaluated on
sampled singular-value vectors; the families are averaged with the mix weights.
For a low-precision iteration dtype (bfloat16, float16) every step multiplies the
iterate by ``1 + u ξ`` (``u`` the unit roundoff, ``ξ`` fixed standard-normal draws), a
model of the rounding floor; float32 rounding is far below the error scale and ignored.

Constraints (hard). On a dense grid of ``σ ∈ [0, 1]`` (linear and geometric points) the
K-fold composition must stay in ``[0, 1 + δ]``; every partial composition must stay in
``[0, prefix_bound]`` (default 2, which the published Polar Express and CANS schedules
meet: their first step overshoots to ≈1.99 by design), so no intermediate iterate can
blow up in low precision. Besides, the composition must map ``[0.3, 1]`` into ``[0.6, ∞)``
(``plateau``): one dominant singular value barely moves a Frobenius average over
thousands of values, but it must never be suppressed. A single repeated tuple must also have no local maximum above its
upper fixed point. The optimiser sees the constraints as a quadratic penalty with a
small margin; every candidate is then verified by
:func:`rootopt.coeffs.stability.certify` for the iteration dtype (the exact-arithmetic
checks of ``verify_schedule`` plus, for bfloat16/float16, the rounding envelope the
optimizer's own certificate applies) and rejected or repaired (pulled back towards its
stable warm start) if it fails. The result is never worse on the objective
than the best stable published schedule used as a warm start.

Optimiser: L-BFGS (torch, float64) with penalty continuation from warm starts (a single
tuple from You's last tuple; schedules from You, CANS, Polar Express and the best single
tuple). It uses no
randomness: the seed only fixes the sampled spectra, so a fit is reproducible from its
provenance.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from rootopt.coeffs.presets import CANS, MUON, POLAR_EXPRESS, YOU, Schedule
from rootopt.coeffs.stability import DEFAULT_DELTA, apply_schedule, certify
from rootopt_analysis.coeffs.spectra import (
    DEFAULT_MIX,
    RecordedSet,
    SpectrumSample,
    mix_weights,
    quantiles,
    sample_spectra,
)

# Bump when the objective, the spectra or the optimiser change what a fit returns.
FITTER_VERSION = "2"

Mode = Literal["auto", "schedule", "single"]

UNIT_ROUNDOFF: dict[str, float] = {
    "float64": 0.0,
    "float32": 0.0,  # 6e-8: negligible next to errors of 1e-2
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
}

OBJECTIVE = (
    "expected relative Frobenius error over the spectrum mix: mix-weighted mean over "
    "families of the family's mean of sqrt(mean_i (p_K(sigma_i) - 1)^2), p_K the K-fold "
    "scalar map on Frobenius-normalised singular values (options: balance, aggregate)"
)


@dataclass(frozen=True)
class FitConfig:
    """Everything that determines a fit (recorded as provenance)."""

    steps: int = 5
    mode: Mode = "auto"
    dtype: str = "float32"
    delta: float = DEFAULT_DELTA
    seed: int = 0
    mix: tuple[tuple[str, float], ...] = tuple(DEFAULT_MIX.items())
    per_family: int = 8
    max_dim: int = 256
    prefix_bound: float | None = 2.0
    max_iter: int = 150
    margin: float = 0.01  # penalty aims at 1 + delta - margin; verification uses 1 + delta
    # Plateau (lo, floor): the composition maps [lo, 1] into [floor, 1 + delta], so a
    # dominant direction (one large singular value, invisible in a Frobenius average over
    # thousands of values) is never suppressed. None disables it.
    plateau: tuple[float, float] | None = (0.3, 0.6)
    # Balance the families (off by default): each family's mean error is divided by the
    # best error a stable published schedule reaches on it (floor 1e-4), so the objective
    # becomes the mix-weighted mean of "error relative to the best published schedule".
    balance: bool = False
    # How the families' (balanced) errors are combined: "mean" (mix-weighted mean: the
    # expected error over the mix) or "softmax" (tau·log Σ_f w_f exp(r_f / tau), a soft
    # maximum: the fit improves the family where it is furthest behind instead of trading
    # it for a family where it is far ahead).
    aggregate: Literal["mean", "softmax"] = "mean"
    tau: float = 0.05

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.mode not in ("auto", "schedule", "single"):
            raise ValueError(f"mode={self.mode!r}; choose 'auto', 'schedule' or 'single'")
        if self.dtype not in UNIT_ROUNDOFF:
            raise ValueError(f"dtype={self.dtype!r}; choose one of {sorted(UNIT_ROUNDOFF)}")
        if not 0 < self.delta < 10:
            raise ValueError(f"delta must be in (0, 10), got {self.delta}")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["mix"] = {k: v for k, v in self.mix}
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> FitConfig:
        d = dict(d)
        mix = d.get("mix", DEFAULT_MIX)
        d["mix"] = tuple((str(k), float(v)) for k, v in dict(mix).items())
        if d.get("plateau") is not None:
            d["plateau"] = tuple(float(v) for v in d["plateau"])
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class FitResult:
    rows: int
    cols: int
    schedule: Schedule
    kind: Literal["schedule", "single"]
    objective: float
    peak: float
    family_error: dict[str, float]
    config: FitConfig
    warm_start: str
    seconds: float
    candidates: dict[str, float] = field(default_factory=dict)

    def provenance(self) -> dict[str, Any]:
        return {
            "objective": OBJECTIVE,
            "fitter_version": FITTER_VERSION,
            "config": self.config.to_json(),
            "warm_start": self.warm_start,
        }

    def payload(self) -> dict[str, Any]:
        """The record stored in a cache entry or printed by ``rootopt coeffs fit --json``."""
        return {
            "shape": [min(self.rows, self.cols), max(self.rows, self.cols)],
            "steps": self.config.steps,
            "dtype": self.config.dtype,
            "kind": self.kind,
            "schedule": [list(t) for t in self.schedule],
            "objective": self.objective,
            "peak": self.peak,
            "family_error": self.family_error,
            "provenance": self.provenance(),
        }


# ---------------------------------------------------------------------------- objective


def _stack(
    samples: Mapping[str, Sequence[SpectrumSample]], mix: Mapping[str, float], cap: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str], np.ndarray]:
    """Padded values (S, L), mask, per-spectrum weight, family per row, family index."""
    weights = mix_weights(samples, mix)
    rows: list[np.ndarray] = []
    w: list[float] = []
    fam: list[str] = []
    for f, lst in samples.items():
        if f not in weights:
            continue
        for s in lst:
            sig = s.sigma
            if sig.size > cap:
                # Quantile-compress: keeps the mean of (p(σ) - 1)² to interpolation accuracy.
                sig = quantiles(sig, cap)
            rows.append(sig)
            w.append(weights[f] / len(lst))
            fam.append(f)
    L = max(r.size for r in rows)
    vals = np.zeros((len(rows), L))
    mask = np.zeros((len(rows), L))
    for i, r in enumerate(rows):
        vals[i, : r.size] = r
        mask[i, : r.size] = 1.0
    famnames = sorted(set(fam))
    famidx = np.array([famnames.index(f) for f in fam])
    return vals, mask, np.array(w), famnames, famidx


def constraint_grid(points: int = 1201) -> np.ndarray:
    """Linear and geometric points of [0, 1] (the steep region near 0 gets its share)."""
    return np.unique(
        np.concatenate([np.linspace(0.0, 1.0, points), np.geomspace(1e-6, 1.0, points)])
    )


class _Problem:
    def __init__(
        self,
        samples: Mapping[str, Sequence[SpectrumSample]],
        cfg: FitConfig,
        *,
        cap: int = 256,
    ) -> None:
        vals, mask, w, self.famnames, famidx = _stack(samples, dict(cfg.mix), cap)
        self.vals = torch.from_numpy(vals)
        self.mask = torch.from_numpy(mask)
        self.count = self.mask.sum(dim=1)
        self.w = torch.from_numpy(w)
        self.famidx = torch.from_numpy(famidx)
        nf = len(self.famnames)
        self.fam_count = torch.zeros(nf, dtype=torch.float64).index_add(
            0, self.famidx, torch.ones(len(famidx), dtype=torch.float64)
        )
        fw = mix_weights(samples, dict(cfg.mix))
        self.fam_w = torch.tensor([fw[f] for f in self.famnames], dtype=torch.float64)
        self.ref = torch.ones(nf, dtype=torch.float64)
        self.grid = torch.from_numpy(constraint_grid())
        self.plateau_mask = (
            self.grid >= cfg.plateau[0]
            if cfg.plateau is not None
            else torch.zeros_like(self.grid, dtype=torch.bool)
        )
        self.cfg = cfg
        u = UNIT_ROUNDOFF[cfg.dtype]
        if u > 0:
            g = torch.Generator().manual_seed(cfg.seed)
            self.noise: torch.Tensor | None = 1.0 + u * torch.randn(
                (cfg.steps, *vals.shape), generator=g, dtype=torch.float64
            )
        else:
            self.noise = None

    def per_spectrum(self, sched: torch.Tensor) -> torch.Tensor:
        y = self.vals
        for k in range(sched.shape[0]):
            if self.noise is not None:
                y = y * self.noise[k]
            a, b, c = sched[k, 0], sched[k, 1], sched[k, 2]
            y2 = y * y
            # Clamped so a wild line-search trial gives a large finite loss, not inf/NaN.
            y = torch.clamp(y * (a + y2 * (b + c * y2)), -10.0, 10.0)
        se = ((y - 1.0) ** 2 * self.mask).sum(dim=1) / self.count
        return torch.sqrt(se + 1e-30)

    def balance(self, ref: Mapping[str, float]) -> None:
        """Divide each family's error by its reference error (see ``FitConfig.balance``)."""
        self.ref = torch.tensor([ref[f] for f in self.famnames], dtype=torch.float64)

    def family_means(self, sched: torch.Tensor) -> torch.Tensor:
        e = self.per_spectrum(sched)
        tot = torch.zeros(len(self.famnames), dtype=torch.float64).index_add(0, self.famidx, e)
        return tot / self.fam_count

    def objective(self, sched: torch.Tensor) -> torch.Tensor:
        r = self.family_means(sched) / self.ref
        if self.cfg.aggregate == "mean":
            return (self.fam_w * r).sum()
        tau = self.cfg.tau
        return tau * torch.logsumexp(torch.log(self.fam_w) + r / tau, dim=0)

    def family_errors(self, sched: Schedule) -> dict[str, float]:
        with torch.no_grad():
            e = self.per_spectrum(torch.tensor(sched, dtype=torch.float64))
        return {f: float(e[self.famidx == i].mean()) for i, f in enumerate(self.famnames)}

    def penalty(self, sched: torch.Tensor, extra_steps: int = 0) -> torch.Tensor:
        cfg = self.cfg
        hi = 1.0 + cfg.delta - cfg.margin
        hi_pre = hi if cfg.prefix_bound is None else cfg.prefix_bound - cfg.margin
        y = self.grid
        pen = torch.zeros((), dtype=torch.float64)
        K = sched.shape[0]
        for k in range(K + extra_steps):
            a, b, c = sched[min(k, K - 1), 0], sched[min(k, K - 1), 1], sched[min(k, K - 1), 2]
            y2 = y * y
            y = y * (a + y2 * (b + c * y2))
            # Keep y finite for the penalty even where a candidate explodes.
            y = torch.clamp(y, -10.0, 10.0)
            if k >= K - 1:
                pen = pen + (torch.relu(y - hi) ** 2).sum() + (torch.relu(-y) ** 2).sum()
                if cfg.plateau is not None:
                    floor = cfg.plateau[1] + cfg.margin
                    pen = pen + (torch.relu(floor - y[self.plateau_mask]) ** 2).sum()
            elif cfg.prefix_bound is not None:
                pen = pen + (torch.relu(y - hi_pre) ** 2).sum() + (torch.relu(-y) ** 2).sum()
        return pen


def _lbfgs(problem: _Problem, x0: np.ndarray, *, single: bool, max_iter: int) -> np.ndarray:
    K = problem.cfg.steps
    p = torch.tensor(x0, dtype=torch.float64, requires_grad=True)
    extra = 2 * K if single else 0

    def expand(p: torch.Tensor) -> torch.Tensor:
        return p.reshape(1, 3).expand(K, 3) if single else p.reshape(K, 3)

    last_good = np.asarray(x0, dtype=np.float64)
    for lam in (1e2, 1e4, 1e6):
        opt = torch.optim.LBFGS(
            [p],
            lr=1.0,
            max_iter=max_iter,
            history_size=20,
            line_search_fn="strong_wolfe",
            tolerance_grad=1e-10,
            tolerance_change=1e-12,
        )

        def closure(lam: float = lam, opt: torch.optim.LBFGS = opt) -> torch.Tensor:
            opt.zero_grad()
            s = expand(p)
            loss = problem.objective(s) + lam * problem.penalty(s, extra)
            loss.backward()  # type: ignore[no-untyped-call]
            return loss

        opt.step(closure)  # type: ignore[no-untyped-call]
        if not torch.isfinite(p).all():
            break  # keep the last stage that stayed finite
        last_good = p.detach().numpy().copy()
    return last_good


def _as_schedule(x: np.ndarray, K: int, single: bool) -> Schedule:
    arr = np.asarray(x, dtype=np.float64).reshape(-1, 3)
    if single:
        arr = np.repeat(arr[:1], K, axis=0)
    return tuple((float(a), float(b), float(c)) for a, b, c in arr)


def _round_schedule(s: Schedule) -> Schedule:
    # 10 significant digits: exact enough to reproduce, short enough to read.
    return tuple(tuple(float(f"{v:.10g}") for v in t) for t in s)  # type: ignore[misc]


def _warm_starts(K: int) -> dict[str, Schedule]:
    return {
        "polar_express": POLAR_EXPRESS.schedule(K),
        "cans": CANS.schedule(K),
        "you": YOU.schedule(K),
        "muon": MUON.schedule(K),
    }


def plateau_ok(schedule: Schedule, plateau: tuple[float, float] | None) -> bool:
    """The composition maps ``[plateau[0], 1]`` into ``[plateau[1], inf)``."""
    if plateau is None:
        return True
    x = np.linspace(plateau[0], 1.0, 4001)
    return bool(apply_schedule(schedule, x).min() >= plateau[1])


def _ok(s: Schedule, cfg: FitConfig) -> bool:
    # The runtime certificate of the iteration dtype (coeffs.stability.certify): for
    # bfloat16/float16 it adds the rounding envelope that verify_schedule (exact
    # arithmetic) does not see. Checking only the latter let 48 of 64 bfloat16 fits
    # through that the optimizer then refused (docs/adanewton.md).
    rep = certify(s, dtype=cfg.dtype, delta=cfg.delta, prefix_bound=cfg.prefix_bound)
    return rep.stable and plateau_ok(s, cfg.plateau)


def _repair(candidate: Schedule, start: Schedule, cfg: FitConfig, single: bool) -> Schedule | None:
    """The candidate if it verifies, else the stable point closest to it on the way back."""

    def ok(s: Schedule) -> bool:
        return _ok(s, cfg)

    if ok(candidate):
        return candidate
    if not ok(start):
        return None
    c = np.asarray(candidate)
    s0 = np.asarray(start)
    lo, hi = 0.0, 1.0  # lo: known stable blend weight of the candidate
    for _ in range(20):
        mid = 0.5 * (lo + hi)
        blend = _as_schedule((1 - mid) * s0 + mid * c, cfg.steps, single)
        if ok(blend):
            lo = mid
        else:
            hi = mid
    return _as_schedule((1 - lo) * s0 + lo * c, cfg.steps, single) if lo > 0 else start


def fit_coefficients(
    rows: int,
    cols: int,
    config: FitConfig | None = None,
    *,
    recorded: RecordedSet | None = None,
    samples: Mapping[str, Sequence[SpectrumSample]] | None = None,
    starts: Sequence[str] | None = None,
) -> FitResult:
    """Fit a stable schedule for ``rows x cols`` (see the module docstring).

    ``samples`` overrides the sampled spectra (then ``config.seed`` only seeds the
    rounding model); ``starts`` restricts the warm starts (names of published sets).
    """
    cfg = FitConfig() if config is None else config
    t0 = time.perf_counter()
    K = cfg.steps
    if samples is None:
        samples = sample_spectra(
            rows,
            cols,
            seed=cfg.seed,
            per_family=cfg.per_family,
            max_dim=cfg.max_dim,
            families=[f for f, w in cfg.mix if w > 0],
            recorded=recorded,
        )
    problem = _Problem(samples, cfg)

    def value(s: Schedule) -> float:
        with torch.no_grad():
            return float(problem.objective(torch.tensor(s, dtype=torch.float64)))

    warm = _warm_starts(K)
    if starts is not None:
        warm = {k: v for k, v in warm.items() if k in starts}
    stable_warm = {k: s for k, s in warm.items() if _ok(s, cfg)}
    if cfg.balance and stable_warm:
        fe = [problem.family_errors(s) for s in stable_warm.values()]
        problem.balance({f: max(min(e[f] for e in fe), 1e-4) for f in problem.famnames})
    best: tuple[float, Schedule, str, str] | None = None  # value, schedule, kind, start
    cands: dict[str, float] = {}

    def consider(s: Schedule | None, kind: str, start: str) -> None:
        nonlocal best
        if s is None:
            return
        s = _round_schedule(s)
        if not _ok(s, cfg):
            return
        v = value(s)
        cands[f"{kind}<-{start}"] = v
        if best is None or v < best[0] - 1e-12:
            best = (v, s, kind, start)

    # Published sets themselves are candidates: the fit never loses to its warm starts.
    for name, s in stable_warm.items():
        consider(s, "published", name)
    best_published = best

    single_best: tuple[float, Schedule] | None = None
    if cfg.mode in ("auto", "single"):
        single_starts = {"you_last": YOU.tuples[-1]}
        for name, t in single_starts.items():
            x = _lbfgs(problem, np.array(t), single=True, max_iter=cfg.max_iter)
            start_s = (t,) * K
            rep = _repair(_as_schedule(x, K, True), start_s, cfg, True)
            if rep is not None:
                rep = _round_schedule(rep)
                if _ok(rep, cfg):
                    v = value(rep)
                    cands[f"single<-{name}"] = v
                    if single_best is None or v < single_best[0]:
                        single_best = (v, rep)
        if cfg.mode == "single":
            if single_best is None:
                raise RuntimeError(f"no stable single tuple found for {rows}x{cols}")
            best = (single_best[0], single_best[1], "single", "fit")
    if cfg.mode in ("auto", "schedule"):
        sched_starts: dict[str, Schedule] = {
            k: v for k, v in warm.items() if k in ("you", "cans", "polar_express")
        }
        if single_best is not None:
            sched_starts["single_fit"] = single_best[1]
        for name, s0 in sched_starts.items():
            x = _lbfgs(problem, np.array(s0).reshape(-1), single=False, max_iter=cfg.max_iter)
            rep = _repair(_as_schedule(x, K, False), s0, cfg, False)
            consider(rep, "schedule", name)
        # The paper's form (a single tuple) is kept when the schedule does not win.
        if (
            cfg.mode == "auto"
            and single_best is not None
            and best is not None
            and single_best[0] <= best[0]
        ):
            best = (single_best[0], single_best[1], "single", "fit")
    if best is None:
        raise RuntimeError(f"no stable schedule found for {rows}x{cols}")
    v, sched, _kind, start = best
    if best_published is not None and best is best_published:
        start = f"{start} (published set kept: no fitted candidate beat it)"
    final = certify(sched, dtype=cfg.dtype, delta=cfg.delta, prefix_bound=cfg.prefix_bound)
    return FitResult(
        rows=rows,
        cols=cols,
        schedule=sched,
        kind="single" if len(set(sched)) == 1 else "schedule",
        objective=v,
        peak=final.peak,
        family_error=problem.family_errors(sched),
        config=cfg,
        warm_start=start,
        seconds=time.perf_counter() - t0,
        candidates=cands,
    )
