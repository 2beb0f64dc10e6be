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
    coefficients: CoefficientSpec = "adanewton",
    method: Method = "newton_schulz",
    dtype: torch.dtype = torch.float32,
    eps: float = NORM_EPS,
) -> Tensor:
    """Approximately (NS) or exactly (svd) map ``G = U S Vᵀ`` to ``U Vᵀ``.

    ``G`` is 2-D ``(m, n)`` or a batch ``(B, m, n)``. For Newton–Schulz, ``coefficients``
    is resolved for the shape ``(m, n)`` and ``steps`` iterations (see
    :func:`rootopt.coeffs.resolve`); ``dtype`` is the iteration dtype (float32 default,
    bfloat16 for speed on tensor cores). Returns ``dtype``.
    """
    if G.ndim not in (2, 3):
        raise ValueError(f"orthogonalize expects a 2-D or 3-D tensor, got shape {tuple(G.shape)}")
    if G.is_complex():
        raise ValueError("orthogonalize does not support complex tensors")
    if method == "newton_schulz":
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        schedule = resolve(coefficients, G.size(-2), G.size(-1), steps)
        return newton_schulz(G, schedule, dtype=dtype, eps=eps)
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
