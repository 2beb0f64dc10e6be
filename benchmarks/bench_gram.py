"""Accuracy of the Gram-space Newton–Schulz iteration against the plain one.

For every spectrum family (Gaussian, heavy-tailed, low-rank + noise, recorded momentum)
and iteration dtype, draws wide matrices with the family's singular values, runs K
steps of both iterations and reports the relative Frobenius error against the exact
polar factor ``U Vᵀ`` (float64 SVD), and the distance between the two iterates.

Usage: python benchmarks/bench_gram.py [--shapes 128x448,256x1024] [--draws 4] [--json out]
"""

from __future__ import annotations

import argparse
import json
import math
import os
from importlib import resources
from typing import Any

import torch
from torch import Tensor

from rootopt.coeffs import resolve
from rootopt.ortho import gram_newton_schulz, newton_schulz

FAMILIES = ("gaussian", "heavytail", "lowrank", "momentum")


def _orth(n: int, k: int, g: torch.Generator) -> Tensor:
    Q, _ = torch.linalg.qr(torch.randn(n, k, dtype=torch.float64, generator=g))
    return Q


def _recorded() -> list[Tensor]:
    text = (
        resources.files("rootopt_analysis.coeffs")
        .joinpath("data", "momentum_spectra.json")
        .read_text()
    )
    out = []
    for e in json.loads(text)["spectra"]:
        s = torch.tensor(e["sigma"], dtype=torch.float64)
        s = s[s > 0]
        if s.numel():
            out.append(s.sort(descending=True).values)
    return out


def _transport(s: Tensor, m: int) -> Tensor:
    # Resample a recorded spectrum to m values at equally spaced quantile positions.
    pos = (torch.arange(m, dtype=torch.float64) + 0.5) / m * s.numel() - 0.5
    pos = pos.clamp(0, s.numel() - 1)
    lo = pos.floor().long()
    hi = (lo + 1).clamp(max=s.numel() - 1)
    w = pos - lo
    return s[lo] * (1 - w) + s[hi] * w


def draw(family: str, m: int, n: int, i: int, recorded: list[Tensor]) -> Tensor:
    """One float64 m x n matrix of ``family`` (draw ``i``)."""
    g = torch.Generator().manual_seed(1000 * i + hash(family) % 1000)
    if family == "gaussian":
        return torch.randn(m, n, dtype=torch.float64, generator=g)
    if family == "heavytail":
        nu = (2.5, 4.0)[i % 2]
        t = torch.distributions.StudentT(torch.tensor(nu, dtype=torch.float64))
        torch.manual_seed(1000 * i + 7)
        M = t.sample((m, n))
        M = M * torch.exp(0.5 * torch.randn(m, 1, dtype=torch.float64, generator=g))
        M = M * torch.exp(0.5 * torch.randn(1, n, dtype=torch.float64, generator=g))
        eps = torch.quantile(M.abs().flatten(), 0.9)
        return M.clamp(-eps, eps)
    if family == "lowrank":
        rank = (4, 16, 32)[i % 3]
        noise = (0.01, 0.05, 0.10)[(i // 3) % 3]
        S = _orth(m, rank, g) @ (torch.arange(1, rank + 1) ** -0.5).diag().double()
        S = S @ _orth(n, rank, g).T
        N = torch.randn(m, n, dtype=torch.float64, generator=g)
        # noise floor: the noise holds `noise` of the Frobenius energy
        return S / S.norm() * math.sqrt(1 - noise) + N / N.norm() * math.sqrt(noise)
    s = _transport(recorded[(7 * i) % len(recorded)], m)
    return _orth(m, m, g) @ s.diag() @ _orth(n, m, g).T


def polar(M: Tensor) -> Tensor:
    U, _, Vh = torch.linalg.svd(M, full_matrices=False)
    return U @ Vh


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="128x448,256x512,256x1024")
    ap.add_argument("--draws", type=int, default=6)
    ap.add_argument("--coefficients", default="muon,polar_express,adanewton")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.json and os.path.lexists(args.json):
        # checked before the measurements, not after: the file is never overwritten
        ap.error(f"--json {args.json}: the file exists; name a new one")
    recorded = _recorded()
    rows: list[dict[str, Any]] = []
    for shape in args.shapes.split(","):
        m, n = (int(v) for v in shape.split("x"))
        for spec in args.coefficients.split(","):
            sched = resolve(spec, m, n, args.steps)
            for family in FAMILIES:
                for dtype in (torch.float32, torch.bfloat16):
                    ep, eg, d = [], [], []
                    for i in range(args.draws):
                        M = draw(family, m, n, i, recorded)
                        P = polar(M)
                        Xp = newton_schulz(M.float(), sched, dtype=dtype).double()
                        Xg = gram_newton_schulz(M.float(), sched, dtype=dtype).double()
                        ep.append(float((Xp - P).norm() / P.norm()))
                        eg.append(float((Xg - P).norm() / P.norm()))
                        d.append(float((Xg - Xp).norm() / Xp.norm()))
                    row = {
                        "shape": f"{m}x{n}",
                        "coefficients": spec,
                        "family": family,
                        "dtype": str(dtype).removeprefix("torch."),
                        "plain_err": sum(ep) / len(ep),
                        "gram_err": sum(eg) / len(eg),
                        "gram_over_plain_max": max(g / p for g, p in zip(eg, ep)),
                        "gram_vs_plain": max(d),
                    }
                    rows.append(row)
                    print(
                        f"{row['shape']:>9} {spec:<14} {family:<10} {row['dtype']:<9}"
                        f" plain {row['plain_err']:.4f}  gram {row['gram_err']:.4f}"
                        f"  max ratio {row['gram_over_plain_max']:.3f}"
                        f"  |gram-plain| {row['gram_vs_plain']:.4f}",
                        flush=True,
                    )
    if args.json:
        with open(args.json, "x") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
