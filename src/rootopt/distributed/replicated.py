"""The replicated step of :class:`~rootopt.distributed.DistributedROOT`: the owner design.

Plain (non-``DTensor``) parameters are laid out once in flat buckets ordered by owner
(:func:`~rootopt.distributed.layout.owner_layout`: ROOT matrices balanced by Newton–Schulz
cost, AdamW parameters split into pieces where needed to even out the elements). Per
bucket:

1. **Reduce-scatter** of the gradients: each owner gets the sum of its own segment,
   divided by the world size (``average_grads=True``). It starts during backward, from a
   post-accumulate-grad hook, as soon as every parameter of the bucket has its gradient
   and the buckets before it have started: one fixed order on every rank, as DDP's
   reducer starts its all-reduces, so the transfer runs behind the rest of backward.
   Under DDP (``average_grads=False``) the gradients are already averaged and this is
   skipped.
2. **The owner's update**: ROOT's own :meth:`rootopt.ROOT._root` (momentum, whole-matrix
   threshold, Newton–Schulz, decay and scaled step) and :meth:`rootopt.ROOT._adamw` on the
   parameters this rank owns, with the synchronised gradients; AdamW pieces with
   :func:`rootopt.optim.adamw.adamw_` on their slice. Momentum and AdamW moments live on
   their owner only (ZeRO-1).
3. **All-gather** of the new parameters, in their dtype.

Bytes per rank: DDP AdamW's (Moonlight, arXiv 2502.16982 §2.3). Collectives per step:
2 per bucket, whatever the number of shapes and matrices.
"""

from __future__ import annotations

import functools
import hashlib
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from rootopt.distributed.flat import gather, start_reduce_scatter
from rootopt.distributed.group import collective, world
from rootopt.distributed.layout import Bucket, LayoutItem, OwnerLayout, owner_layout
from rootopt.distributed.owners import ns_cost
from rootopt.optim._coefficients import group_matrices
from rootopt.optim.adamw import adamw_
from rootopt.optim.root import algorithm_of, state_dtype

if TYPE_CHECKING:
    from rootopt.distributed.root import DistributedROOT

Entry = tuple[int, Tensor, str]  # (index in group, parameter, name), as ROOT's step has them


@dataclass
class _Backward:
    """The reduce-scatters started from gradient hooks, for one layout.

    Bucket ``k`` starts when every parameter in it has had its gradient accumulated in
    this backward (``have[k] == need[k]``) *and* buckets ``0 .. k-1`` have started. What
    has not started when the gradients are synchronised (a parameter without a gradient
    on this rank, one that does not require grad, gradients set by hand) starts then, in
    the same order, before any other collective of the step."""

    rank: int
    need: list[frozenset[int]]  # per bucket: the parameters (optimizer positions) in it
    buckets_of: dict[int, list[int]]  # parameter position -> the buckets holding it
    have: list[set[int]] = field(default_factory=list)
    started: dict[int, Callable[[], Tensor]] = field(default_factory=dict)
    # parameter position -> (data pointer, version) of the gradient its bucket copied:
    # a gradient changed after that (a second backward, clipping or unscaling p.grad)
    # would not reach the update, so the step refuses it
    seen: dict[int, tuple[int, int] | None] = field(default_factory=dict)
    next: int = 0  # the first bucket not started
    in_backward: int = 0  # of ``started``: started from a hook
    muted: int = 0  # > 0 inside ``no_sync()``

    def __post_init__(self) -> None:
        self.have = [set() for _ in self.need]

    def reset(self) -> None:
        self.have = [set() for _ in self.need]
        self.started.clear()
        self.seen.clear()
        self.next = 0
        self.in_backward = 0


def _on_grad(ref: weakref.ReferenceType[Any], index: int, _p: Tensor) -> None:
    """The post-accumulate-grad hook of one parameter (holds the optimizer weakly)."""
    opt = ref()
    if opt is not None:
        opt._replicated.grad_ready(opt, index)


def state_keys(group: dict[str, Any], p: Tensor) -> tuple[str, ...]:
    """What ROOT keeps per parameter besides its step count (:meth:`ROOT._init_state`)."""
    if algorithm_of(group, p) == "adamw":
        return ("exp_avg", "exp_avg_sq")
    return (
        ("momentum_buffer", "robust_mean", "robust_sq")
        if group["robust_scaling"]
        else ("momentum_buffer",)
    )


class Replicated:
    """The owner design's layout, its backward hooks and its step (one per optimizer)."""

    def __init__(self, average_grads: bool, comm_bucket_bytes: int) -> None:
        self.average_grads = average_grads
        self.comm_bucket_bytes = comm_bucket_bytes
        self.layout: OwnerLayout | None = None
        self.backward: _Backward | None = None
        self.hooks: list[Any] = []

    def __getstate__(self) -> dict[str, Any]:
        """Without the hooks and the started buckets: they belong to this optimizer's
        parameters and process group; a copy starts every bucket with its step."""
        return {**self.__dict__, "backward": None, "hooks": []}

    # ------------------------------------------------------------------------ the layout
    def lay_out(self, opt: DistributedROOT) -> None:
        """Lay the plain parameters out in owner buckets, check that every rank has the
        same layout, and keep momentum / AdamW moments only where they are owned. A layout
        that changes (a new parameter group) first gathers the state it had spread."""
        info = world(opt.process_group)
        items = self._items(opt) if info.world_size > 1 else []
        if not items:
            self.layout = None
            self._arm(opt, None, info.rank)
            return
        if self.layout is not None:
            flat = opt._flat()
            for index, st in self.gather_state(opt).items():
                opt.state[flat[index][2]].update(st)
        layout = owner_layout(items, info.world_size, self.comm_bucket_bytes)
        self._check(opt, layout, info.rank)
        self.layout = layout
        self.prune_state(opt, info.rank)
        self._arm(opt, layout, info.rank)

    def _items(self, opt: DistributedROOT) -> list[LayoutItem]:
        """The plain parameters with elements: ROOT matrices with their Newton–Schulz cost
        (a fused weight's blocks summed), AdamW parameters with none; ``key``: dtype and
        device (one flat buffer holds one of each)."""
        items = []
        for index, (gi, pi, p) in enumerate(opt._flat()):
            if _is_dtensor(p) or p.numel() == 0:
                continue
            group = opt.param_groups[gi]
            root = algorithm_of(group, p) == "root"
            cost = _cost(group, pi, p) if root else 0.0
            key = f"{str(p.dtype).removeprefix('torch.')}@{p.device.type}"
            name = opt._name(gi, group, pi)
            items.append(LayoutItem(index, name, p.numel(), cost, root, key, p.element_size()))
        return items

    def _check(self, opt: DistributedROOT, layout: OwnerLayout, rank: int) -> None:
        """All-gather every rank's layout digest; on any difference every rank stops with
        one line (different layouts would issue collectives of different sizes: a hang or
        garbage)."""
        # average_grads decides whether reduce-scatters are issued: part of the layout
        mode = f"{layout.digest()} average_grads={self.average_grads}"
        digest = hashlib.sha256(mode.encode()).hexdigest()
        raw = bytes.fromhex(digest)
        dev = opt._flat()[layout.items[0].index][2].device
        words = torch.tensor(
            [int.from_bytes(raw[i : i + 8], "big", signed=True) for i in range(0, 32, 8)],
            dtype=torch.int64,
            device=dev,
        )
        W = layout.world
        out = torch.empty(4 * W, dtype=torch.int64, device=dev)
        collective(
            "all_gather owner plan digests", dist.all_gather_into_tensor, out, words,
            group=opt.process_group,
        )  # fmt: skip
        rows = out.view(W, 4).tolist()
        differ = [r for r in range(W) if rows[r] != rows[rank]]
        if differ:
            raise ValueError(
                f"rank {rank}/{W}: the owner plan (digest {digest[:12]}) differs from "
                f"that of rank{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))}; "
                "build DistributedROOT with the same parameters (names, shapes, dtypes), "
                "groups, comm_bucket_bytes and average_grads on every rank"
            )

    # ------------------------------------------------------------------- backward hooks
    def _arm(self, opt: DistributedROOT, layout: OwnerLayout | None, rank: int) -> None:
        """(Re)register the gradient hooks of ``layout``'s parameters."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.backward = None
        if layout is None or not self.average_grads:
            return
        flat = opt._flat()
        need = [frozenset(layout.items[i].index for i in b.items) for b in layout.buckets]
        buckets_of: dict[int, list[int]] = {}
        for k, ids in enumerate(need):
            for i in sorted(ids):
                buckets_of.setdefault(i, []).append(k)
        ref = weakref.ref(opt)
        for i in buckets_of:
            p = flat[i][2]
            if p.requires_grad:  # the others' buckets start with the step
                hook = functools.partial(_on_grad, ref, i)
                self.hooks.append(p.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]
        self.backward = _Backward(rank, need, buckets_of)

    def grad_ready(self, opt: DistributedROOT, index: int) -> None:
        """Parameter ``index`` has its gradient for this backward: start every bucket that
        is now complete and next in order. A bucket that started already is left alone:
        the step compares the gradient with what it copied (:meth:`changed`)."""
        bw = self.backward
        if bw is None or bw.muted:
            return
        for k in bw.buckets_of.get(index, ()):
            if k >= bw.next:
                bw.have[k].add(index)
        with torch.no_grad():
            self.start_ready(opt, final=False)

    def start_ready(self, opt: DistributedROOT, final: bool) -> None:
        """Start buckets in order while the next one is complete (``final``: all that are
        left, with the gradients there are; a missing one counts as zeros)."""
        bw, layout = self.backward, self.layout
        if bw is None or layout is None:
            return
        while bw.next < len(layout.buckets) and (
            final or len(bw.have[bw.next]) == len(bw.need[bw.next])
        ):
            bw.started[bw.next] = self._start(opt, layout.buckets[bw.next], bw)
            bw.next += 1
            if not final:
                bw.in_backward += 1

    def _start(self, opt: DistributedROOT, b: Bucket, bw: _Backward) -> Callable[[], Tensor]:
        """Copy bucket ``b``'s gradients into one flat buffer in owner order (zeros where
        there is none) and start its reduce-scatter."""
        assert self.layout is not None
        flat = opt._flat()
        items = [self.layout.items[i] for i in b.items]
        p0 = flat[items[0].index][2]
        buf = torch.zeros(b.numel, dtype=p0.dtype, device=p0.device)
        for it, off in zip(items, b.offsets):
            g = flat[it.index][2].grad
            bw.seen[it.index] = None if g is None else (g.data_ptr(), g._version)
            if g is not None:
                buf[off : off + it.numel].copy_(g.reshape(-1)[it.start : it.start + it.numel])
        return start_reduce_scatter(buf, b.segments, bw.rank, opt.process_group, lambda: opt.stats)

    def changed(self, opt: DistributedROOT) -> str:
        """The name of a parameter whose gradient changed after its bucket's reduce-scatter
        started (another backward, clipping or unscaling ``p.grad``), or ""."""
        bw = self.backward
        if bw is None:
            return ""
        flat = opt._flat()
        for index, was in bw.seen.items():
            g = flat[index][2].grad
            now = None if g is None else (g.data_ptr(), g._version)
            if now != was:
                gi, pi, _ = flat[index]
                return opt._name(gi, opt.param_groups[gi], pi)
        return ""

    def drain(self, opt: DistributedROOT) -> None:
        """A backward whose step is skipped: start what is left and wait for every bucket
        (the collectives the other ranks issue too, whichever of them started early), then
        drop the sums."""
        bw = self.backward
        if bw is None or not (bw.started or any(bw.have)):
            return
        self.start_ready(opt, final=True)
        pending = list(bw.started.values())
        bw.reset()
        for finish in pending:
            finish()

    # ----------------------------------------------------------------------------- step
    def reduce(self, opt: DistributedROOT, rank: int) -> dict[int, Tensor]:
        """The averaged gradient of every layout item this rank owns (by layout position,
        flat): the reduce-scatters (every one not started in backward is started first,
        then all are waited for), or, under DDP, the owned part of the local gradient."""
        layout = self.layout
        assert layout is not None
        flat = opt._flat()
        owned: dict[int, Tensor] = {}
        if not self.average_grads:
            for li, (it, o) in enumerate(zip(layout.items, layout.owner)):
                if o == rank:
                    p = flat[it.index][2]
                    g = p.grad if p.grad is not None else torch.zeros_like(p)
                    owned[li] = g.reshape(-1)[it.start : it.start + it.numel]
            return owned
        if self.backward is None:  # a copy (pickled): hooks again, everything with the step
            self._arm(opt, layout, rank)
        bw = self.backward
        assert bw is not None
        opt.stats.in_backward = bw.in_backward
        self.start_ready(opt, final=True)
        for k, b in enumerate(layout.buckets):
            summed = bw.started.pop(k)()
            start = b.segment_start(rank)
            for j, (li, o) in enumerate(zip(b.items, b.owners)):
                if o == rank:
                    off = b.offsets[j] - start
                    owned[li] = summed[off : off + layout.items[li].numel]
        return owned

    def update(
        self, opt: DistributedROOT, owned: dict[int, Tensor], active: set[int], rank: int
    ) -> None:
        """Every rank advances the step count of every updated parameter; per bucket the
        owner updates what it owns (ROOT's own update on the averaged gradients) and one
        all-gather brings every rank the new parameters."""
        layout = self.layout
        assert layout is not None
        flat = opt._flat()
        mine = sorted({it.index for it in layout.items} & active)
        steps = [opt.state[flat[i][2]]["step"] for i in mine]
        if steps:
            torch._foreach_add_(steps, 1)
        for b in layout.buckets:
            self._owner_update(opt, b, owned, active, rank)
            self._gather_params(opt, b, rank)
        if self.backward is not None:
            self.backward.reset()

    def _owner_update(
        self, opt: DistributedROOT, b: Bucket, owned: dict[int, Tensor], active: set[int], rank: int
    ) -> None:
        assert self.layout is not None
        flat = opt._flat()
        parts: dict[tuple[int, str], list[tuple[Entry, Tensor]]] = {}
        for j, li in enumerate(b.items):
            it = self.layout.items[li]
            if b.owners[j] != rank or it.index not in active:
                continue
            gi, pi, p = flat[it.index]
            group = opt.param_groups[gi]
            if it.numel != p.numel():  # one piece of a split AdamW parameter
                _adamw_piece(opt.state[p], group, p, it, owned[li])
                continue
            entry = (pi, p, opt._name(gi, group, pi))
            parts.setdefault((gi, algorithm_of(group, p)), []).append((entry, owned[li]))
        for (gi, algo), part in parts.items():
            group = opt.param_groups[gi]
            entries = [e for e, _ in part]
            grads = [g.view(e[1].shape) for e, g in part]
            if algo == "adamw":
                opt._adamw(group, entries, grads=grads)
                continue
            start = time.perf_counter()
            opt._root(group, entries, grads[0].device, grads=grads)
            opt.stats.ns_seconds += time.perf_counter() - start
            for pi, p, _ in entries:
                for m in group_matrices(group, pi, p):
                    opt.stats.ns_matrices += m.batch
                    opt.stats.ns_cost += ns_cost(m.batch, m.rows, m.cols, group["ns_steps"])

    def _gather_params(self, opt: DistributedROOT, b: Bucket, rank: int) -> None:
        """All-gather bucket ``b``'s parameters from their owners and copy them in."""
        assert self.layout is not None
        flat = opt._flat()
        items = [self.layout.items[i] for i in b.items]
        params = [flat[it.index][2] for it in items]
        start = b.segment_start(rank)
        send = torch.empty(b.segments[rank], dtype=params[0].dtype, device=params[0].device)
        for j, it in enumerate(items):
            if b.owners[j] == rank:
                off = b.offsets[j] - start
                piece = params[j].reshape(-1)[it.start : it.start + it.numel]
                send[off : off + it.numel].copy_(piece)
        new = gather(
            send, b.segments, rank, opt.process_group, opt.stats, "all_gather owners' parameters"
        )
        for j, (it, off) in enumerate(zip(items, b.offsets)):
            if b.owners[j] != rank:
                part = new[off : off + it.numel]
                if it.numel == params[j].numel():  # whole (any memory layout)
                    params[j].copy_(part.view(params[j].shape))
                else:  # an AdamW piece of a contiguous parameter
                    params[j].view(-1)[it.start : it.start + it.numel].copy_(part)

    # ---------------------------------------------------------------------------- state
    def gather_state(self, opt: DistributedROOT) -> dict[int, dict[str, Tensor]]:
        """The owner-only state of every parameter this rank does not own, gathered bucket
        by bucket (one all-gather each); keyed by position in the optimizer's order. Not
        counted in the step's statistics."""
        layout = self.layout
        info = world(opt.process_group)
        if layout is None or info.world_size == 1:
            return {}
        from rootopt.distributed.flat import StepStats

        out: dict[int, dict[str, Tensor]] = {}
        for b in layout.buckets:
            self._gather_bucket_state(opt, b, info.rank, out, StepStats())
        return out

    def _gather_bucket_state(
        self,
        opt: DistributedROOT,
        b: Bucket,
        rank: int,
        out: dict[int, dict[str, Tensor]],
        stats: Any,
    ) -> None:
        assert self.layout is not None
        flat = opt._flat()
        items = [self.layout.items[i] for i in b.items]
        params = [flat[it.index][2] for it in items]
        keys = [state_keys(opt.param_groups[flat[it.index][0]], p) for it, p in zip(items, params)]
        segments = [0] * self.layout.world
        for o, it, k in zip(b.owners, items, keys):
            segments[o] += it.numel * len(k)
        dtype = state_dtype(params[0])
        send = torch.empty(segments[rank], dtype=dtype, device=params[0].device)
        off = 0
        for j, o in enumerate(b.owners):
            if o == rank:
                for key in keys[j]:
                    send[off : off + items[j].numel].copy_(opt.state[params[j]][key].reshape(-1))
                    off += items[j].numel
        full = gather(send, segments, rank, opt.process_group, stats, "all_gather owners' state")
        off = 0
        for j, o in enumerate(b.owners):  # segments are in rank order, as are owners
            it, p = items[j], params[j]
            for key in keys[j]:
                part = full[off : off + it.numel]
                off += it.numel
                if it.numel != p.numel():  # a piece: assembled into the whole, own one too
                    st = out.setdefault(it.index, {})
                    if key not in st:
                        st[key] = torch.zeros(p.shape, dtype=dtype, device=p.device)
                    st[key].view(-1)[it.start : it.start + it.numel].copy_(part)
                elif o != rank:
                    out.setdefault(it.index, {})[key] = part.view(p.shape).clone()

    def prune_state(self, opt: DistributedROOT, rank: int) -> None:
        """Keep momentum / AdamW moments of what this rank owns (a piece's slice of them)."""
        layout = self.layout
        if layout is None:
            return
        flat = opt._flat()
        mine: dict[int, LayoutItem] = {}
        for it, o in zip(layout.items, layout.owner):
            if o == rank:
                mine[it.index] = it
        for index in dict.fromkeys(it.index for it in layout.items):
            gi, _, p = flat[index]
            st, piece = opt.state[p], mine.get(index)
            for key in state_keys(opt.param_groups[gi], p):
                if piece is None:
                    st.pop(key, None)
                elif piece.numel != p.numel() and st[key].numel() == p.numel():
                    st[key] = st[key].reshape(-1)[piece.start : piece.start + piece.numel].clone()


def _adamw_piece(
    st: dict[str, Any], group: dict[str, Any], p: Tensor, it: LayoutItem, g: Tensor
) -> None:
    """AdamW on one piece of a split parameter (its step count already advanced): its owner
    keeps the moments of the piece only (``state[p]["exp_avg"]`` has the piece's elements)."""
    adamw_(
        [p.view(-1)[it.start : it.start + it.numel]], [g], [st["exp_avg"]],
        [st["exp_avg_sq"]], [st["step"]], lr=float(group["lr"]), betas=group["adamw_betas"],
        eps=group["adamw_eps"], weight_decay=group["weight_decay"],
    )  # fmt: skip


def _cost(group: dict[str, Any], pi: int, p: Tensor) -> float:
    """Newton–Schulz multiply-adds of one ROOT parameter (a fused weight's blocks summed)."""
    return sum(
        ns_cost(m.batch, m.rows, m.cols, group["ns_steps"]) for m in group_matrices(group, pi, p)
    )


def _is_dtensor(t: object) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch builds without distributed
        return False
    return isinstance(t, DTensor)
