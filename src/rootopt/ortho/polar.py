"""Exact orthogonal factors: the polar factor via SVD, and a QR-based direction.

``svd``: ``U Vᵀ`` from the thin SVD, the exact target of Newton–Schulz. ``qr``: the
orthonormal factor ``Q`` of a thin QR, with the signs fixed so that ``diag(R) >= 0``.
``Q`` spans the same column space as ``G`` but, unlike ``U Vᵀ``, depends on column order.
Both are options beyond the paper (docs/performance.md, "One update, every path").
"""

from __future__ import annotations

import torch
from torch import Tensor


def svd_polar(G: Tensor, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """``U Vᵀ`` for ``G = U S Vᵀ`` (2-D or batched); zero singular values map to zero."""
    X = G.to(dtype if dtype in (torch.float32, torch.float64) else torch.float32)
    U, S, Vh = torch.linalg.svd(X, full_matrices=False)
    # Directions with (numerically) zero singular value carry no signal: drop them,
    # so an all-zero input gives a zero update, like Newton–Schulz does.
    tol = S.amax(dim=-1, keepdim=True) * max(X.shape[-2:]) * torch.finfo(X.dtype).eps
    keep = (tol > 0) & (tol < S)
    out = (U * keep.unsqueeze(-2).to(U.dtype)) @ Vh
    result: Tensor = out.to(dtype)
    return result


def qr_direction(G: Tensor, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """Orthonormal QR factor of ``G`` in its own shape (tall: Q; wide: Qᵀ of Gᵀ)."""
    X = G.to(dtype if dtype in (torch.float32, torch.float64) else torch.float32)
    transpose = X.size(-2) < X.size(-1)
    if transpose:
        X = X.mT
    Q, R = torch.linalg.qr(X, mode="reduced")
    d = torch.diagonal(R, dim1=-2, dim2=-1)
    sign = torch.where(d < 0, -1.0, 1.0).to(Q.dtype)
    # Zero columns of R mean rank deficiency; scale those directions to zero.
    sign = torch.where(d == 0, torch.zeros_like(sign), sign)
    Q = Q * sign.unsqueeze(-2)
    if transpose:
        Q = Q.mT
    result: Tensor = Q.contiguous().to(dtype)
    return result
