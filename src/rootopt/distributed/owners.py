"""Which rank orthogonalizes which matrix.

Cost of one Newton–Schulz iteration on an ``l x s`` matrix (``s <= l``, wide
orientation): ``X Xᵀ`` is ``s·s·l`` multiply-adds, ``(A)·A`` is ``s³`` and ``B X`` is
``s·s·l`` again, so ``K`` iterations cost about ``K·s²·(2l + s)`` (the estimate torchtitan's
DistMuon balances by). Owners are chosen greedily: the most expensive matrix goes to the
least loaded rank (LPT scheduling, within 4/3 of the optimum), ties broken by rank so every
rank computes the same plan without communicating.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def ns_cost(batch: int, rows: int, cols: int, ns_steps: int, split: int = 1) -> float:
    """Estimated multiply-adds to orthogonalize ``batch`` matrices of ``rows x cols``, or
    one holder's part of them when the long side is split over ``split`` ranks (the two
    products with ``X`` divide, ``A·A`` does not; docs/distributed.md, "Split matrices")."""
    s, l = min(rows, cols), max(rows, cols)
    return float(batch) * ns_steps * s * s * (2 * l / split + s)


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


def assign_grouped(
    costs: Sequence[float], world_size: int, groups: Sequence[int], node: int
) -> list[int]:
    """:func:`assign_owners` where some tasks come in groups that must sit on distinct
    ranks of one node (the slabs of one split matrix, whose holders all-reduce its Gram
    matrix every Newton–Schulz iteration; docs/distributed.md, "Split matrices").

    ``groups[i]``: a group id (>= 0) or -1 for a task on its own. Nodes are runs of
    ``node`` consecutive ranks (torchrun numbers ranks node by node). Units — a lone task,
    or a whole group — are placed largest total cost first: a lone task on the least loaded
    rank, a group of k tasks on the k least loaded ranks of the node where the most loaded
    of those k is least loaded, its tasks in order onto those ranks in rank order. Ties go
    to the lower rank or node, so every rank computes the same plan."""
    if len(groups) != len(costs):
        raise ValueError(f"assign_grouped: {len(groups)} group ids for {len(costs)} tasks")
    if world_size < 1 or node < 1:
        raise ValueError(f"assign_grouped: world_size {world_size} and node {node} must be >= 1")
    members: dict[int, list[int]] = {}
    units: list[list[int]] = []
    for i, g in enumerate(groups):
        if g < 0:
            units.append([i])
        elif g in members:
            members[g].append(i)
        else:
            members[g] = [i]
            units.append(members[g])
    for u in units:
        if len(u) > min(node, world_size):
            raise ValueError(
                f"assign_grouped: a group of {len(u)} tasks does not fit on a node of "
                f"{min(node, world_size)} ranks"
            )
    loads = [0.0] * world_size
    owners = [0] * len(costs)
    nodes = [list(range(s, min(s + node, world_size))) for s in range(0, world_size, node)]
    heap = [(0.0, r) for r in range(world_size)]  # (load, rank); stale entries skipped
    for u in sorted(units, key=lambda u: (-sum(costs[i] for i in u), u[0])):
        if len(u) == 1:
            load, r = heapq.heappop(heap)
            while load != loads[r]:
                load, r = heapq.heappop(heap)
            owners[u[0]] = r
            loads[r] += costs[u[0]]
            heapq.heappush(heap, (loads[r], r))
            continue
        best: tuple[float, int, list[int]] | None = None
        for n, ranks in enumerate(nodes):
            if len(ranks) < len(u):
                continue
            pick = sorted(ranks, key=lambda r: (loads[r], r))[: len(u)]
            key = max(loads[r] for r in pick)
            if best is None or key < best[0]:
                best = (key, n, sorted(pick))
        assert best is not None  # some node holds min(node, world_size) >= len(u) ranks
        for i, r in zip(u, best[2]):
            owners[i] = r
            loads[r] += costs[i]
            heapq.heappush(heap, (loads[r], r))
    return owners
