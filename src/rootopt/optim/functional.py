"""ROOT numerics as pure tensor functions.

Notation follows the paper (arXiv 2511.20626) and the official example code:

    buf  = mu * buf + g                          sum-form momentum
    v    = g + mu * buf  (nesterov)  else buf
    eps  = quantile(|v|, q) + 1e-9               per matrix, every step
    B    = clamp(v, -eps, eps)                   = v - O, O = sign(v) relu(|v| - eps)
    U    = NS_K(B)                               orthogonalized on the wide orientation
    p    = p (1 - lr wd) - lr * s(rows, cols) * U

Everything here is tensor-in / tensor-out; the :class:`rootopt.ROOT` class only manages
state and calls these. :func:`root_update_` is the whole update for one parameter, one
matrix at a time (the reference every fast path is tested against).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from rootopt.ortho import (
    Coefficients,
    Selector,
    gram_newton_schulz,
    newton_schulz,
    prefer_gram,
    qr_direction,
    svd_polar,
)

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
    return _interpolate(v_lo, _next_above(x, v_lo, lo + 1), frac)


def _next_above(x: Tensor, v: Tensor, k: int) -> Tensor:
    """Per row, the order statistic after ``v`` when ``v`` is the ``k``-th smallest: ``v``
    itself when more than ``k`` entries are ``<= v`` (ties), otherwise the smallest entry
    strictly above ``v``."""
    at_or_below = x <= v
    above = x.masked_fill(at_or_below, math.inf).amin(dim=-1, keepdim=True)
    return torch.where(at_or_below.sum(dim=-1, keepdim=True) > k, v, above)


def _bracket(x: Tensor, lo: int) -> tuple[Tensor, Tensor]:
    """Per row of ``|x|`` (``x``: ``(R, N)``), two values ``a <= s_lo`` and ``b >= s_hi`` that hold
    the wanted order statistics with high probability: order statistics of a fixed
    random sample (the same indices for every row, so one gather serves the stack)."""
    n = x.size(-1)
    gen = torch.Generator(device=x.device).manual_seed(0x5EED)
    idx = torch.randint(0, n, (_BRACKET_SAMPLES,), generator=gen, device=x.device)
    sample = x[:, idx].abs().sort(dim=-1).values
    p = lo / max(n - 1, 1)
    # 6 binomial standard deviations of the sample rank, plus slack for ties.
    margin = 6.0 * math.sqrt(_BRACKET_SAMPLES * p * (1 - p)) + 16
    r = p * (_BRACKET_SAMPLES - 1)
    ia = max(0, math.floor(r - margin))
    ib = min(_BRACKET_SAMPLES - 1, math.ceil(r + margin))
    return sample[:, ia : ia + 1], sample[:, ib : ib + 1]


def _quantile_bracket_rows(v: Tensor, lo: int, frac: float) -> Tensor:
    """The order statistics ``lo``/``lo+1`` of ``|v|`` for every row of ``v`` (``(R, N)``,
    float32), interpolated, with one comparison pass over the whole stack and no
    materialised ``|v|``.

    A sampled bracket ``[a, b]`` per row (:func:`_bracket`); one pass over the stack marks
    the side of the bracket that holds the smaller share of the entries (``|v| >= a`` for
    upper quantiles, about ``(1 - q) N`` per row), a compaction per row gathers them, and
    the few percent inside ``[a, b]`` give the order statistics by ``kthvalue`` on that
    small set, exactly. Each row's bracket is checked (never assumed); rows whose bracket
    missed, or holds a large share of the row (heavy ties, e.g. an all-zero gradient),
    are recomputed by the plain selection. Sizes are read on the host, so this path is
    used on the CPU only.
    """
    R, n = v.shape
    hi = lo + 1 if (frac > 0.0 and lo + 1 < n) else lo
    a, b = _bracket(v, lo)
    upper = 2 * lo >= n
    side = (v >= a) | (v <= -a) if upper else (v <= b) & (v >= -b)
    out = torch.empty((R, 1), dtype=torch.float32, device=v.device)
    for r in range(R):
        seg = torch.masked_select(v[r], side[r]).abs_()
        if upper:
            below = n - seg.numel()
            inside = seg[seg <= b[r, 0]]
        else:
            low = seg < a[r, 0]
            below = int(low.sum())
            inside = seg[~low]
        m = inside.numel()
        if not (below <= lo and below + m > hi) or m > n // 8:
            out[r] = _quantile_select(v[r : r + 1].abs(), lo, frac)[0]
            continue
        v_lo = torch.kthvalue(inside, lo - below + 1).values
        v_hi = v_lo if hi == lo else torch.kthvalue(inside, hi - below + 1).values
        out[r, 0] = _interpolate(v_lo, v_hi, frac)
    return out


def quantile_topk_rows(v: Tensor, lo: int, frac: float) -> Tensor:
    """The order statistics ``lo`` (and ``lo+1``) of ``|v|`` per row of ``v`` (``(R, N)``,
    float32), interpolated by ``frac``, from one ``topk`` per row: the ``N - lo`` largest
    values for an upper quantile (their smallest is statistic ``lo``), the ``lo + 2``
    smallest for a lower one. Exact, no host synchronisation.

    On CUDA this replaces ``kthvalue``, which works through a row of millions of entries
    with one thread block: for four 2048×8192 matrices on an H200, kthvalue took 260 ms
    and this 1.3 ms (``benchmarks/bench_quantile.py``, docs/performance.md).
    """
    a = v.abs()
    n = a.size(-1)
    hi = lo + 1 if (frac > 0.0 and lo + 1 < n) else lo
    # Unsorted topk: the two order statistics are the extreme and the next value of the
    # selected set (a masked reduction over its k entries, ties checked), which is
    # cheaper than sorting k ~ (1 - q) N values.
    if 2 * lo >= n:
        t = a.topk(n - lo, dim=-1, largest=True, sorted=False).values  # s_lo .. s_{n-1}
        v_lo = t.amin(dim=-1, keepdim=True)
        if hi == lo:
            return v_lo
        v_hi = _next_above(t, v_lo, 1)
    else:
        t = a.topk(hi + 1, dim=-1, largest=False, sorted=False).values  # s_0 .. s_hi
        v_hi = t.amax(dim=-1, keepdim=True)
        if hi == lo:
            return v_hi
        v_lo = -_next_above(-t, -v_hi, 1)  # the same rule from the other end
    return _interpolate(v_lo, v_hi, frac)


def abs_quantile(M: Tensor, q: float) -> Tensor:
    """Exact ``q``-quantile of ``|M|`` per matrix over the last two dims.

    Same definition as ``torch.quantile(..., interpolation="linear")``: linear
    interpolation between the order statistics at ``floor(q (N-1))`` and the next one,
    but without torch.quantile's 2**24-element limit and without a full sort. Small
    matrices: one ``kthvalue`` selection plus one masked minimum. Large ones on the CPU: a
    sampled bracket, checked, then one selection inside it for the whole stack; on an
    accelerator: one ``topk`` per row (:func:`quantile_topk_rows`), no host
    synchronisation. All give the same result bit for bit (docs/performance.md).
    ``M``: ``(m, n)`` or ``(B, m, n)``; returns float32 of shape ``(1, 1)`` / ``(B, 1, 1)``.
    """
    v = M.detach().float().flatten(-2)  # (..., N); a view for a float32 M
    n = v.size(-1)
    if n == 0:
        raise ValueError("abs_quantile of an empty matrix")
    pos = q * (n - 1)
    lo = min(math.floor(pos), n - 1)
    frac = pos - lo
    if v.device.type == "cpu" and n >= BRACKET_MIN_ENTRIES:
        out = _quantile_bracket_rows(v.reshape(-1, n), lo, frac).reshape(*v.shape[:-1], 1)
    elif v.device.type != "cpu" and n >= BRACKET_MIN_ENTRIES:
        out = quantile_topk_rows(v.reshape(-1, n), lo, frac).reshape(*v.shape[:-1], 1)
    else:
        out = _quantile_select(v.abs(), lo, frac)
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
    # One pass: clamp takes per-matrix tensor bounds.
    B = torch.clamp(M, -eps, eps)
    return B, eps


def clip_outliers_(M: Tensor, q: float | None, *, out: Tensor) -> tuple[Tensor, Tensor | None]:
    """:func:`clip_outliers` writing ``B`` into ``out`` (which may be ``M`` itself: then
    the clamp is in place and no new matrix is allocated). Returns ``(out, eps)``."""
    if q is None:
        if out is not M:
            out.copy_(M)
        return out, None
    eps = abs_quantile(M, q) + THRESHOLD_EPS
    torch.clamp(M, -eps, eps, out=out)
    return out, eps


# ---------------------------------------------------------------------------------------
# orthogonalization and robust scaling
# ---------------------------------------------------------------------------------------
def orthogonal_direction(
    B: Tensor,
    schedule: Coefficients,
    *,
    method: OrthoMethod,
    dtype: torch.dtype,
    gram: bool | None = None,
    select: Selector | None = None,
) -> Tensor:
    """U for a matrix or a stack of matrices; returned as float32.

    ``schedule``: K ``(a, b, c)`` tuples or a ``(K, 3)`` / ``(K, batch, 3)`` tensor;
    ``select`` picks per-matrix coefficients from statistics of ``X₀X₀ᵀ`` (see
    :mod:`rootopt.ortho.newton_schulz`). ``gram``: Newton–Schulz in Gram space
    (``None``: :func:`rootopt.ortho.prefer_gram` decides by shape and dtype).
    """
    if method == "newton_schulz":
        if gram is None:
            gram = prefer_gram(B.size(-2), B.size(-1), dtype)
        ns = gram_newton_schulz if gram else newton_schulz
        U = ns(B, schedule, dtype=dtype, select=select)
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
    """Per-element robust scaling (an option beyond the paper; docs/performance.md,
    "One reference, several fast paths"), made norm-preserving.

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
# the whole update, one parameter at a time (the reference)
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RootTrace:
    """What one :func:`root_update_` computed, for telemetry (``(batch, rows, cols)``)."""

    M: Tensor  # the vector that was thresholded (Nesterov vector or momentum)
    B: Tensor  # its soft-threshold residual
    eps: Tensor | None  # per-matrix threshold, (batch, 1, 1); None without suppression
    U: Tensor  # the orthogonal direction (after robust scaling, if on)
    step: Tensor  # the applied orthogonal step lr * s(rows, cols) * U, shaped like param


def root_update_(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor,
    *,
    step: int,
    lr: float,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
    coefficients: Coefficients,
    outlier_quantile: float | None,
    ortho_method: OrthoMethod = "newton_schulz",
    ns_dtype: torch.dtype = torch.float32,
    gram: bool | None = None,
    select: Selector | None = None,
    lr_scale: LrScale = "moonlight",
    transposed: bool = False,
    nd_view: NDView = "auto",
    robust_mean: Tensor | None = None,
    robust_sq: Tensor | None = None,
    robust_window: int = 100,
    robust_lambda: float = 0.1,
) -> RootTrace:
    """One ROOT step for one parameter, in place on ``param``, ``momentum_buffer`` (and the
    robust statistics), one matrix at a time — the readable ground truth.

    ``step`` is this step's count (1 on the first step). Follows the paper's official
    code (arXiv 2511.20626; reference numerics in docs/performance.md):

    1. momentum (sum form): ``buf = mu buf + g``; ``v = g + mu buf`` (Nesterov) or ``buf``;
    2. threshold, per matrix: ``eps = quantile(|v|, q) + 1e-9``, ``B = clamp(v, -eps, eps)``;
    3. orthogonalize, per matrix: ``U = NS_K(B)`` (or SVD / QR);
    4. decoupled decay with the unscaled lr: ``p = p (1 - lr wd)``;
    5. scaled step: ``p = p - lr s(rows, cols) U``.

    With ``robust_mean``/``robust_sq`` (the optional per-element scaling,
    :func:`robust_scale`) their EMAs are updated in step 1 and ``U`` is rescaled before
    step 4. ``transposed``: the weight is stored ``(in, out)`` (``transformers``
    ``Conv1D``), so ``s`` takes rows = the view's second dimension. State has the higher of
    float32 and the parameter's dtype; a low-precision parameter is updated in float32 and
    written back.
    """
    g = grad.to(momentum_buffer.dtype)
    # 1. momentum
    momentum_buffer.mul_(momentum).add_(g)
    v = g.add(momentum_buffer, alpha=momentum) if nesterov else momentum_buffer
    robust = robust_mean is not None and robust_sq is not None
    beta = 1.0 - 1.0 / robust_window
    if robust_mean is not None and robust_sq is not None:
        robust_mean.lerp_(g, 1 - beta)
        robust_sq.mul_(beta).addcmul_(g, g, value=1 - beta)
    # 2-3. threshold and orthogonalize each matrix of the parameter's view
    view = matrix_view(param.shape, nd_view)
    M = v.reshape(view.batch, view.rows, view.cols)
    Bs, Us, epss = [], [], []
    for i in range(view.batch):
        B_i, eps_i = clip_outliers(M[i], outlier_quantile)
        U_i = orthogonal_direction(
            B_i, coefficients, method=ortho_method, dtype=ns_dtype, gram=gram, select=select
        )
        Bs.append(B_i)
        Us.append(U_i)
        if eps_i is not None:
            epss.append(eps_i)
    U = torch.stack(Us)
    if robust:
        assert robust_mean is not None and robust_sq is not None
        U = robust_scale(
            U,
            robust_mean.reshape(U.shape),
            robust_sq.reshape(U.shape),
            bias_correction=1.0 - beta**step,
            lam=robust_lambda,
        )
    # 4-5. decoupled decay, then the scaled orthogonal step
    rows, cols = (view.cols, view.rows) if transposed else (view.rows, view.cols)
    update = U.reshape(param.shape).mul(lr * lr_scale_factor(rows, cols, lr_scale))
    p32 = param if param.dtype in (torch.float32, torch.float64) else param.float()
    p32.mul_(1 - lr * weight_decay)
    p32.sub_(update)
    if p32 is not param:
        param.copy_(p32)
    eps = torch.stack(epss) if epss else None
    return RootTrace(M, torch.stack(Bs), eps, U, update)


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

    State has the higher of float32 and the parameter's dtype; a low-precision parameter
    is updated in float32 and written back. The formula and operation order are torch.optim.AdamW's.
    """
    beta1, beta2 = betas
    p32 = param if param.dtype in (torch.float32, torch.float64) else param.float()
    g = grad.to(exp_avg.dtype)
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
