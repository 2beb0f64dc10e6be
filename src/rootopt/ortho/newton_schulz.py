"""Newton–Schulz orthogonalization (2-D and batched 3-D), plain and in Gram space.

For ``G = U S Vᵀ`` the iteration drives every singular value of ``X = G / (||G||_F + eps)``
towards 1 while keeping ``U`` and ``V``: ``A = X Xᵀ; X <- a X + (b A + c A²) X``. It runs
on the wide orientation (rows <= cols, ``X`` is ``m x n`` with ``m <= n``) so the Gram
matrix is the small one.

Two ways to run the same K steps (see docs/performance.md for the cost model and the
measured accuracy):

* :func:`newton_schulz` (plain): ``K (4 m² n + 2 m³)`` flops.
* :func:`gram_newton_schulz`: every iterate is ``X_k = Q_k X₀`` with ``Q_k`` a polynomial
  in ``A₀ = X₀ X₀ᵀ``; with ``Z_k = a_k I + b_k A_k + c_k A_k²`` the recursion is
  ``Q_{k+1} = Z_k Q_k`` and ``A_{k+1} = X_{k+1} X_{k+1}ᵀ = Z_k A_k Z_k``. The K steps then
  run on ``m x m`` matrices and ``X₀`` is touched twice (``A₀`` and ``Q_K X₀``): about
  ``4 m² n + 8 K m³`` flops, fewer than the plain iteration once ``n >= 2 m``. The squared
  spectrum costs precision in low-precision dtypes; :func:`prefer_gram` encodes where it
  was measured to hold.

* :func:`spectral_newton_schulz`: the same map evaluated through the eigendecomposition of
  ``A₀``. Every step multiplies each singular value by ``p_k(σ²) = a_k + b_k σ² + c_k σ⁴``,
  so after K steps ``X_K = V g(Λ) Vᵀ X₀`` with ``A₀ = V Λ Vᵀ`` and ``g`` the product of the
  ``p_k`` along the scalar recursion ``σ²_{k+1} = σ²_k p_k(σ²_k)²`` (a polynomial in ``λ``,
  bounded at 0). Cost: ``4 m² n`` flops for ``A₀`` and ``Q X₀`` plus one ``m x m``
  symmetric eigendecomposition and one ``m x m`` product, whatever K is. ``g`` is smooth,
  so the backward stability of the eigendecomposition carries over to ``V g(Λ) Vᵀ``
  (docs/performance.md, "Spectral evaluation"). :func:`prefer_spectral` says where it is
  the default.

All three fold the Frobenius normalisation into the first small matrix: ``||G||_F² =
trace(G Gᵀ)`` comes with the first Gram matrix, so no separate pass over ``G`` computes it
and ``X₀`` is never materialised.

Coefficients: a schedule (a sequence of K ``(a, b, c)`` floats), or a float tensor of shape
``(K, 3)`` (per step) or ``(K, batch, 3)`` (per step and per matrix of a stack).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from rootopt.coeffs import Coeff

# Frobenius-normalisation guard, as the official ROOT code: X / (||X||_F + eps).
NORM_EPS = 1e-7

# Coefficients as accepted by every iteration here.
Coefficients = Sequence[Coeff] | Tensor

# Dtypes in which the normalisation is folded into the small matrix (their range holds
# the un-normalised Gram matrix); float16 normalises X first.
FOLD_DTYPES = (torch.float32, torch.float64, torch.bfloat16)

# Below this short side the Gram form saves too little to pay for its extra launches.
GRAM_MIN_SIDE = 64
# The Gram form is used by default from this aspect ratio n/m on (its flops are
# 4 m² n + 8 K m³ against K (4 m² n + 2 m³): fewer from n ≈ 1.5 m at K = 5; from 2 m
# on the gain is large enough to survive the smaller matmuls' lower efficiency).
GRAM_MIN_ASPECT = 2.0
# Iteration dtypes for which the Gram form is the default: it matched the plain iteration
# on every spectrum family and was faster. In bfloat16 it is as accurate (its m x m
# recursion runs in float32) but not faster on CPU, so it is opt-in there
# (docs/performance.md, section 4).
GRAM_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64)


def prefer_gram(rows: int, cols: int, dtype: torch.dtype) -> bool:
    """Whether the Gram-space iteration is the default for this shape and dtype."""
    m, n = min(rows, cols), max(rows, cols)
    return dtype in GRAM_DTYPES and m >= GRAM_MIN_SIDE and n >= GRAM_MIN_ASPECT * m


# Where the spectral form is the default (docs/performance.md, "Spectral evaluation"):
# * on the CPU only: LAPACK's symmetric eigensolver; a GPU eigensolver synchronises with
#   the host and is slower than the iteration there;
# * for the bfloat16 iteration only: there its error is the plain bfloat16 iteration's
#   (the last product's rounding dominates), while in float32 the eigendecomposition's
#   error (~1e-3 on low-rank spectra, against ~1e-6 for the plain float32 iteration)
#   would show;
# * from these shapes on (measured crossovers, one thread; below them the eigensolver costs
#   more than the K products it replaces): aspect n/m >= 3 from m = 128, >= 2 from m = 512.
SPECTRAL_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16,)
SPECTRAL_MIN_SIDE = 128
SPECTRAL_MIN_ASPECT = 3.0
SPECTRAL_WIDE_SIDE = 512
SPECTRAL_WIDE_MIN_ASPECT = 2.0


def prefer_spectral(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the spectral evaluation is the default for this shape, dtype and device."""
    m, n = min(rows, cols), max(rows, cols)
    if device.type != "cpu" or dtype not in SPECTRAL_DTYPES or m < SPECTRAL_MIN_SIDE:
        return False
    aspect = SPECTRAL_WIDE_MIN_ASPECT if m >= SPECTRAL_WIDE_SIDE else SPECTRAL_MIN_ASPECT
    return n >= aspect * m


def _wide(G: Tensor, dtype: torch.dtype, eps: float, name: str) -> tuple[Tensor, bool, bool]:
    """``(X, transposed, folded)``: ``G`` in ``dtype`` on its wide orientation; already
    Frobenius-normalised unless ``folded`` (then the caller folds it in)."""
    if G.ndim not in (2, 3):
        raise ValueError(f"{name} expects a 2-D or 3-D tensor, got shape {tuple(G.shape)}")
    transpose = G.size(-2) > G.size(-1)
    X = G.to(dtype)
    if transpose:
        X = X.mT
    if dtype in FOLD_DTYPES:
        return X, transpose, True
    # Norm in fp32 at least: a low-precision sum over millions of squares loses digits.
    norm = torch.linalg.vector_norm(X.float(), dim=(-2, -1), keepdim=True)
    return (X.float() / (norm + eps)).to(dtype), transpose, False


def _mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` as one ``mm``/``bmm`` (``@`` on 3-D tensors dispatches several reshapes)."""
    return torch.mm(a, b) if a.ndim == 2 else torch.bmm(a, b)


def _first_gram(X: Tensor, eps: float, folded: bool) -> tuple[Tensor, Tensor]:
    """``(A₀, inv)``: the Gram matrix of the normalised ``X₀`` and ``1/(||X||_F + eps)``
    (shape ``(..., 1, 1)``, float32 or float64) by which ``X`` is still to be scaled."""
    A = _mm(X, X.mT)
    acc = torch.float64 if X.dtype == torch.float64 else torch.float32
    if not folded:
        return A, torch.ones((*X.shape[:-2], 1, 1), dtype=acc, device=X.device)
    sq = torch.diagonal(A, dim1=-2, dim2=-1).sum(-1, keepdim=True, dtype=acc).unsqueeze(-1)
    inv = sq.sqrt_().add_(eps).reciprocal_()
    # In place: one rounding to A's dtype, as (A * inv²).to(A.dtype) would round.
    return A.mul_(inv.square()), inv


def _coefficient_rows(coefficients: Coefficients, A: Tensor) -> Sequence[Coeff] | Tensor:
    """The coefficients to use: the schedule, or a ``(K, batch, 3)`` / ``(K, 3)`` tensor."""
    batch = A.size(0) if A.ndim == 3 else 1
    if isinstance(coefficients, Tensor):
        C = coefficients
        ok = (C.ndim == 2 and C.size(1) == 3) or (
            C.ndim == 3 and C.size(1) in (1, batch) and C.size(2) == 3
        )
        if not ok or C.size(0) < 1 or not C.is_floating_point():
            raise ValueError(
                f"coefficient tensor must be float (K, 3) or (K, {batch}, 3), got "
                f"{C.dtype} {tuple(C.shape)}"
            )
        return C.to(device=A.device)
    return schedule_tuples(coefficients)


def schedule_tuples(coefficients: Sequence[Sequence[float]]) -> list[Coeff]:
    """A schedule as a list of ``(a, b, c)`` float tuples (at least one), checked."""
    sched: list[Coeff] = []
    for t in coefficients:
        if len(t) != 3:
            raise ValueError(f"each Newton–Schulz step needs (a, b, c), got {t!r}")
        sched.append((float(t[0]), float(t[1]), float(t[2])))
    if not sched:
        raise ValueError("Newton–Schulz needs at least one (a, b, c) step")
    return sched


def _per_step(C: Sequence[Coeff] | Tensor, A: Tensor) -> Sequence[Coeff] | Tensor:
    """Tensor coefficients laid out once as ``(K, 3, batch, 1, 1)`` (``(K, 3, 1)`` for one
    matrix, ``(K, 3)`` for rows shared by the stack) in the accumulation dtype, so that each
    step takes its ``(a, b, c)`` as views."""
    if not isinstance(C, Tensor):
        return C
    C = C.to(torch.float64 if A.dtype == torch.float64 else torch.float32)
    if C.ndim == 2:
        return C
    if A.ndim == 2 and C.size(1) != 1:
        raise ValueError(f"per-matrix coefficients of batch {C.size(1)} for one matrix")
    C = C.permute(0, 2, 1)  # (K, 3, batch)
    return C[..., None, None] if A.ndim == 3 else C


def _step_coeffs(
    C: Sequence[Coeff] | Tensor, k: int
) -> tuple[float | Tensor, float | Tensor, float | Tensor]:
    """Step ``k``'s ``(a, b, c)``: floats, or tensors that broadcast against ``A``."""
    if not isinstance(C, Tensor):
        return C[k]
    a, b, c = C[k].unbind(0)
    return a, b, c


def _poly(A: Tensor, a: float | Tensor, b: float | Tensor, c: float | Tensor) -> Tensor:
    """``a I + b A + c A²`` (an ``m x m`` matrix per stack entry)."""
    if isinstance(a, float) and isinstance(b, float) and isinstance(c, float):
        mm = torch.addmm if A.ndim == 2 else torch.baddbmm
        Z = mm(A, A, A, beta=b, alpha=c)
        Z.diagonal(dim1=-2, dim2=-1).add_(a)
        return Z
    assert isinstance(a, Tensor) and isinstance(b, Tensor) and isinstance(c, Tensor)
    # Small-matrix arithmetic in (at least) float32, cast back for the big matmul.
    acc = torch.float64 if A.dtype == torch.float64 else torch.float32
    Z = torch.addcmul(A.to(acc) * b, _mm(A, A).to(acc), c)
    Z.diagonal(dim1=-2, dim2=-1).add_(a.squeeze(-1))
    return Z.to(A.dtype)


def newton_schulz(
    G: Tensor,
    coefficients: Coefficients,
    *,
    dtype: torch.dtype = torch.float32,
    eps: float = NORM_EPS,
) -> Tensor:
    """Apply the quintic iterations of ``coefficients`` to ``G`` (``(m, n)`` or ``(B, m, n)``).

    Each matrix in a batch is normalised by its own Frobenius norm. Returns a tensor of
    ``dtype`` with ``G``'s shape.
    """
    X, transpose, folded = _wide(G, dtype, eps, "newton_schulz")
    A, inv = _first_gram(X, eps, folded)
    C = _per_step(_coefficient_rows(coefficients, A), A)
    mm = torch.addmm if X.ndim == 2 else torch.baddbmm
    for k in range(len(C)):
        if k > 0:
            A = _mm(X, X.mT)
        a, b, c = _step_coeffs(C, k)
        if k > 0 and not isinstance(a, Tensor) and not isinstance(b, Tensor):
            # Python scalars fold into the matmuls (one launch each):
            #   B = b A + c A A,   X = a X + B X
            B = mm(A, A, A, beta=b, alpha=float(c))
            X = mm(X, B, X, beta=a)
        else:
            # X_{k+1} = (a I + b A + c A²) X_k; at k = 0 the normalisation 1/||G|| rides
            # on the small matrix instead of a pass over G.
            Z = _poly(A, a, b, c)
            if k == 0 and folded:
                Z = Z.mul_(inv) if Z.dtype == inv.dtype else (Z * inv).to(X.dtype)
            X = _mm(Z, X)
    if transpose:
        X = X.mT
    return X.contiguous()


def gram_newton_schulz(
    G: Tensor,
    coefficients: Coefficients,
    *,
    dtype: torch.dtype = torch.float32,
    eps: float = NORM_EPS,
) -> Tensor:
    """The same iteration as :func:`newton_schulz`, run on the ``m x m`` Gram matrix.

    ``X_K = Q_K X₀`` with ``Q_{k+1} = Z_k Q_k``, ``A_{k+1} = Z_k A_k Z_k``,
    ``Z_k = a_k I + b_k A_k + c_k A_k²`` (all polynomials in ``A₀``, so they commute).
    Equal to the plain iteration in exact arithmetic; see docs/performance.md for its
    measured accuracy per dtype and spectrum family.
    """
    X, transpose, folded = _wide(G, dtype, eps, "gram_newton_schulz")
    # The m x m recursion runs in float32 at least: rounding A₀ to bfloat16 turns tiny
    # eigenvalues negative, and Z A Z then amplifies them every step (measured: errors
    # of 1e1-1e6 on low-rank spectra; docs/performance.md). Only the two big products
    # (A₀ from X₀ and Q_K X₀) see X₀'s own dtype.
    acc = torch.float64 if X.dtype == torch.float64 else torch.float32
    A, inv = _first_gram(X.to(acc), eps, folded)
    C = _per_step(_coefficient_rows(coefficients, A), A)
    K = len(C)
    Q: Tensor | None = None
    for k in range(K):
        a, b, c = _step_coeffs(C, k)
        Z = _poly(A, a, b, c)
        Q = Z if Q is None else _mm(Z, Q)
        if k < K - 1:
            A = _mm(_mm(Z, A), Z)
    assert Q is not None
    if folded:
        Q = Q.mul_(inv)
    X = _mm(Q.to(X.dtype), X)
    if transpose:
        X = X.mT
    return X.contiguous()


def _spectral_gain(lam: Tensor, C: Sequence[Coeff] | Tensor) -> Tensor:
    """``g(λ) = σ_K / σ₀`` for every eigenvalue ``λ = σ₀²`` of the normalised Gram matrix
    (``lam``: ``(m,)`` or ``(batch, m)``, float64): the product of the per-step factors
    ``p_k = a_k + b_k σ_k² + c_k σ_k⁴`` along ``σ²_{k+1} = σ_k² p_k²``."""
    s = lam.clamp_min(0.0)  # rounding can leave the smallest eigenvalues slightly negative
    g = torch.ones_like(s)
    K = C.size(0) if isinstance(C, Tensor) else len(C)
    for k in range(K):
        if isinstance(C, Tensor):
            row = C[k].to(torch.float64)  # (3,) shared, or (batch, 3) per matrix
            a, b, c = (row[..., i, None] if row.ndim == 2 else row[i] for i in range(3))
            if lam.ndim == 1 and row.ndim == 2:
                a, b, c = a[0], b[0], c[0]
            p = a + s * (b + c * s)
        else:
            ak, bk, ck = C[k]
            p = ak + s * (bk + ck * s)
        g = g * p
        s = s * p * p
    return g


def spectral_newton_schulz(
    G: Tensor,
    coefficients: Coefficients,
    *,
    dtype: torch.dtype = torch.float32,
    eps: float = NORM_EPS,
) -> Tensor:
    """The same K steps as :func:`newton_schulz`, evaluated in the eigenbasis of ``A₀``.

    ``X_K = V g(Λ) Vᵀ X₀`` (module docstring). ``A₀``, the eigendecomposition and ``g`` run
    in float32 at least (float64 for float64), from ``G``'s own values; only the last
    product ``Q X₀`` runs in ``dtype``. Equal to the plain iteration in exact arithmetic;
    its accuracy against the exact polar factor is at least the plain iteration's in the
    same dtype (tests/test_gram.py). If the eigensolver fails (it raises on a matrix it
    cannot diagonalise, e.g. one with non-finite entries) the plain iteration runs instead.
    """
    X, transpose, folded = _wide(G, dtype, eps, "spectral_newton_schulz")
    acc = torch.float64 if X.dtype == torch.float64 else torch.float32
    if folded:
        # A₀ from G's own values (no rounding to a low-precision dtype first).
        Xa = G.to(acc)
        Xa = Xa.mT if transpose else Xa
    else:
        Xa = X.to(acc)
    A, inv = _first_gram(Xa, eps, folded)
    C = _coefficient_rows(coefficients, A)
    try:
        lam, V = torch.linalg.eigh(A)
    except torch.linalg.LinAlgError:  # type: ignore[attr-defined]
        return newton_schulz(G, coefficients, dtype=dtype, eps=eps)
    g = _spectral_gain(lam.to(torch.float64), C).to(acc)
    Q = _mm(V * g.unsqueeze(-2), V.mT)
    if folded:
        Q = Q.mul_(inv)
    X = _mm(Q.to(X.dtype), X)
    if transpose:
        X = X.mT
    return X.contiguous()
