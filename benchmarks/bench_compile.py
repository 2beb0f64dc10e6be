"""Eager vs ``torch.compile(opt.step)`` ROOT step time on a stack of GPT-style matrices.

Usage: ``python benchmarks/bench_compile.py D L`` (width, layers). Prints the median of
steps 6-30 for each mode and the time of the first two compiled calls (the compiles).
One thread (docs/integrations.md, "torch.compile").
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

from rootopt import ROOT


def model(d: int, layers: int) -> nn.ModuleList:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [
            nn.Linear(d, 3 * d),
            nn.Linear(d, d),
            nn.Linear(d, 4 * d),
            nn.Linear(4 * d, d),
            nn.LayerNorm(d),
        ]
    return nn.ModuleList(mods)


def main() -> None:
    torch.set_num_threads(1)
    d, layers = int(sys.argv[1]), int(sys.argv[2])
    out: dict[str, tuple[float, float]] = {}
    for mode in ("eager", "compiled"):
        m = model(d, layers)
        opt = ROOT(m.parameters(), lr=1e-3)
        step = torch.compile(opt.step) if mode == "compiled" else opt.step
        times = []
        for s in range(30):
            g = torch.Generator().manual_seed(s)
            for p in m.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        steady = sorted(times[5:])
        out[mode] = (1000 * steady[len(steady) // 2], times[0] + times[1])
    print(
        f"d={d} layers={layers}: eager {out['eager'][0]:.2f} ms/step, "
        f"compiled {out['compiled'][0]:.2f} ms/step, "
        f"first two compiled calls {out['compiled'][1]:.1f} s"
    )


if __name__ == "__main__":
    main()
