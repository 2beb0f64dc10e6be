"""Orthogonalization: Newton–Schulz (any coefficient spec), SVD polar factor, QR direction."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from rootopt.coeffs import CoefficientSpec, resolve
from rootopt.ortho.newton_schulz import (
    GRAM_DTYPES,
    NORM_EPS,
    Coefficients,
    Selector,
    gram_newton_schulz,
    newton_schulz,
    prefer_gram,
)
from rootopt.ortho.polar import qr_direction, svd_polar

Method = Literal["newton_schulz", "svd", "qr"]
METHODS: tuple[str, ...] = ("newton_schulz", "svd", "qr")


def orthogonalize(
    G: Tensor,
    *,
    steps: int = 5,
    coefficients: CoefficientSpec | Tensor = "adanewton",
    method: Method = "newton_schulz",
    dtype: torch.dtype = torch.float32,
    eps: float = NORM_EPS,
    gram: bool | None = None,
    select: Selector | None = None,
) -> Tensor:
    """Approximately (NS) or exactly (svd) map ``G = U S Vᵀ`` to ``U Vᵀ``.

    ``G`` is 2-D ``(m, n)`` or a batch ``(B, m, n)``. For Newton–Schulz, ``coefficients``
    is resolved for the shape ``(m, n)`` and ``steps`` iterations (see
    :func:`rootopt.coeffs.resolve`), or given as a ``(K, 3)`` / ``(K, B, 3)`` tensor;
    ``select`` chooses per-matrix coefficients from ``||X₀X₀ᵀ||_F²`` (see
    :mod:`rootopt.ortho.newton_schulz`). ``gram``: run the iteration in Gram space
    (``None``: where :func:`prefer_gram` says it pays and holds). ``dtype`` is the
    iteration dtype (float32 default, bfloat16 for speed). Returns ``dtype``.
    """
    if G.ndim not in (2, 3):
        raise ValueError(f"orthogonalize expects a 2-D or 3-D tensor, got shape {tuple(G.shape)}")
    if G.is_complex():
        raise ValueError("orthogonalize does not support complex tensors")
    if method == "newton_schulz":
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        rows, cols = G.size(-2), G.size(-1)
        coeffs = (
            coefficients
            if isinstance(coefficients, Tensor)
            else resolve(coefficients, rows, cols, steps)
        )
        use_gram = prefer_gram(rows, cols, dtype) if gram is None else gram
        ns = gram_newton_schulz if use_gram else newton_schulz
        return ns(G, coeffs, dtype=dtype, eps=eps, select=select)
    if method == "svd":
        return svd_polar(G, dtype=dtype)
    if method == "qr":
        return qr_direction(G, dtype=dtype)
    raise ValueError(f"method={method!r} is unknown; choose one of {METHODS}")


__all__ = [
    "GRAM_DTYPES",
    "METHODS",
    "NORM_EPS",
    "Coefficients",
    "Method",
    "Selector",
    "gram_newton_schulz",
    "newton_schulz",
    "orthogonalize",
    "prefer_gram",
    "qr_direction",
    "svd_polar",
]
