"""The exact per-matrix quantile of ``|v|`` behind ROOT's outlier threshold.

Same definition as ``torch.quantile(..., interpolation="linear")`` (linear interpolation
between the order statistics at ``floor(q (N-1))`` and the next), without its 2**24-element
limit and without a full sort. Three ways to the same bits (docs/performance.md, "The exact
threshold"): a plain selection (``kthvalue`` + a masked minimum) for small matrices, a checked
sampled bracket on the CPU, and one unsorted ``topk`` per row on accelerators and in traced
(compiled) steps, which has no host synchronisation.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# Below this many entries per matrix the plain selection is already cheap.
BRACKET_MIN_ENTRIES = 1 << 16
# 16384 samples and 5 binomial standard deviations: about 2.5 % of a row falls inside the
# bracket at q = 0.9 (compacting it is the costliest part); a row outside it (p ~ 6e-7)
# falls back to the plain selection.
_BRACKET_SAMPLES = 16384


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
    sample = x[:, idx].abs()
    p = lo / max(n - 1, 1)
    # 5 binomial standard deviations of the sample rank, plus slack for ties.
    margin = 5.0 * math.sqrt(_BRACKET_SAMPLES * p * (1 - p)) + 16
    r = p * (_BRACKET_SAMPLES - 1)
    ia = max(0, math.floor(r - margin))
    ib = min(_BRACKET_SAMPLES - 1, math.ceil(r + margin))
    # two selections, not a sort of the sample
    a = torch.kthvalue(sample, ia + 1, dim=-1, keepdim=True).values
    return a, torch.kthvalue(sample, ib + 1, dim=-1, keepdim=True).values


def _quantile_bracket_rows(v: Tensor, lo: int, frac: float) -> Tensor:
    """The order statistics ``lo``/``lo+1`` of ``|v|`` for every row of ``v`` (``(R, N)``,
    float32), interpolated, from a sampled bracket and a compaction of the few percent of
    each row that fall inside it.

    A sampled bracket ``[a, b]`` per row (:func:`_bracket`). Per row: ``|v|`` once, the
    count below ``a`` (a count, not a compaction), and the entries inside ``[a, b]``,
    whose ``kthvalue`` gives the order statistics exactly. Each row's bracket is checked
    (never assumed); rows whose bracket missed, or holds a large share of the row (heavy
    ties, e.g. an all-zero gradient), are recomputed by the plain selection. Bounds are
    compared as Python numbers (scalar comparisons are several times faster than
    broadcast tensor ones here) and sizes are read on the host, so this path is used on
    the CPU only (docs/performance.md, "The exact threshold").
    """
    R, n = v.shape
    hi = lo + 1 if (frac > 0.0 and lo + 1 < n) else lo
    a, b = _bracket(v, lo)
    out = torch.empty((R, 1), dtype=torch.float32, device=v.device)
    for r, (a_r, b_r) in enumerate(zip(a[:, 0].tolist(), b[:, 0].tolist())):
        x = v[r].abs()
        at_least = x >= a_r
        below = n - int(torch.count_nonzero(at_least))
        inside = x[at_least & (x <= b_r)]
        m = inside.numel()
        if not (below <= lo and below + m > hi) or m > n // 8:
            out[r] = _quantile_select(x[None], lo, frac)[0]
            continue
        v_lo = torch.kthvalue(inside, lo - below + 1, keepdim=True).values
        v_hi = v_lo if hi == lo else _next_above(inside, v_lo, lo - below + 1)
        out[r] = _interpolate(v_lo, v_hi, frac)
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
    accelerator (and in a compiled step): one ``topk`` per row (:func:`quantile_topk_rows`),
    no host synchronisation. All give the same result bit for bit (docs/performance.md).
    ``M``: ``(m, n)`` or ``(B, m, n)``; returns float32 of shape ``(1, 1)`` / ``(B, 1, 1)``.
    """
    v = M.detach().float().flatten(-2)  # (..., N); a view for a float32 M
    n = v.size(-1)
    if n == 0:
        raise ValueError("abs_quantile of an empty matrix")
    pos = q * (n - 1)
    lo = min(math.floor(pos), n - 1)
    frac = pos - lo
    # The CPU bracket reads sizes on the host: not inside a traced (compiled) step.
    bracket = v.device.type == "cpu" and not torch.compiler.is_compiling()
    if bracket and n >= BRACKET_MIN_ENTRIES:
        out = _quantile_bracket_rows(v.reshape(-1, n), lo, frac).reshape(*v.shape[:-1], 1)
    elif n >= BRACKET_MIN_ENTRIES:
        out = quantile_topk_rows(v.reshape(-1, n), lo, frac).reshape(*v.shape[:-1], 1)
    else:
        out = _quantile_select(v.abs(), lo, frac)
    return out.unsqueeze(-1)
