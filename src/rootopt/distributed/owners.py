"""Which rank orthogonalizes which matrix.

Cost of one Newton–Schulz iteration on an ``l x s`` matrix (``s <= l``, wide
orientation): ``X Xᵀ`` is ``s·s·l`` multiply-adds, ``(A)·A`` is ``s³`` and ``B X`` is
``s·s·l`` again, so ``K`` iterations cost about ``K·s²·(2l + s)`` (the estimate torchtitan's
DistMuon balances by). Owners are chosen greedily: the most expensive matrix goes to the
least loaded rank (LPT scheduling, within 4/3 of the optimum), ties broken by rank so every
rank computes the same owners without communicating.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def ns_cost(batch: int, rows: int, cols: int, ns_steps: int) -> float:
    """Estimated multiply-adds to orthogonalize ``batch`` matrices of ``rows x cols``."""
    s, l = min(rows, cols), max(rows, cols)
    return float(batch) * ns_steps * s * s * (2 * l + s)


def assign_owners(
    costs: Sequence[float], world_size: int, loads: list[float] | None = None
) -> list[int]:
    """Owner rank of each task, greedily by cost (largest first onto the least loaded
    rank). ``loads`` (per rank, updated in place) carries balance across calls."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if loads is None:
        loads = [0.0] * world_size
    if len(loads) != world_size:
        raise ValueError(f"loads has {len(loads)} entries for world_size {world_size}")
    heap = [(load, r) for r, load in enumerate(loads)]
    heapq.heapify(heap)
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(heap)
        owners[i] = r
        load += costs[i]
        loads[r] = load
        heapq.heappush(heap, (load, r))
    return owners


def chunk_rows(rows: int, world_size: int) -> list[int]:
    """Rows of each rank's shard when dim 0 is split like ``torch.chunk`` (FSDP2's
    ``Shard(0)``): ``ceil(rows / W)`` each until the rows run out; trailing ranks may
    hold none."""
    c = -(-rows // world_size) if rows else 0
    return [max(0, min(c, rows - r * c)) for r in range(world_size)]
