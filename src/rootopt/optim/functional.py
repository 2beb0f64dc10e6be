"""ROOT numerics as pure tensor functions.

Notation follows the paper (arXiv 2511.20626) and the official example code:

    buf  = mu * buf + g                          sum-form momentum
    v    = g + mu * buf  (nesterov)  else buf
    eps  = quantile(|v|, q) + 1e-9               per matrix, every step
    B    = clamp(v, -eps, eps)                   = v - O, O = sign(v) relu(|v| - eps)
    U    = NS_K(B)                               orthogonalized on the wide orientation
    p    = p (1 - lr wd) - lr * s(rows, cols) * U

Everything here is tensor-in / tensor-out; the :class:`rootopt.ROOT` class only manages
state and calls these.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from rootopt.coeffs import Coeff
from rootopt.ortho import newton_schulz, qr_direction, svd_polar

# Added to the quantile so that an all-zero matrix has a positive threshold (official code).
THRESHOLD_EPS = 1e-9

LrScale = Literal["moonlight", "muon", "none"]
NDView = Literal["auto", "flatten", "batch"]
OrthoMethod = Literal["newton_schulz", "svd", "qr"]


# ---------------------------------------------------------------------------------------
# shapes
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MatrixView:
    """How an N-D parameter is seen as ``batch`` matrices of ``rows x cols``."""

    batch: int
    rows: int
    cols: int


def matrix_view(shape: Sequence[int], nd_view: NDView = "auto") -> MatrixView:
    """2-D: itself. 3-D with ``auto``/``batch``: a stack (experts, heads). Otherwise
    (conv weights, ``flatten``): ``(out, prod(rest))``."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise ValueError(f"ROOT needs a tensor with >= 2 dims, got shape {shape}")
    if len(shape) == 2:
        return MatrixView(1, shape[0], shape[1])
    if nd_view == "batch" or (nd_view == "auto" and len(shape) == 3):
        return MatrixView(math.prod(shape[:-2]), shape[-2], shape[-1])
    return MatrixView(1, shape[0], math.prod(shape[1:]))


def lr_scale_factor(rows: int, cols: int, mode: LrScale) -> float:
    """Shape-dependent multiplier of the orthogonal update.

    ``moonlight``: 0.2·sqrt(max(rows, cols)) matches AdamW's update RMS (Moonlight,
    arXiv 2502.16982; the official ROOT code). ``muon``: sqrt(max(1, rows/cols)) (Keller
    Jordan's Muon). ``none``: 1.
    """
    if mode == "moonlight":
        return 0.2 * math.sqrt(max(rows, cols))
    if mode == "muon":
        return math.sqrt(max(1.0, rows / cols))
    if mode == "none":
        return 1.0
    raise ValueError(f"lr_scale={mode!r} is unknown; choose 'moonlight', 'muon' or 'none'")


# ---------------------------------------------------------------------------------------
# outlier suppression
# ---------------------------------------------------------------------------------------
# Below this many entries per matrix the plain selection is already cheap.
BRACKET_MIN_ENTRIES = 1 << 16
_BRACKET_SAMPLES = 8192


def _interpolate(v_lo: Tensor, v_hi: Tensor, frac: float) -> Tensor:
    return v_lo + frac * (v_hi - v_lo)


def _quantile_select(x: Tensor, lo: int, frac: float) -> Tensor:
    """Order statistics ``lo`` (and ``lo+1``) of each row of ``x`` by ``kthvalue``:
    O(N) selection, no sort, no host synchronisation (the reference method)."""
    n = x.size(-1)
    v_lo = torch.kthvalue(x, lo + 1, dim=-1, keepdim=True).values
    if frac == 0.0 or lo + 1 >= n:
        return v_lo
    at_or_below = x <= v_lo
    # s_{lo+1} equals s_lo when more than lo+1 entries are <= s_lo (ties);
    # otherwise it is the smallest entry strictly above s_lo.
    ties = at_or_below.sum(dim=-1, keepdim=True) > lo + 1
    above = x.masked_fill(at_or_below, math.inf).amin(dim=-1, keepdim=True)
    return _interpolate(v_lo, torch.where(ties, v_lo, above), frac)


def _quantile_bracket_row(x: Tensor, lo: int, frac: float) -> Tensor:
    """The same order statistics for one row, by bracketing: a fixed random sample gives
    two values ``a <= s_lo <= s_hi <= b`` with high probability; counting the entries
    below ``a`` and selecting inside ``[a, b]`` (a few percent of the row) is exact. If
    the bracket misses — it is checked, never assumed — fall back to full selection.
    Needs host synchronisation, so it is used on the CPU only."""
    n = x.numel()
    hi = lo + 1 if (frac > 0.0 and lo + 1 < n) else lo
    gen = torch.Generator(device=x.device).manual_seed(0x5EED)
    idx = torch.randint(0, n, (_BRACKET_SAMPLES,), generator=gen, device=x.device)
    sample = x[idx].sort().values
    p = lo / max(n - 1, 1)
    # 6 binomial standard deviations of the sample rank, plus slack for ties.
    margin = 6.0 * math.sqrt(_BRACKET_SAMPLES * p * (1 - p)) + 16
    r = p * (_BRACKET_SAMPLES - 1)
    a = sample[max(0, math.floor(r - margin))]
    b = sample[min(_BRACKET_SAMPLES - 1, math.ceil(r + margin))]
    below = int((x < a).sum())
    inside = x[(x >= a) & (x <= b)]
    # A missed bracket, or one holding a large share of the row (heavy ties, e.g. an
    # all-zero gradient), goes to the plain selection instead.
    if not (below <= lo and below + inside.numel() > hi) or inside.numel() > n // 8:
        return _quantile_select(x.unsqueeze(0), lo, frac).squeeze(0)
    vals = inside.sort().values
    v_lo = vals[lo - below]
    return _interpolate(v_lo, vals[hi - below], frac).reshape(1)


def abs_quantile(M: Tensor, q: float) -> Tensor:
    """Exact ``q``-quantile of ``|M|`` per matrix over the last two dims.

    Same definition as ``torch.quantile(..., interpolation="linear")``: linear
    interpolation between the order statistics at ``floor(q (N-1))`` and the next one,
    but without torch.quantile's 2**24-element limit and without a full sort. On CUDA
    (and for small matrices): one ``kthvalue`` selection plus one masked minimum, no host
    synchronisation. On the CPU for large matrices: a sampled bracket, checked, then a
    selection inside it (about 2x faster than ``kthvalue``; same result bit for bit).
    ``M``: ``(m, n)`` or ``(B, m, n)``; returns float32 of shape ``(1, 1)`` / ``(B, 1, 1)``.
    """
    x = M.detach().abs().float().flatten(-2)  # (..., N)
    n = x.size(-1)
    if n == 0:
        raise ValueError("abs_quantile of an empty matrix")
    pos = q * (n - 1)
    lo = min(math.floor(pos), n - 1)
    frac = pos - lo
    if x.device.type == "cpu" and n >= BRACKET_MIN_ENTRIES:
        rows = x.reshape(-1, n)
        out = torch.stack([_quantile_bracket_row(r, lo, frac) for r in rows])
        out = out.reshape(*x.shape[:-1], 1)
    else:
        out = _quantile_select(x, lo, frac)
    return out.unsqueeze(-1)


def soft_threshold_split(M: Tensor, eps: Tensor) -> tuple[Tensor, Tensor]:
    """Split ``M`` into the kept part ``B = clamp(M, -eps, eps)`` and the outliers
    ``O = sign(M) relu(|M| - eps) = M - B``. ``eps`` broadcasts per matrix."""
    B = torch.minimum(torch.maximum(M, -eps), eps)
    return B, M - B


def clip_outliers(M: Tensor, q: float | None) -> tuple[Tensor, Tensor | None]:
    """``(B, eps)``: the soft-threshold residual of ``M`` at its ``q``-quantile
    (``q=None``: no suppression, ``B = M``)."""
    if q is None:
        return M, None
    eps = abs_quantile(M, q) + THRESHOLD_EPS
    B = torch.minimum(torch.maximum(M, -eps), eps)
    return B, eps


# ---------------------------------------------------------------------------------------
# orthogonalization and robust scaling
# ---------------------------------------------------------------------------------------
def orthogonal_direction(
    B: Tensor,
    schedule: Sequence[Coeff],
    *,
    method: OrthoMethod,
    dtype: torch.dtype,
) -> Tensor:
    """U for a matrix or a stack of matrices; returned as float32."""
    if method == "newton_schulz":
        U = newton_schulz(B, schedule, dtype=dtype)
    elif method == "svd":
        U = svd_polar(B, dtype=torch.float32)
    elif method == "qr":
        U = qr_direction(B, dtype=torch.float32)
    else:
        raise ValueError(f"ortho_method={method!r} is unknown")
    return U.float()


def robust_scale(
    U: Tensor,
    mean: Tensor,
    sq: Tensor,
    *,
    bias_correction: float,
    lam: float,
    eps: float = 1e-8,
) -> Tensor:
    """Seed 002's per-element robust scaling, made norm-preserving.

    ``mean`` / ``sq`` are running (EMA) estimates of E[g] and E[g²] (bias corrected by
    ``bias_correction = 1 - beta^t``), so ``delta = sqrt(E[g²] - E[g]²)``; then
    ``sigma = 1 / (|mu| + lam delta + eps)``. The update becomes
    ``U ⊙ sigma · ||U||_F / ||U ⊙ sigma||_F``: the same Frobenius norm as ``U`` (so the
    lr keeps its meaning), redistributed towards entries whose gradient is small and
    steady relative to its noise; the result is no longer orthogonal.
    """
    mu = mean / bias_correction
    var = (sq / bias_correction - mu * mu).clamp_min(0.0)
    sigma = 1.0 / (mu.abs() + lam * var.sqrt() + eps)
    S = U * sigma.reshape(U.shape)
    dims = (-2, -1)
    ratio = U.norm(dim=dims, keepdim=True) / S.norm(dim=dims, keepdim=True).clamp_min(1e-30)
    scaled: Tensor = S * ratio
    return scaled


# ---------------------------------------------------------------------------------------
# AdamW (for everything that is not a weight matrix)
# ---------------------------------------------------------------------------------------
def adamw_update_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One bias-corrected AdamW step in place (decoupled decay ``p *= 1 - lr wd`` first).

    State is float32; a low-precision parameter is updated in float32 and written back.
    The formula and operation order are torch.optim.AdamW's.
    """
    beta1, beta2 = betas
    p32 = param if param.dtype == torch.float32 else param.float()
    g = grad.float()
    p32.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1**step
    bc2 = 1 - beta2**step
    denom = (exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(eps)
    p32.addcdiv_(exp_avg, denom, value=-lr / bc1)
    if p32 is not param:
        param.copy_(p32)


def adamw_update_foreach_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """:func:`adamw_update_` for many float32 tensors at one step count, with ``_foreach``
    kernels (a handful of launches instead of eight per tensor)."""
    beta1, beta2 = betas
    bc1 = 1 - beta1**step
    bc2 = 1 - beta2**step
    torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, math.sqrt(bc2))
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-lr / bc1)


# ---------------------------------------------------------------------------------------
# telemetry
# ---------------------------------------------------------------------------------------
def matrix_telemetry(
    M: Tensor,
    B: Tensor,
    eps: Tensor | None,
    U: Tensor,
    update: Tensor,
    param: Tensor,
    *,
    spectra: bool,
) -> dict[str, object]:
    """Diagnostics of one ROOT update (``M``, ``B``, ``U`` as ``(batch, rows, cols)``).

    eps: threshold (mean over a stack); clip_fraction: share of entries with
    ``|M| > eps``; outlier_energy: ``||O||_F / ||M||_F``; ortho_residual:
    ``||W Wᵀ - I||_F / sqrt(r)`` on the wide orientation ``W`` of ``U`` (0 = exactly
    orthogonal); update_rms and update_param_ratio ``||Δp||_F / ||p||_F`` of the applied
    orthogonal step (decay excluded).
    """
    out: dict[str, object] = {}
    m_norm = M.norm()
    if eps is None:
        out["eps"] = float("nan")
        out["clip_fraction"] = 0.0
        out["outlier_energy"] = 0.0
    else:
        out["eps"] = float(eps.mean())
        out["clip_fraction"] = float((M.abs() > eps).float().mean())
        out["outlier_energy"] = float((M - B).norm() / m_norm.clamp_min(1e-30))
    W = U if U.size(-2) <= U.size(-1) else U.mT
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
