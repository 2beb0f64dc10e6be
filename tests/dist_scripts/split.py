"""rootopt.distributed.split on gloo: the exact quantile and the Newton–Schulz iteration of a
matrix whose slabs live on different ranks, against the one-process functions on the whole
matrix. Run under torchrun (any world size; slabs may be empty).

Usage: split.py OUT_DIR
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from common import write

from rootopt.distributed import finish, init_distributed
from rootopt.distributed.split import split_abs_quantile, split_newton_schulz
from rootopt.optim.quantile import BRACKET_MIN_ENTRIES, abs_quantile
from rootopt.ortho.newton_schulz import newton_schulz

# Muon's quintic (modded-nanogpt), five times: a fixed schedule for the comparison
SCHEDULE = [(3.4445, -4.7750, 2.0315)] * 5


def cuts(n: int, world: int) -> list[int]:
    """Uneven column cuts: rank r gets about (r + 1) parts, the last rank none when
    world > 2 (an empty slab)."""
    weights = [r + 1 for r in range(world)]
    if world > 2:
        weights[-1] = 0
    total = sum(weights)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + n * w // total)
    bounds[-1] = n
    return bounds


def mine(M: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    b = cuts(M.shape[1], world)
    return M[:, b[rank] : b[rank + 1]]


def main() -> None:
    out_dir = sys.argv[1]
    init_distributed(backend="gloo", timeout_s=120)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    mats: dict[str, torch.Tensor] = {
        "normal": torch.randn(40, 97, generator=g),
        "ties": torch.randint(-3, 4, (16, 50), generator=g).float(),
        "zeros": torch.zeros(5, 9),
        "tiny": torch.tensor([[0.5, -2.0]]),
        "bracket": torch.randn(256, BRACKET_MIN_ENTRIES // 256 + 33, generator=g) ** 3,
        "bf16": torch.randn(24, 70, generator=g).bfloat16(),
    }
    res: dict[str, Any] = {"world": world, "quantile": {}, "ns": {}}
    for name, M in mats.items():
        for q in (0.0, 0.3, 0.5, 0.9, 0.99, 1.0):
            got = split_abs_quantile(mine(M, rank, world), q)
            ref = abs_quantile(M, q)
            res["quantile"][f"{name}@{q}"] = {
                "equal": bool(torch.equal(got, ref)) and got.dtype == ref.dtype,
                "got": float(got),
                "ref": float(ref),
            }
    try:
        split_abs_quantile(mine(torch.full((2, 4), float("nan")), rank, world), 0.5)
        res["nan_error"] = ""
    except ValueError as exc:
        res["nan_error"] = str(exc)
    X = torch.randn(24, 100, generator=g)
    for dtype, name in (
        (torch.float32, "float32"),
        (torch.float64, "float64"),
        (torch.bfloat16, "bfloat16"),
    ):
        Xd = X.to(dtype)
        got = split_newton_schulz(mine(Xd, rank, world), SCHEDULE, dtype=dtype)
        parts = [torch.empty(0)] * world
        dist.all_gather_object(parts, got.float())
        full = torch.cat(parts, dim=1)
        ref = newton_schulz(Xd, SCHEDULE, dtype=dtype).float()
        res["ns"][name] = {
            "shape": list(full.shape),
            "dtype": str(got.dtype),
            "max_diff": float((full - ref).abs().max()),
            "ref_max": float(ref.abs().max()),
            # orthogonalized: the singular values are near 1 (Muon's quintic: 0.7-1.2)
            "sv": [float(s) for s in torch.linalg.svdvals(full.double())[[0, -1]]],
        }
    write(out_dir, "split", res)
    finish(0)


if __name__ == "__main__":
    main()
