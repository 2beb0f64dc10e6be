"""Newton–Schulz orthogonalization (2-D and batched 3-D).

For ``G = U S Vᵀ`` the iteration drives every singular value of ``X = G / ||G||_F``
towards 1 while keeping ``U`` and ``V``: ``A = X Xᵀ; X <- a X + (b A + c A²) X``.
It runs on the wide orientation (rows <= cols) so the Gram matrix is the small one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from rootopt.coeffs import Coeff

# Frobenius-normalisation guard, as the official ROOT code: X / (||X||_F + eps).
NORM_EPS = 1e-7


def newton_schulz(
    G: Tensor,
    schedule: Sequence[Coeff],
    *,
    dtype: torch.dtype = torch.float32,
    eps: float = NORM_EPS,
) -> Tensor:
    """Apply the quintic iterations of ``schedule`` to ``G`` (shape ``(m, n)`` or ``(B, m, n)``).

    Each matrix in a batch is normalised by its own Frobenius norm. Returns a tensor of
    ``dtype`` with ``G``'s shape.
    """
    if G.ndim not in (2, 3):
        raise ValueError(f"newton_schulz expects a 2-D or 3-D tensor, got shape {tuple(G.shape)}")
    transpose = G.size(-2) > G.size(-1)
    X = G.to(dtype)
    if transpose:
        X = X.mT
    # Norm in fp32 at least: a bf16 sum over millions of squares loses digits.
    norm = X.float().square().sum(dim=(-2, -1), keepdim=True).sqrt()
    X = (X.float() / (norm + eps)).to(dtype)
    # addmm/baddbmm fold the scalar combinations into the matmuls:
    #   B = b A + c A A,   X = a X + B X
    mm = torch.addmm if X.ndim == 2 else torch.baddbmm
    for a, b, c in schedule:
        A = X @ X.mT
        B = mm(A, A, A, beta=b, alpha=c)
        X = mm(X, B, X, beta=a)
    if transpose:
        X = X.mT
    return X.contiguous()
