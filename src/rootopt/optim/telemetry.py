"""Per-matrix diagnostics of a ROOT step (opt-in: ``ROOT(telemetry=True)``, or set
``opt.telemetry_enabled`` on the steps you log).

The step hands over, per parameter (or fused block), the vector it thresholded (``M``, before
the clip) and the direction it applied (``U``); everything else is derived here, after the
update, so the step itself computes nothing extra for telemetry but a copy of ``M``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from rootopt.optim.quantile import abs_quantile

THRESHOLD_EPS = 1e-9  # as the step's threshold (official code)


def matrix_telemetry(
    M: Tensor,
    U: Tensor,
    *,
    quantile: float | None,
    update: Tensor,
    param: Tensor,
    spectra: bool,
) -> dict[str, Any]:
    """Diagnostics of one ROOT update (``M``, ``U`` as ``(batch, rows, cols)``).

    eps: threshold (mean over a stack); clip_fraction: share of entries with ``|M| > eps``;
    outlier_energy: ``||O||_F / ||M||_F``; ortho_residual: ``||W Wᵀ - I||_F / sqrt(r)`` on
    the wide orientation ``W`` of ``U`` (0 = exactly orthogonal); update_rms and
    update_param_ratio ``||Δp||_F / ||p||_F`` of the applied orthogonal step (decay
    excluded); with ``spectra``, the singular values of the normalised clipped ``B``.
    """
    out: dict[str, Any] = {}
    M = M.float()
    if quantile is None:
        B = M
        out.update(eps=float("nan"), clip_fraction=0.0, outlier_energy=0.0)
    else:
        eps = abs_quantile(M, quantile) + THRESHOLD_EPS
        B = torch.clamp(M, -eps, eps)
        out["eps"] = float(eps.mean())
        out["clip_fraction"] = float((M.abs() > eps).float().mean())
        out["outlier_energy"] = float((M - B).norm() / M.norm().clamp_min(1e-30))
    W = U.float() if U.size(-2) <= U.size(-1) else U.float().mT
    r = W.size(-2)
    eye = torch.eye(r, dtype=W.dtype, device=W.device)
    resid = (W @ W.mT - eye).norm(dim=(-2, -1)) / math.sqrt(r)
    out["ortho_residual"] = float(resid.mean())
    out["update_rms"] = float(update.float().pow(2).mean().sqrt())
    out["update_param_ratio"] = float(update.float().norm() / param.float().norm().clamp_min(1e-30))
    if spectra:
        Bn = B / B.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-30)
        out["singular_values"] = torch.linalg.svdvals(Bn.double()).float().cpu()
    return out
