"""Spectrum families for fitting and judging Newton–Schulz coefficients.

After Frobenius normalisation the Newton–Schulz error of a matrix depends only on its
singular values ``σ`` (``Σ σ² = 1``): ``||X_K − U Vᵀ||_F² = Σ_i (p_K(σ_i) − 1)²`` over
the nonzero ``σ_i``, and ``||U Vᵀ||_F² = rank``. So coefficients are fitted and judged on
*sampled singular-value vectors*, not on matrices.

Families (all deterministic given a seed):

- ``gaussian``: i.i.d. N(0, 1) entries (the Marchenko–Pastur bulk of the shape).
- ``lowrank``: a rank ``r`` signal plus Gaussian noise; ``r`` is a fraction of the small
  dimension (1/64, 1/32, 1/16) and the signal holds 50 %, 80 % or 95 % of the energy,
  with a power-law decay across the signal directions. This is the kind of spectrum on
  which the paper's 2048×8192 entry loses to Muon.
- ``heavytail``: Student-t entries (ν = 2.5 or 4) with log-normal row and column scales,
  clipped at the 0.90 quantile of ``|entries|`` as ROOT's soft threshold does.
- ``momentum``: singular values recorded from real training runs (the optimizer's
  telemetry dumps the Frobenius-normalised spectrum of the clipped momentum; see
  ``rootopt coeffs record``); a recorded spectrum is carried to another shape by
  quantiles (see :func:`transport`); a fit uses every recorded spectrum (all layer types
  and training steps), whatever ``per_family`` says. Recorded models in :data:`HOLDOUT_MODELS` are
  never used by a fit, only by the bench.

Large shapes. A sample of a huge shape (8192×28672) would need an SVD per draw; instead
a smaller matrix with the same aspect ratio is drawn (small dimension ``max_dim``,
default 256) and its normalised singular values are rescaled by ``sqrt(m'/m)`` — each
value then stands for ``m/m'`` values of the large matrix. For the Gaussian family this
is exact in the Marchenko–Pastur limit (finite-size edges of the small draw are a bit
wider, which is conservative); the other families are defined by scale-free parameters
(rank *fraction*, energy fraction, clipping quantile) so the same rescaling applies.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources

import numpy as np

FAMILIES: tuple[str, ...] = ("gaussian", "lowrank", "heavytail", "momentum")

# The mix AdaNewton ships with: weights of each family in the expected error.
DEFAULT_MIX: dict[str, float] = {
    "gaussian": 0.25,
    "lowrank": 0.25,
    "heavytail": 0.25,
    "momentum": 0.25,
}

RECORDED_SPECTRA_FILE = "momentum_spectra.json"

LOWRANK_GRID: tuple[tuple[float, float], ...] = tuple(
    (rf, en) for rf in (1 / 64, 1 / 32, 1 / 16) for en in (0.5, 0.8, 0.95)
)
HEAVYTAIL_NU: tuple[float, float] = (2.5, 4.0)


@dataclass(frozen=True)
class SpectrumSample:
    """Normalised singular values of one matrix of a family (rank-many nonzero values)."""

    family: str
    sigma: np.ndarray  # float64, descending, sum of squares 1
    detail: str = ""


@dataclass
class RecordedSpectrum:
    """A spectrum recorded from a training run (quantile-compressed)."""

    name: str
    rows: int
    cols: int
    step: int
    sigma: np.ndarray  # float64, descending, renormalised to sum of squares 1 over rank

    @property
    def aspect(self) -> float:
        return max(self.rows, self.cols) / max(1, min(self.rows, self.cols))


@dataclass
class RecordedSet:
    """A set of recorded spectra and where they come from."""

    spectra: list[RecordedSpectrum] = field(default_factory=list)
    source: str = ""


def _normalise(s: np.ndarray) -> np.ndarray:
    s = np.sort(np.abs(np.asarray(s, dtype=np.float64)))[::-1]
    tot = float(np.sqrt(np.sum(s * s)))
    if tot == 0.0:
        return s
    s = s / tot
    return s[s > 1e-12 * s[0]] if s.size else s


def _sample_dims(rows: int, cols: int, max_dim: int) -> tuple[int, int]:
    m, n = min(rows, cols), max(rows, cols)
    if m <= max_dim:
        return m, n
    m2 = max_dim
    n2 = max(m2, round(n * m2 / m))
    return m2, n2


def _rescale(sig: np.ndarray, m_small: int, m: int) -> np.ndarray:
    # Each of the m_small values stands for m / m_small values of the large matrix.
    return sig * np.sqrt(m_small / m) if m_small != m else sig


def _svals(M: np.ndarray) -> np.ndarray:
    # Eigenvalues of the small Gram matrix: several times faster than an SVD; values
    # below ~1e-8·σ_max lose digits, far below anything Newton–Schulz can resolve.
    G = M @ M.T if M.shape[0] <= M.shape[1] else M.T @ M
    ev = np.asarray(np.linalg.eigvalsh(G), dtype=np.float64)
    out: np.ndarray = np.sqrt(np.clip(ev, 0.0, None))
    return out


def gaussian(
    rows: int, cols: int, rng: np.random.Generator, *, max_dim: int = 256
) -> SpectrumSample:
    m = min(rows, cols)
    m2, n2 = _sample_dims(rows, cols, max_dim)
    s = _normalise(_svals(rng.standard_normal((m2, n2))))
    return SpectrumSample("gaussian", _rescale(s, m2, m), f"N(0,1) {m2}x{n2}")


def lowrank(
    rows: int,
    cols: int,
    rng: np.random.Generator,
    *,
    max_dim: int = 256,
    rank_frac: float | None = None,
    energy: float | None = None,
) -> SpectrumSample:
    m = min(rows, cols)
    m2, n2 = _sample_dims(rows, cols, max_dim)
    rf = float(rng.choice([1 / 64, 1 / 32, 1 / 16])) if rank_frac is None else rank_frac
    en = float(rng.choice([0.5, 0.8, 0.95])) if energy is None else energy
    r = max(1, round(rf * m2))
    # Signal: orthonormal factors with power-law strengths s_k ∝ k^-0.5.
    U, _ = np.linalg.qr(rng.standard_normal((m2, r)))
    V, _ = np.linalg.qr(rng.standard_normal((n2, r)))
    strengths = np.arange(1, r + 1, dtype=np.float64) ** -0.5
    S = U @ (strengths[:, None] * V.T)
    N = rng.standard_normal((m2, n2))
    S *= np.sqrt(en) / np.linalg.norm(S)
    N *= np.sqrt(1.0 - en) / np.linalg.norm(N)
    s = _normalise(_svals(S + N))
    return SpectrumSample("lowrank", _rescale(s, m2, m), f"rank {rf:.4g}·m, energy {en}")


def heavytail(
    rows: int,
    cols: int,
    rng: np.random.Generator,
    *,
    max_dim: int = 256,
    nu: float | None = None,
    quantile: float = 0.90,
) -> SpectrumSample:
    m = min(rows, cols)
    m2, n2 = _sample_dims(rows, cols, max_dim)
    df = float(rng.choice([2.5, 4.0])) if nu is None else nu
    M = rng.standard_t(df, size=(m2, n2))
    M *= np.exp(0.5 * rng.standard_normal((m2, 1))) * np.exp(0.5 * rng.standard_normal((1, n2)))
    eps = float(np.quantile(np.abs(M), quantile))
    M = np.clip(M, -eps, eps)
    s = _normalise(_svals(M))
    return SpectrumSample(
        "heavytail", _rescale(s, m2, m), f"t(nu={df}) row/col scaled, clip q{quantile}"
    )


def quantiles(sigma: np.ndarray, k: int) -> np.ndarray:
    """Resample a spectrum sample to ``k`` values at equally spaced quantile positions.

    The result represents the same matrix: ``Σ σ²`` scales by ``k / len(sigma)``.
    """
    s = np.sort(np.asarray(sigma, dtype=np.float64))[::-1]
    if s.size == k:
        return s
    pos = (np.arange(k) + 0.5) / k * s.size - 0.5
    r = np.interp(pos, np.arange(s.size), s)
    tot = float(np.sum(r * r))
    return r * np.sqrt(np.sum(s * s) * k / s.size / tot) if tot > 0 else r


def transport(sigma: np.ndarray, dst_min_dim: int, max_points: int = 512) -> np.ndarray:
    """Carry a spectrum (any length, any scale) to a matrix with ``dst_min_dim`` values.

    The sorted values are resampled at ``k = min(dst, max_points)`` equally spaced quantile
    positions and scaled so that ``Σ σ² = k/dst``: each of the ``k`` values stands for
    ``dst/k`` values of the target, whose normalised spectrum then has ``Σ σ² = 1``.
    Spikes keep their *fraction* of the spectrum (a top-1 of 64 becomes a top-32 of 2048).
    """
    s = np.sort(np.asarray(sigma, dtype=np.float64))[::-1]
    k = min(dst_min_dim, max_points)
    if s.size != k:
        pos = (np.arange(k) + 0.5) / k * s.size - 0.5
        s = np.interp(pos, np.arange(s.size), s)
    # Renormalise to sum of squares k/dst (the quantile vector stands for dst values).
    out: np.ndarray = s / np.sqrt(np.sum(s * s)) * np.sqrt(k / dst_min_dim)
    return out


# Recorded spectra of these models are held out of every fit and used only to judge
# (``rootopt coeffs bench``): the fitted table never saw them.
HOLDOUT_MODELS: tuple[str, ...] = ("gpt-d96",)


def load_recorded(path: str | None = None, *, split: str = "fit") -> RecordedSet:
    """Recorded momentum spectra: the file shipped with the package, or ``path``.

    ``split="fit"`` drops the held-out models (:data:`HOLDOUT_MODELS`), ``"holdout"``
    keeps only them, ``"all"`` keeps everything.
    """
    if split not in ("fit", "holdout", "all"):
        raise ValueError(f"split={split!r}; choose 'fit', 'holdout' or 'all'")
    if path is None:
        try:
            text = (
                resources.files("rootopt_analysis.coeffs")
                .joinpath("data", RECORDED_SPECTRA_FILE)
                .read_text()
            )
        except (FileNotFoundError, OSError):
            return RecordedSet()
    else:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    raw = json.loads(text)
    out = RecordedSet(source=str(raw.get("source", "")))
    for e in raw.get("spectra", []):
        held = str(e["name"]).split("/")[0] in HOLDOUT_MODELS
        if (split == "fit" and held) or (split == "holdout" and not held):
            continue
        sig = np.asarray(e["sigma"], dtype=np.float64)
        sig = sig[sig > 0]
        if sig.size == 0:
            continue
        sig = np.sort(sig)[::-1] / np.sqrt(np.sum(sig * sig))
        out.spectra.append(
            RecordedSpectrum(str(e["name"]), int(e["rows"]), int(e["cols"]), int(e["step"]), sig)
        )
    return out


def recorded_for_shape(
    rows: int,
    cols: int,
    recorded: RecordedSet,
    *,
    count: int | None = None,
    rng: np.random.Generator | None = None,
) -> list[SpectrumSample]:
    """Recorded spectra carried to ``rows x cols`` (all of them, or ``count`` drawn by ``rng``).

    Every recorded matrix is used, not only those of a similar aspect ratio: the spectra
    differ more by layer type (attention projection, QKV, MLP) and training step than by
    aspect, and a fit must hold for whichever layer type has the shape. A stored spectrum
    has a few dozen quantiles, so it is carried with at most 64 points.
    """
    if not recorded.spectra or (count is not None and count <= 0):
        return []
    m = min(rows, cols)
    idx = np.arange(len(recorded.spectra))
    if count is not None:
        gen = np.random.default_rng(0) if rng is None else rng
        idx = gen.choice(idx, size=count, replace=idx.size < count)
    out = []
    for i in idx:
        r = recorded.spectra[int(i)]
        sig = transport(r.sigma, m, max_points=64)
        out.append(SpectrumSample("momentum", sig, f"{r.name}@{r.step} ({r.rows}x{r.cols})"))
    return out


def sample_spectra(
    rows: int,
    cols: int,
    *,
    seed: int,
    per_family: int = 8,
    max_dim: int = 256,
    families: Sequence[str] = FAMILIES,
    recorded: RecordedSet | None = None,
) -> dict[str, list[SpectrumSample]]:
    """``per_family`` normalised spectra of each family for a ``rows x cols`` matrix."""
    if rows < 1 or cols < 1:
        raise ValueError(f"shape must be positive, got {rows}x{cols}")
    m = min(rows, cols)
    rng = np.random.default_rng([seed, min(rows, cols), max(rows, cols)])
    out: dict[str, list[SpectrumSample]] = {}
    for fam in families:
        if fam not in FAMILIES:
            raise ValueError(f"unknown spectrum family {fam!r}; choose from {FAMILIES}")
        if m == 1:
            # A vector has one singular value, 1 after normalisation, whatever its entries.
            out[fam] = [SpectrumSample(fam, np.ones(1), "rank 1")]
            continue
        if fam == "momentum":
            rec = load_recorded() if recorded is None else recorded
            # All recorded spectra: they vary more than the synthetic families.
            out[fam] = recorded_for_shape(rows, cols, rec)
            continue
        if fam == "gaussian":
            out[fam] = [gaussian(rows, cols, rng, max_dim=max_dim) for _ in range(per_family)]
        elif fam == "lowrank":
            # Cycle through every (rank fraction, energy) pair so few samples still cover them.
            out[fam] = [
                lowrank(
                    rows,
                    cols,
                    rng,
                    max_dim=max_dim,
                    rank_frac=LOWRANK_GRID[i % 9][0],
                    energy=LOWRANK_GRID[i % 9][1],
                )
                for i in range(per_family)
            ]
        else:
            out[fam] = [
                heavytail(rows, cols, rng, max_dim=max_dim, nu=HEAVYTAIL_NU[i % 2])
                for i in range(per_family)
            ]
    return {k: v for k, v in out.items() if v}


def mix_weights(
    samples: Mapping[str, Sequence[SpectrumSample]], mix: Mapping[str, float]
) -> dict[str, float]:
    """Weights of the families present in ``samples``, renormalised to sum 1."""
    present = {k: float(mix.get(k, 0.0)) for k, v in samples.items() if v}
    tot = sum(present.values())
    if tot <= 0:
        raise ValueError(f"spectrum mix {dict(mix)} gives no weight to the sampled families")
    return {k: w / tot for k, w in present.items()}
