"""Building blocks of a matrix split over several ranks: the cost model's ``gram`` design
(docs/distributed.md, "Split matrices"), used by
:class:`~rootopt.distributed.DistributedROOT` with ``fsdp_design="gram"`` and priced by
:mod:`rootopt.distributed.plan` with the same geometry (:func:`split_count`,
:func:`slab_bounds`, :func:`slab_pieces`).

A matrix too large for one owner is held as slabs of its long side, one per rank of a
process group. Two steps of ROOT then need the whole matrix, and both work without
gathering it:

* :func:`split_abs_quantile` — the exact ``q``-quantile of ``|M|`` over every slab, the
  same value as :func:`rootopt.optim.quantile.abs_quantile` on the whole matrix, bit for
  bit. It runs a radix selection on the 32-bit keys of ``|m|`` (a non-negative float's bit
  pattern orders like the float): one all-reduced 256-bin histogram per 8-bit digit, then
  one count and one minimum for the neighbouring order statistic that the linear
  interpolation needs.
* :func:`split_newton_schulz` — the plain Newton–Schulz iteration of
  :func:`rootopt.ortho.newton_schulz.newton_schulz` on the wide orientation ``X`` (rows <=
  columns) split by columns. ``A = X Xᵀ`` is the sum of the slabs' ``Xⱼ Xⱼᵀ``, one
  all-reduce of the small rows x rows matrix per iteration; the update
  ``X ← a X + (b A + c A²) X`` is local to each slab. The Frobenius norm is folded in
  through A's trace as the one-process iteration folds it. Equal to the one-process
  iteration up to the order of the sums.

Both are collectives over ``group``: every rank of it calls them in the same order, and a
rank may hold an empty slab.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from rootopt.distributed.group import collective
from rootopt.ortho.newton_schulz import FOLD_DTYPES, NORM_EPS, schedule_tuples

RADIX_BITS = 8
RADIX_BINS = 1 << RADIX_BITS
RADIX_PASSES = 32 // RADIX_BITS  # = plan.QUANTILE_PASSES


# collectives of one split_abs_quantile given the matrix's size: one histogram per pass,
# then one count and one minimum (always run, so every call issues the same collectives)
QUANTILE_COLLECTIVES = RADIX_PASSES + 2
# Called after each collective with (operation, bytes of the tensor): how a caller counts them.
Count = Callable[[str, int], None]


def split_count(numel: int, long_side: int, total: int, world: int, node: int) -> int:
    """How many ranks hold a matrix in the ``gram`` design: 1 unless it is larger than a
    rank's share of all ``total`` parameter elements (``ceil(total / world)``); then
    ``ceil(numel / share)`` of one node's ``node`` ranks, at most one per column of its
    long side."""
    share = max(1, math.ceil(total / max(world, 1)))
    if world <= 1 or numel <= share:
        return 1
    return max(1, min(node, world, math.ceil(numel / share), long_side))


def slab_axis(rows: int, cols: int) -> int:
    """The dimension a ``rows x cols`` matrix is split along: its long side (rows of a
    tall matrix, columns otherwise), so each slab is a block of columns of the wide
    orientation ``X`` (``Mᵀ`` when tall) that the iteration runs on."""
    return 0 if rows > cols else 1


def slab_bounds(rows: int, cols: int, k: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` along the long side of each of the ``k`` slabs, cut like ``torch.chunk``."""
    n = rows if slab_axis(rows, cols) == 0 else cols
    c = -(-n // k) if n else 0
    return [(min(n, j * c), min(n, (j + 1) * c)) for j in range(k)]


def slab_pieces(rows: int, cols: int, shards: Sequence[int], k: int) -> list[list[int]]:
    """``out[j][s]``: elements of slab ``j`` that rank ``s`` holds when the matrix's rows
    are sharded ``shards`` (FSDP2's ``Shard(0)``: consecutive row ranges of these sizes):
    the overlap of its rows with the slab's (tall) or its rows x the slab's columns
    (wide). Every slab is the union of its pieces."""
    axis = slab_axis(rows, cols)
    starts = [sum(shards[:s]) for s in range(len(shards))]
    out = []
    for lo, hi in slab_bounds(rows, cols, k):
        if axis == 0:
            out.append(
                [max(0, min(r0 + n, hi) - max(r0, lo)) * cols for r0, n in zip(starts, shards)]
            )
        else:
            out.append([n * (hi - lo) for n in shards])
    return out


def _all_reduce(
    t: Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None, count: Count | None
) -> Tensor:
    collective("all_reduce split matrix", dist.all_reduce, t, op=op, group=group)
    if count is not None:
        count("all_reduce", t.numel() * t.element_size())
    return t


def _gram_fp32(X: Tensor) -> Tensor:
    """``X Xᵀ`` with float32 accumulation and output: bf16 inputs keep the tensor cores on a
    GPU (``out_dtype``), elsewhere (or where that overload is missing) through float32."""
    if X.dtype == torch.bfloat16 and X.is_cuda:
        try:
            return torch.mm(X, X.mT, out_dtype=torch.float32)  # type: ignore[call-overload]
        except (RuntimeError, TypeError):  # pragma: no cover - depends on the torch build
            pass
    Xa = X.float()
    return torch.mm(Xa, Xa.mT)


def split_abs_quantile(
    local: Tensor,
    q: float,
    group: dist.ProcessGroup | None = None,
    *,
    total: int | None = None,
    count: Count | None = None,
) -> Tensor:
    """The ``q``-quantile of ``|M|`` where ``M``'s entries are the union of every rank's
    ``local`` (any shape, any floating dtype; read as float32, as ``abs_quantile`` reads
    them): linear interpolation between the order statistics at ``floor(q (N - 1))`` and
    the next one. Returns a float32 tensor of shape ``(1, 1)``, the same on every rank
    and the same bits as ``abs_quantile`` of the whole matrix. ``total``: the number of
    entries N when the caller knows it (saves one all-reduce); ``count``: told of every
    collective."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q!r}")
    v = local.detach().float().reshape(-1).abs()
    if bool(torch.isnan(v).any()):
        raise ValueError("split_abs_quantile of a matrix with NaN entries")
    dev = v.device
    keys = v.view(torch.int32)  # non-negative floats: the bit pattern orders like the value
    if total is None:
        count_n = torch.tensor([v.numel()], dtype=torch.int64, device=dev)
        n = int(_all_reduce(count_n, dist.ReduceOp.SUM, group, count).item())
    else:
        n = total
    if n == 0:
        raise ValueError("split_abs_quantile of an empty matrix")
    pos = q * (n - 1)
    lo = min(math.floor(pos), n - 1)
    frac = pos - lo
    # radix selection of the key of rank `lo` (0-based), most significant digit first;
    # each pass keeps only the candidates whose digit matched
    rank, prefix, cand = lo, 0, keys
    for p in range(RADIX_PASSES):
        shift = 32 - RADIX_BITS * (p + 1)
        digits = (cand >> shift) & (RADIX_BINS - 1)
        hist = torch.bincount(digits.long(), minlength=RADIX_BINS)
        cum = torch.cumsum(_all_reduce(hist, dist.ReduceOp.SUM, group, count), 0).tolist()
        d = next(i for i, c in enumerate(cum) if c > rank)
        rank -= cum[d - 1] if d > 0 else 0
        prefix |= d << shift
        cand = cand[digits == d]
    v_lo = torch.tensor([prefix], dtype=torch.int32, device=dev).view(torch.float32)
    # the order statistic after v_lo: v_lo itself when more than lo + 1 entries are <=
    # it (ties), otherwise the smallest entry above it (as quantile._next_above); run
    # even when the interpolation does not need it, so every call issues the same
    # collectives (plan.py counts QUANTILE_COLLECTIVES)
    at_or_below = v <= v_lo
    below = _all_reduce(at_or_below.sum().reshape(1), dist.ReduceOp.SUM, group, count)
    above = torch.full((1,), math.inf, device=dev)
    if v.numel():
        above = v.masked_fill(at_or_below, math.inf).amin().reshape(1)
    above = _all_reduce(above, dist.ReduceOp.MIN, group, count)
    if frac == 0.0 or lo + 1 >= n:
        return v_lo.reshape(1, 1)
    v_hi = v_lo if int(below.item()) > lo + 1 else above
    return (v_lo + frac * (v_hi - v_lo)).reshape(1, 1)


def split_newton_schulz(
    local: Tensor,
    coefficients: Sequence[tuple[float, float, float]],
    *,
    dtype: torch.dtype = torch.float32,
    eps: float = NORM_EPS,
    group: dist.ProcessGroup | None = None,
    count: Count | None = None,
) -> Tensor:
    """The Newton–Schulz iteration of ``coefficients`` on the wide matrix ``X`` (rows <=
    columns in all) whose columns are split over the ranks of ``group``; ``local`` is this
    rank's ``rows x cols_j`` slab (``cols_j`` may be 0). Returns this rank's slab of the
    result, in ``dtype`` (float32, float64 or bfloat16: the dtypes whose one-process
    iteration folds the norm into the Gram matrix). The rows x rows Gram matrix is summed
    in float32 (float64 for float64) across the slabs and rounded to ``dtype`` once, as
    one matrix product would round it. ``count``: told of every collective (one per
    iteration)."""
    if local.ndim != 2:
        raise ValueError(f"split_newton_schulz expects a 2-D slab, got shape {tuple(local.shape)}")
    if dtype not in FOLD_DTYPES:
        raise ValueError(
            f"split_newton_schulz runs in {', '.join(map(str, FOLD_DTYPES))}, got {dtype}"
        )
    sched = schedule_tuples(coefficients)
    X = local.to(dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32

    def gram(X: Tensor) -> Tensor:
        """Σⱼ Xⱼ Xⱼᵀ over the slabs, summed in ``acc``, rounded to ``dtype`` once."""
        A = torch.mm(X, X.mT) if acc == torch.float64 else _gram_fp32(X)
        return _all_reduce(A, dist.ReduceOp.SUM, group, count).to(dtype)

    # as newton_schulz: the norm from A's trace (``_first_gram``), folded into A and into
    # the first polynomial instead of a pass over X
    A = gram(X)
    sq = torch.diagonal(A).sum(dtype=acc)
    inv = sq.sqrt().add_(eps).reciprocal_()
    A = A.mul_(inv.square())
    for k, (a, b, c) in enumerate(sched):
        if k == 0:
            Z = torch.addmm(A, A, A, beta=b, alpha=c)
            Z.diagonal().add_(a)
            Z = Z.mul_(inv) if Z.dtype == inv.dtype else (Z * inv).to(X.dtype)
            X = torch.mm(Z, X)
        else:
            A = gram(X)
            B = torch.addmm(A, A, A, beta=b, alpha=c)
            X = torch.addmm(X, B, X, beta=a)
    return X.contiguous()
