"""Orthogonalization: Newton–Schulz (any coefficient spec), SVD polar factor, QR direction."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from rootopt.coeffs import CoefficientSpec, canonical, resolve
from rootopt.coeffs.adanewton import lookup
from rootopt.ortho.newton_schulz import (
    GRAM_DTYPES,
    NORM_EPS,
    Coefficients,
    gram_newton_schulz,
    newton_schulz,
    prefer_gram,
    prefer_spectral,
    spectral_newton_schulz,
)
from rootopt.ortho.polar import qr_direction, svd_polar

Method = Literal["newton_schulz", "svd", "qr"]
# How Newton–Schulz runs: None (where measured to pay), False (plain), True (Gram-space
# recursion), "spectral" (eigenbasis of the Gram matrix).
GramMode = bool | Literal["spectral"] | None
METHODS: tuple[str, ...] = ("newton_schulz", "svd", "qr")

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}


def direction(
    B: Tensor,
    schedule: Coefficients,
    *,
    method: Method = "newton_schulz",
    dtype: torch.dtype = torch.float32,
    gram: GramMode = None,
    eps: float = NORM_EPS,
) -> Tensor:
    """The orthogonalization step shared by the optimizer and :func:`orthogonalize`: for
    Newton–Schulz, the iteration with ``schedule``: plain (``gram=False``), in Gram space
    (``True``), evaluated spectrally (``"spectral"``), or where measured to pay
    (``None``: :func:`prefer_spectral`, then :func:`prefer_gram`, by shape, dtype and
    device); else the SVD polar factor or the QR direction. ``B``: ``(m, n)`` or
    ``(batch, m, n)``; returns ``dtype``, ``B``'s shape."""
    if method == "newton_schulz":
        rows, cols = B.size(-2), B.size(-1)
        if gram is None:
            if prefer_spectral(rows, cols, dtype, B.device):
                gram = "spectral"
            else:
                gram = prefer_gram(rows, cols, dtype)
        if gram == "spectral":
            ns = spectral_newton_schulz
        else:
            ns = gram_newton_schulz if gram else newton_schulz
        return ns(B, schedule, dtype=dtype, eps=eps)
    if method == "svd":
        return svd_polar(B, dtype=dtype)
    if method == "qr":
        return qr_direction(B, dtype=dtype)
    raise ValueError(f"method={method!r} is unknown; choose one of {METHODS}")


def orthogonalize(
    G: Tensor,
    *,
    steps: int = 5,
    coefficients: CoefficientSpec | Tensor = "muon",
    method: Method = "newton_schulz",
    dtype: torch.dtype = torch.float32,
    eps: float = NORM_EPS,
    gram: GramMode = None,
) -> Tensor:
    """Approximately (NS) or exactly (svd) map ``G = U S Vᵀ`` to ``U Vᵀ``.

    ``G`` is 2-D ``(m, n)`` or a batch ``(B, m, n)``. For Newton–Schulz, ``coefficients``
    is resolved for the shape ``(m, n)``, ``steps`` iterations and ``dtype`` (see
    :func:`rootopt.coeffs.resolve`), or given as a ``(K, 3)`` / ``(K, B, 3)`` tensor; the
    default is the optimizer's (``"muon"``). ``"adanewton"`` is certified for the iteration dtype as in the optimizer, so the result
    is exactly the direction :class:`rootopt.ROOT` computes for ``G`` with the threshold
    off (``outlier_quantile=None``). ``gram``: run the iteration in Gram space (``True``), spectrally
    (``"spectral"``), plainly (``False``), or where measured to pay and hold (``None``). ``dtype`` is the iteration dtype (float32
    default, bfloat16 for speed). Returns ``dtype``.
    """
    if G.ndim not in (2, 3):
        raise ValueError(f"orthogonalize expects a 2-D or 3-D tensor, got shape {tuple(G.shape)}")
    if G.is_complex():
        raise ValueError("orthogonalize does not support complex tensors")
    if method == "newton_schulz":
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        rows, cols = G.size(-2), G.size(-1)
        coeffs: Coefficients
        if isinstance(coefficients, Tensor):
            coeffs = coefficients
        elif canonical(coefficients) == "adanewton" and dtype in _DTYPE_NAMES:
            coeffs = lookup(rows, cols, steps, dtype=_DTYPE_NAMES[dtype]).schedule
        else:
            coeffs = resolve(coefficients, rows, cols, steps)
    else:
        coeffs = ()
    return direction(G, coeffs, method=method, dtype=dtype, gram=gram, eps=eps)


__all__ = [
    "GRAM_DTYPES",
    "METHODS",
    "NORM_EPS",
    "Coefficients",
    "GramMode",
    "Method",
    "direction",
    "gram_newton_schulz",
    "newton_schulz",
    "orthogonalize",
    "prefer_gram",
    "prefer_spectral",
    "qr_direction",
    "spectral_newton_schulz",
    "svd_polar",
]
