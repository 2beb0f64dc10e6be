"""Who owns what: the owner layout of replicated parameters and the rounds of sharded ones
(docs/distributed.md, "What each rank does in one step").

Pure Python on sizes and costs, deterministic (ties go to the lower rank and the earlier
item), so every rank computes the same layout without communicating. The optimizer
(:mod:`rootopt.distributed.replicated`, :mod:`rootopt.distributed.sharded`) and the cost
model (:mod:`rootopt_analysis.costmodel`) both call these functions.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace

from rootopt.distributed.owners import assign_owners

# The smallest piece an AdamW parameter is split into (elements, 4 KiB of float32): below it
# the bytes saved do not pay for another copy and another AdamW call per step. 4,096 left
# the tied 256 x 32 embedding of a 33k-parameter test model whole at W = 3, and its owner
# sent 1.126x DDP AdamW's bytes; 1,024 evens it out (1.003x).
MIN_PIECE = 1024


@dataclass(frozen=True)
class LayoutItem:
    """One parameter in the owner layout, or one piece of an AdamW parameter that is split
    over several owners (elements ``start .. start + numel`` of the flattened parameter).
    ``index``: position in the optimizer's order (groups, then parameters); ``key``: what
    must match inside one flat buffer (dtype and device)."""

    index: int
    name: str
    numel: int
    cost: float  # Newton–Schulz multiply-adds (0 for AdamW parameters)
    root: bool
    key: str = "float32"
    element_size: int = 4
    start: int = 0


@dataclass(frozen=True)
class Bucket:
    """One flat buffer: rank r's segment holds the items it owns, back to back.
    ``items`` are layout positions in buffer order; ``offsets`` their start in the buffer."""

    key: str
    items: tuple[int, ...]
    owners: tuple[int, ...]
    offsets: tuple[int, ...]
    segments: tuple[int, ...]  # elements per rank
    numel: int = 0  # all segments

    def __post_init__(self) -> None:
        object.__setattr__(self, "numel", sum(self.segments))

    def segment_start(self, rank: int) -> int:
        return sum(self.segments[:rank])

    @property
    def even(self) -> bool:
        return len(set(self.segments)) == 1


@dataclass(frozen=True)
class OwnerLayout:
    world: int
    bucket_bytes: int
    items: tuple[LayoutItem, ...]
    buckets: tuple[Bucket, ...]
    owner: tuple[int, ...]  # per item (layout position)

    def digest(self) -> str:
        """A hash of everything a rank's collectives depend on: world size, bucket limit,
        every item (index, name, size, dtype key) and its bucket, owner and offset. Ranks
        that compute different layouts would issue mismatched collectives."""
        h = hashlib.sha256()
        h.update(json.dumps([self.world, self.bucket_bytes]).encode())
        for it in self.items:
            h.update(json.dumps([it.index, it.name, it.start, it.numel, it.root, it.key]).encode())
        for b in self.buckets:
            h.update(json.dumps([b.key, b.items, b.owners, b.offsets, b.segments]).encode())
        return h.hexdigest()

    def owned(self, rank: int) -> list[int]:
        return [i for i, o in enumerate(self.owner) if o == rank]


def owner_layout(items: Sequence[LayoutItem], world: int, bucket_bytes: int) -> OwnerLayout:
    """Owner-aligned buckets for ``items`` at world size ``world``.

    Owners first, over the whole step: ROOT matrices by Newton–Schulz cost, the most
    expensive first onto the least loaded rank (LPT, :func:`assign_owners`: within 4/3 of
    the best balance); then AdamW parameters, largest first, onto the rank holding the
    fewest elements, split into pieces where a parameter would take that rank past its even
    share (total / W elements; AdamW is elementwise, so any piece can be updated alone):
    every rank then moves about the same bytes (the bytes of a rank follow the elements it
    owns). A piece smaller than ``MIN_PIECE`` elements is not split off, and a rank holds
    at most one piece of a parameter. Buckets next: per dtype key, the items in reverse
    optimizer order (about the order backward produces the gradients, so the first buckets
    are complete early in backward) cut into runs of at most ``bucket_bytes`` (at least one
    item each); in a bucket, rank r's segment holds the items r owns, in that order."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    owner = [0] * len(items)
    root = [i for i, it in enumerate(items) if it.root and it.numel > 0]
    for i, o in zip(root, assign_owners([items[i].cost for i in root], world)):
        owner[i] = o
    elem_load = [0] * world
    for i in root:
        elem_load[owner[i]] += items[i].numel
    share = -(-sum(it.numel for it in items) // world)
    rest = [i for i, it in enumerate(items) if not it.root and it.numel > 0]
    pieces = [(it, owner[i]) for i, it in enumerate(items) if it.root or it.numel == 0]
    for i in sorted(rest, key=lambda i: (-items[i].numel, items[i].index)):
        it, remaining, start = items[i], items[i].numel, 0
        holders: list[int] = []
        while remaining > 0:
            free = [q for q in range(world) if q not in holders]
            if not free:  # every rank holds a piece: the last one takes the rest
                last, o = pieces[-1]
                pieces[-1] = (replace(last, numel=last.numel + remaining), o)
                elem_load[o] += remaining
                break
            o = min(free, key=lambda q: (elem_load[q], q))  # the first of the least loaded
            room = share - elem_load[o]
            take = remaining if remaining <= room or room < MIN_PIECE else room
            pieces.append((replace(it, numel=take, start=start), o))
            holders.append(o)
            elem_load[o] += take
            start += take
            remaining -= take
    pieces.sort(key=lambda x: (x[0].index, x[0].start))
    items = [it for it, _ in pieces]
    owner = [o for _, o in pieces]
    order = sorted(range(len(items)), key=lambda i: (-items[i].index, items[i].start))
    keys = list(dict.fromkeys(items[i].key for i in order))
    buckets: list[Bucket] = []
    for key in keys:
        mine = [i for i in order if items[i].key == key and items[i].numel > 0]
        sizes = [items[i].numel * items[i].element_size for i in mine]
        for run in cut_rounds(sizes, bucket_bytes):
            buckets.append(_bucket(items, owner, [mine[j] for j in run], world))
    return OwnerLayout(world, bucket_bytes, tuple(items), tuple(buckets), tuple(owner))


def _bucket(
    items: Sequence[LayoutItem], owner: Sequence[int], chunk: Sequence[int], world: int
) -> Bucket:
    """One flat buffer for ``chunk``: rank 0's items first, then rank 1's, ..."""
    by_rank: dict[int, list[int]] = {}
    for i in chunk:
        by_rank.setdefault(owner[i], []).append(i)
    seq = [i for r in sorted(by_rank) for i in by_rank[r]]
    segments = [0] * world
    for i in chunk:
        segments[owner[i]] += items[i].numel
    offsets: list[int] = []
    off = 0
    for i in seq:
        offsets.append(off)
        off += items[i].numel
    return Bucket(
        items[seq[0]].key, tuple(seq), tuple(owner[i] for i in seq), tuple(offsets),
        tuple(segments),
    )  # fmt: skip


def cut_rounds(sizes_bytes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive runs of at most ``bucket_bytes`` (at least one entry each), as
    indices into ``sizes_bytes``: the owner layout's buckets and the sharded rounds."""
    rounds: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, nbytes in enumerate(sizes_bytes):
        if cur and size + nbytes > bucket_bytes:
            rounds.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nbytes
    if cur:
        rounds.append(cur)
    return rounds


def round_order(shapes: Sequence[tuple[int, int]]) -> list[int]:
    """The order in which an owner visits its sharded matrices: by view shape (rows,
    cols), then position, so that same-shape matrices share a stack."""
    return sorted(range(len(shapes)), key=lambda i: (shapes[i][0], shapes[i][1], i))


def owner_rounds(
    costs: Sequence[float],
    sizes_bytes: Sequence[int],
    shapes: Sequence[tuple[int, int]],
    world: int,
    bucket_bytes: int,
) -> list[list[tuple[int, int]]]:
    """The rounds of the sharded (FSDP2) step as ``(task, owner)`` pairs.

    Owners first, over the whole step (LPT on ``costs``, :func:`assign_owners`), then
    rounds cut per owner: each owner's tasks in :func:`round_order`, cut into runs of at
    most ``bucket_bytes`` (at least one task each) with :func:`cut_rounds`; round k holds
    every owner's k-th run. So ``bucket_bytes`` bounds what one owner receives in a round,
    not what the whole round moves: at a world size no smaller than the number of tasks
    every task is in one round, and the Newton–Schulz on the step's path is the busiest
    rank's, not a sum over rounds that each wait for their busiest rank."""
    if not len(costs) == len(sizes_bytes) == len(shapes):
        raise ValueError(
            f"owner_rounds: {len(costs)} costs, {len(sizes_bytes)} sizes, {len(shapes)} shapes"
        )
    owners = assign_owners(costs, world)
    mine: list[list[int]] = [[] for _ in range(world)]
    for i in round_order(shapes):
        mine[owners[i]].append(i)
    runs = [
        [
            [tasks[j] for j in run]
            for run in cut_rounds([sizes_bytes[i] for i in tasks], bucket_bytes)
        ]
        for tasks in mine
    ]
    n = max((len(r) for r in runs), default=0)
    return [
        [(i, o) for o in range(world) if k < len(runs[o]) for i in runs[o][k]] for k in range(n)
    ]
