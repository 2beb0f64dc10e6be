"""Exact per-matrix quantile of |M| on this machine's device: the ways torch offers,
timed on buckets of transformer-sized matrices, each checked equal to
``rootopt.optim.quantile.abs_quantile`` (the one ROOT uses).

Methods: ``rootopt`` (abs_quantile as shipped: on an accelerator, ``topk`` per row),
``kthvalue`` (one selection per row), ``sort`` (full sort per row, then two gathers),
``topk`` (the largest ``N - lo`` values per row; the order statistic is the smallest of
them) and ``bisect`` (bisection on the bit patterns of the non-negative floats: counts
only, no sort, no host synchronisation). Prints milliseconds (median of ``--reps``, CUDA events on a GPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from _timing import median_ms, shape_list
from rootopt.optim.quantile import abs_quantile


def by_sort(v: Tensor, lo: int, frac: float) -> Tensor:
    s = v.abs().sort(dim=-1).values
    hi = min(lo + 1, v.size(-1) - 1)
    return s[:, lo] + frac * (s[:, hi] - s[:, lo])


def by_topk(v: Tensor, lo: int, frac: float) -> Tensor:
    n = v.size(-1)
    k = n - lo  # the largest k values hold order statistics lo .. n-1
    t = v.abs().topk(k, dim=-1, largest=True, sorted=True).values
    v_lo = t[:, -1]
    v_hi = t[:, -2] if k >= 2 else v_lo
    return v_lo + frac * (v_hi - v_lo)


def by_bisect(v: Tensor, lo: int, frac: float) -> Tensor:
    """Bisection on the int32 bit patterns of |v| (ordered like the values), one count
    per step, 31 steps; then the next statistic by a masked minimum (ties checked)."""
    a = v.abs()
    bits = a.view(torch.int32)
    lo_b = torch.zeros((a.size(0), 1), dtype=torch.int32, device=a.device)
    hi_b = bits.amax(dim=-1, keepdim=True)
    for _ in range(31):
        mid = lo_b + torch.div(hi_b - lo_b, 2, rounding_mode="floor")
        enough = (bits <= mid).sum(dim=-1, keepdim=True) >= lo + 1
        hi_b = torch.where(enough, mid, hi_b)
        lo_b = torch.where(enough, lo_b, mid + 1)
    v_lo = hi_b.view(torch.float32)
    if frac == 0.0 or lo + 1 >= a.size(-1):
        return v_lo[:, 0]
    below = a <= v_lo
    ties = below.sum(dim=-1, keepdim=True) > lo + 1
    above = a.masked_fill(below, math.inf).amin(dim=-1, keepdim=True)
    return (v_lo + frac * (torch.where(ties, v_lo, above) - v_lo))[:, 0]


def by_kthvalue(v: Tensor, lo: int, frac: float) -> Tensor:
    a = v.abs()
    v_lo = a.kthvalue(lo + 1, dim=-1).values
    v_hi = a.kthvalue(min(lo + 2, v.size(-1)), dim=-1).values
    return v_lo + frac * (v_hi - v_lo)


def _flat_quantile(M: Tensor, q: float) -> Tensor:
    return abs_quantile(M, q).flatten()


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument("--q", type=float, default=0.9)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--shapes", type=shape_list(3), default=None, help="BxMxN,... (default by device)"
    )
    ap.add_argument("--methods", default="rootopt,kthvalue,sort,topk,bisect")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if a.json and os.path.lexists(a.json):
        # checked before the measurements, not after: the file is never overwritten
        ap.error(f"--json {a.json}: the file exists; name a new one")
    known = ("rootopt", "kthvalue", "sort", "topk", "bisect")
    unknown = [m for m in a.methods.split(",") if m not in known]
    if unknown:
        ap.error(f"--methods: unknown {unknown}; choose from {', '.join(known)}")
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if a.device == "auto" else a.device)
    if a.shapes:
        shapes = a.shapes
    elif device.type == "cuda":
        shapes = [(4, 1024, 4096), (4, 2048, 8192), (1, 4096, 14336), (16, 1024, 1024)]
    else:
        shapes = [(4, 256, 1024), (2, 768, 3072)]
    fns = {"kthvalue": by_kthvalue, "sort": by_sort, "topk": by_topk, "bisect": by_bisect}
    rows = []
    print(f"device {device}; torch {torch.__version__}; q = {a.q}")
    for B, m, n in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        M = torch.randn(B, m, n, device=device, generator=g)
        M[:, :, :8] *= 30.0  # a few heavy columns, as in real momentum
        v = M.flatten(-2)
        N = v.size(-1)
        pos = a.q * (N - 1)
        lo = min(math.floor(pos), N - 1)
        frac = pos - lo
        ref = abs_quantile(M, a.q).flatten()
        line = {"shape": [B, m, n]}
        for name in a.methods.split(","):
            if name == "rootopt":
                fn: Callable[[], Tensor] = partial(_flat_quantile, M, a.q)
            else:
                fn = partial(fns[name], v, lo, frac)
            ms, out = median_ms(fn, device, a.reps)
            same = bool(torch.equal(out.float().cpu(), ref.cpu()))
            line[name] = {"ms": ms, "exact": same}
        rows.append(line)
        cells = "  ".join(
            f"{k} {v['ms']:8.2f}{'' if v['exact'] else ' (DIFFERS)'}"
            for k, v in line.items()
            if k != "shape"
        )
        print(f"{B}x{m}x{n}: {cells}")
    if a.json:
        with open(a.json, "x") as fh:
            json.dump({"device": str(device), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
