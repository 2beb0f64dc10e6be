"""Per-matrix diagnostics of a ROOT step (opt-in: ``ROOT(telemetry=True)``, or set
``opt.telemetry_enabled`` on the steps you log).

The step hands over, per parameter (or fused block), the vector it thresholded (``M``, before
the clip), the thresholds it clipped at (``eps``, from
:func:`rootopt.optim.functional.outlier_threshold`: reported as the step used them, never
recomputed) and the direction it applied (``U``); everything else is derived here, after the
update, so the step itself computes nothing extra for telemetry but a copy of ``M``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


def matrix_telemetry(
    M: Tensor,
    U: Tensor,
    *,
    eps: Tensor | None,
    update: Tensor,
    param: Tensor,
    spectra: bool,
) -> dict[str, Any]:
    """Diagnostics of one ROOT update (``M``, ``U`` as ``(batch, rows, cols)``; ``eps``: the
    step's thresholds, ``(batch, 1, 1)``, or None where it did not clip).

    eps: the threshold (mean over a stack); clip_fraction: share of entries with ``|M| > eps``;
    outlier_energy: ``||O||_F / ||M||_F``; ortho_residual: ``||W Wᵀ - I||_F / sqrt(r)`` on
    the wide orientation ``W`` of ``U`` (0 = exactly orthogonal); update_rms and
    update_param_ratio ``||Δp||_F / ||p||_F`` of the applied orthogonal step (decay
    excluded); with ``spectra``, the singular values of the normalised clipped ``B``.
    """
    out: dict[str, Any] = {}
    # the dtype the step clipped in (its state's: float32 or float64)
    M = M if M.dtype in (torch.float32, torch.float64) else M.float()
    if eps is None:
        B = M
        out.update(eps=float("nan"), clip_fraction=0.0, outlier_energy=0.0)
    else:
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


class Recorder:
    """Collects what one step hands over per matrix (``record``) and turns it into
    :func:`matrix_telemetry` per parameter, or per block of a fused weight
    (``name[start:end]``)."""

    def __init__(self) -> None:
        self.pieces: dict[tuple[int, Any], list[tuple[Tensor, Tensor | None, Tensor, float]]] = {}

    def record(self, i: int, m: Any, M: Tensor, eps: Tensor | None, U: Tensor) -> None:
        self.pieces.setdefault((i, m.block), []).append((M, eps, U, m.scale))

    def at(self, i: int) -> Any:
        """``record`` for the reference path, which numbers its one parameter 0."""
        return lambda _, m, M, eps, U: self.record(i, m, M, eps, U)

    def finish(
        self, names: list[str], params: list[Tensor], *, lr: float, spectra: bool
    ) -> dict[str, dict[str, Any]]:
        out = {}
        for (i, block), got in self.pieces.items():
            name = names[i] if block is None else f"{names[i]}[{block[1]}:{block[1] + block[2]}]"
            M, U = torch.cat([x[0] for x in got]), torch.cat([x[2] for x in got])
            thresholds = [x[1] for x in got if x[1] is not None]
            eps = torch.cat(thresholds) if thresholds else None  # one group: all or none
            out[name] = matrix_telemetry(
                M, U, eps=eps, update=U * (lr * got[0][3]), param=params[i], spectra=spectra
            )
        return out
