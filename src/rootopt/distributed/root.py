"""ROOT across processes: each matrix is thresholded and orthogonalized by one owner rank.

Two layouts, chosen per parameter:

* **replicated** (plain tensors), in one of two designs (``ddp_design``):

  - ``gather`` (the first design, kept for comparison): DDP or the optimizer's own
    gradient all-reduce gives every rank the same averaged gradient, so every rank keeps
    the same momentum. An owner thresholds + orthogonalizes its matrices (the whole
    matrix: exact quantile from the true size) and the updates are gathered bucket by
    bucket with one ``all_gather_single`` per bucket. Every rank then applies every
    update.
  - ``owner`` (the default): the parameters are laid out once, at construction, in flat
    buckets ordered by owner (:func:`rootopt.distributed.plan.owner_layout`: ROOT matrices
    balanced by Newton–Schulz cost, AdamW parameters, split into pieces where needed, by
    size). Per bucket one reduce-scatter gives each owner the summed gradients of its own
    parameters (with ``average_grads``; under DDP, whose gradients are already averaged,
    it is skipped), the owner updates them — momentum, whole-matrix threshold and
    Newton–Schulz for ROOT, AdamW ZeRO-1 style for the rest — and one all-gather of the
    new parameters, started asynchronously and in flight while the next bucket is
    updated (``overlap``; a step has at least ``OVERLAP_GROUPS`` buckets), brings every
    rank up to date. With ``sync_in_backward`` the reduce-scatters start from gradient
    hooks during backward instead, bucket by bucket in one fixed order, as DDP's
    all-reduce does (:class:`_BackwardSync`). The design moves DDP AdamW's bytes (Moonlight, arXiv
    2502.16982 §2.3), a constant number of collectives per step, and momentum / AdamW
    moments only on their owner. ``state_dict()`` gathers them (a collective: call it on
    every rank), so checkpoints hold the full state and load at any world size and in
    either design. Every rank hashes its layout at construction and compares it with the
    others' (one line on a mismatch instead of mismatched collectives).
* **sharded** (``DTensor`` with ``Shard(0)`` on a 1-D mesh; FSDP2's ``fully_shard``):
  momentum and AdamW state stay sharded like the parameter. Per round, one
  ``all_to_all_single`` moves each matrix's shards to its owner (exact split sizes; empty
  shards send zero bytes but still join the collective), the owner rebuilds the whole
  matrix, thresholds and orthogonalizes it, and a second ``all_to_all_single`` returns
  the update as shards. With ``fsdp_design="gram"`` a matrix larger than a rank's share
  goes as slabs of its long side to several ranks of one node instead, which find its
  exact quantile and run the plain iteration together (:mod:`rootopt.distributed.split`;
  docs/distributed.md, "Split matrices").

Owners balance Newton–Schulz cost, not matrix count (:mod:`rootopt.distributed.owners`). State is
created eagerly for every parameter, is identical (replicated) or identically placed
(sharded) on every rank and never depends on ownership (``owner``: its state dict does
not), so checkpoints load at any world size. At world size 1 with plain tensors
:meth:`DistributedROOT.step` *is* :meth:`rootopt.ROOT.step`. The numerics follow
:mod:`rootopt.optim.functional` (paper, arXiv 2511.20626): momentum, the owners' stacked
threshold + orthogonalization, robust scaling, decay and step and the AdamW part are the
functions :class:`rootopt.ROOT` calls; this class only assigns owners and moves tensors. ``tests/test_paths.py`` compares it with
the per-matrix reference at world sizes 1 and 2, replicated and sharded.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from rootopt.distributed.group import (
    PendingCollective,
    blocked_seconds,
    collective,
    collective_timeout_s,
    start_collective,
    world,
)
from rootopt.distributed.owners import assign_owners, chunk_rows, ns_cost
from rootopt.distributed.plan import (
    OVERLAP_GROUPS,
    Bucket,
    LayoutItem,
    OwnerLayout,
    cut_rounds,
    owner_layout,
    owner_rounds,
    round_order,
)
from rootopt.distributed.split import (
    slab_axis,
    slab_bounds,
    slab_pieces,
    split_abs_quantile,
    split_count,
    split_newton_schulz,
)
from rootopt.optim._coefficients import coefficients_for, group_matrices
from rootopt.optim._finite import finite_flags
from rootopt.optim._options import DTYPES, ns_dtype_name, root_options
from rootopt.optim.adamw import adamw_
from rootopt.optim.functional import (
    THRESHOLD_EPS,
    Matrix,
    MatrixView,
    _directions,
    _robust,
    apply_,
    matrices,
    matrix_view,
    momentum_,
    robust_moments_,
)
from rootopt.optim.root import (
    DEFAULT_BUCKET_BYTES,
    ROOT,
    NonFiniteGradientError,
    algorithm_of,
    state_dtype,
)
from rootopt.ortho.newton_schulz import FOLD_DTYPES

DDP_DESIGNS = ("gather", "owner")
FSDP_DESIGNS = ("whole", "gram")


def _dtensor_types() -> tuple[type, type] | None:
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # pragma: no cover - torch builds without distributed
        return None
    return DTensor, Shard


def _is_dtensor(t: object) -> bool:
    types = _dtensor_types()
    return types is not None and isinstance(t, types[0])


def _local(t: Tensor) -> Tensor:
    """The local tensor of a DTensor (shares storage under no_grad); ``t`` otherwise."""
    if _is_dtensor(t):
        return cast(Tensor, t.to_local())  # type: ignore[attr-defined]
    return t


@dataclass
class StepStats:
    """What one rank did in the last step: Newton–Schulz work and bytes moved."""

    ns_matrices: int = 0  # matrices thresholded + orthogonalized on this rank
    ns_cost: float = 0.0  # their estimated multiply-adds (owners.ns_cost)
    ns_seconds: float = 0.0  # NaN on the plain single-process step (not timed apart)
    # blocked in this step's collectives: issuing them and waiting for them (compute they
    # overlap not included; group.blocked_seconds), and the whole step's wall time (a
    # closure's forward/backward included)
    comm_seconds: float = 0.0
    seconds: float = 0.0
    bytes_sent: int = 0  # per rank, payload only (collective algorithms add their own)
    bytes_received: int = 0
    collectives: dict[str, int] = field(default_factory=dict)
    # owner design: buckets updated while the all-gather of an earlier one was in flight
    overlapped: int = 0
    # owner design with sync_in_backward: buckets whose reduce-scatter started during
    # backward (the others started when the step began)
    in_backward: int = 0

    def count(self, op: str, sent: int, received: int) -> None:
        self.collectives[op] = self.collectives.get(op, 0) + 1
        self.bytes_sent += sent
        self.bytes_received += received


@dataclass
class _Task:
    """One ROOT parameter in one step."""

    group: dict[str, Any]
    gi: int
    pi: int  # index in the group (for ns_split)
    p: Tensor
    name: str
    view: MatrixView
    mats: list[Matrix]  # the view's matrices, or a fused weight's blocks
    v: Tensor  # the vector to orthogonalize: the whole tensor (replicated) or the local shard
    cost: float
    splits: list[int] = field(default_factory=list)  # rows per rank (sharded only)

    @property
    def scale(self) -> float:
        """The step's ``s`` for the update an owner returns (blocks carry their own)."""
        return self.mats[0].scale if self.mats[0].block is None else 1.0

    @property
    def numel(self) -> int:
        return self.view.batch * self.view.rows * self.view.cols

    @property
    def rest(self) -> int:
        return self.numel // max(int(self.p.shape[0]), 1)


@dataclass
class _Unit:
    """What one owner receives of a sharded task: the whole matrix (``k == 1``) or slab
    ``j`` of ``k`` along its long side (``fsdp_design="gram"``; split.py). ``counts[s]``:
    elements of it rank ``s`` holds (and sends); ``ti``: the task's position in the step
    (the order split matrices run in on every rank)."""

    task: _Task
    j: int
    k: int
    counts: list[int]
    cost: float
    ti: int = 0
    # the slab along the long side (split.slab_axis / slab_bounds), set once
    axis: int = field(init=False, default=0)
    lo: int = field(init=False, default=0)
    hi: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.split:
            rows, cols = int(self.task.p.shape[0]), int(self.task.p.shape[1])
            self.axis = slab_axis(rows, cols)
            self.lo, self.hi = slab_bounds(rows, cols, self.k)[self.j]

    @property
    def split(self) -> bool:
        return self.k > 1

    def _rows(self, rank: int) -> tuple[int, int, int]:
        """``rank``'s shard: its first row, and the rows of it inside a row slab
        (``[a, b)``, empty when ``b <= a``)."""
        n, r0 = self.task.splits[rank], sum(self.task.splits[:rank])
        return r0, max(r0, self.lo), min(r0 + n, self.hi)

    def piece(self, x: Tensor, rank: int) -> Tensor:
        """This unit's part of ``x``, a tensor shaped like ``rank``'s shard, flat."""
        if not self.split:
            return x.reshape(-1)
        x = x.reshape(self.task.splits[rank], int(self.task.p.shape[1]))
        if self.axis == 0:  # rows of the shard inside the slab
            r0, a, b = self._rows(rank)
            return x[a - r0 : max(a, b) - r0].reshape(-1)
        return x[:, self.lo : self.hi].reshape(-1)

    def rebuild(self, pieces: list[Tensor]) -> Tensor:
        """The whole matrix (shaped like the parameter) or the slab (``hi - lo`` rows of a
        tall matrix, ``hi - lo`` columns of a wide one) from every rank's piece."""
        flat = torch.cat(pieces)
        if not self.split:
            return flat.reshape(self.task.p.shape)
        if self.axis == 0:
            return flat.reshape(self.hi - self.lo, int(self.task.p.shape[1]))
        return flat.reshape(int(self.task.p.shape[0]), self.hi - self.lo)

    def back(self, U: Tensor, rank: int) -> Tensor:
        """The owner's result for rank ``rank``: the rows of its shard (whole) or their
        part of the slab, flat."""
        n, r0 = self.task.splits[rank], sum(self.task.splits[:rank])
        if not self.split:
            return U.reshape(self.task.p.shape)[r0 : r0 + n].reshape(-1)
        if self.axis == 0:
            _, a, b = self._rows(rank)
            return U[a - self.lo : max(a, b) - self.lo].reshape(-1)
        return U[r0 : r0 + n].reshape(-1)


def _assemble(t: _Task, parts: list[tuple[_Unit, Tensor]], rank: int) -> Tensor:
    """A task's update on ``rank``'s shard from the pieces its units' owners sent back."""
    if len(parts) == 1 and not parts[0][0].split:
        return parts[0][1]
    parts = sorted(parts, key=lambda x: x[0].j)
    if parts[0][0].axis == 0:
        return torch.cat([x for _, x in parts])
    n = t.splits[rank]
    return torch.cat([x.reshape(n, u.hi - u.lo) for u, x in parts], dim=1).reshape(-1)


@dataclass
class _BackwardSync:
    """The owner design's reduce-scatters started from gradient hooks
    (``DistributedROOT(sync_in_backward=True)``), for one layout.

    Bucket ``k`` starts when every parameter in it has had its gradient accumulated in
    this backward (``have[k] == need[k]``) *and* buckets ``0 .. k-1`` have started: one
    fixed order on every rank, so the ranks issue the same collectives in the same
    sequence however their backward passes interleave. The layout lists buckets in reverse
    optimizer order (:func:`~rootopt.distributed.plan.owner_layout`), about the order
    backward produces the gradients, so the first buckets start while backward still runs.
    What has not started when the step begins (a parameter without a gradient on this
    rank, one that does not require grad) starts then, before any other collective."""

    layout: OwnerLayout
    rank: int
    flat: list[tuple[int, int, Tensor]]  # DistributedROOT._flat() for this layout
    need: list[frozenset[int]]  # per bucket: the parameters (optimizer positions) in it
    buckets_of: dict[int, list[int]]  # parameter position -> the buckets holding it
    have: list[set[int]] = field(default_factory=list)
    started: dict[int, Callable[[], Tensor]] = field(default_factory=dict)
    next: int = 0  # the first bucket not started
    in_backward: int = 0  # of ``started``: started from a hook
    muted: int = 0  # > 0 inside ``no_sync()``
    late: str = ""  # a parameter whose gradient grew after its bucket had started

    def __post_init__(self) -> None:
        self.have = [set() for _ in self.need]

    def reset(self) -> None:
        """Forget this step's buckets (what started is waited for by the caller)."""
        self.have = [set() for _ in self.need]
        self.started.clear()
        self.next = 0
        self.in_backward = 0
        self.late = ""


def _on_grad(ref: weakref.ReferenceType[Any], index: int, _p: Tensor) -> None:
    """The post-accumulate-grad hook of one parameter (holds the optimizer weakly)."""
    opt = ref()
    if opt is not None:
        opt._grad_ready(index)


class DistributedROOT(ROOT):
    """:class:`rootopt.ROOT` whose Newton–Schulz work is spread over the ranks of a
    process group (docs/distributed.md).

    Args:
        params, **kwargs: as :class:`rootopt.ROOT`.
        process_group: the group to work in (default: the default group; none started →
            the plain single-process step).
        bucket_bytes: bounds the extra memory of a step (default 32 MiB): the bytes of
            one ``owner`` bucket; of whole float32 matrices in one ``gather`` round; of
            whole float32 matrices one owner receives in one FSDP2 round
            (:func:`~rootopt.distributed.plan.owner_rounds`).
        average_grads: all-reduce and average the gradients of plain (non-DTensor)
            parameters here (``owner``: reduce-scatter them to their owners); leave False
            when the model is wrapped in DDP (which already averages them).
        ddp_design: how plain (replicated) parameters are updated across ranks:
            ``"owner"`` (default: gradients reduce-scattered to owners, new parameters
            all-gathered, momentum on owners only; with ``average_grads=True`` and no DDP
            wrapper it moves DDP AdamW's bytes) or ``"gather"`` (all-reduced gradients,
            owners' updates all-gathered, state on every rank). docs/distributed.md
            compares them.
        overlap: ``owner`` design: cut the step into at least ``OVERLAP_GROUPS`` buckets
            and start each bucket's all-gather asynchronously, so that it is in flight
            while the next bucket is updated (default True; False: one all-gather after
            each bucket's update, waited for at once).
        fsdp_design: how sharded (FSDP2) matrices are orthogonalized: ``"whole"``
            (default: each on one owner) or ``"gram"`` (a 2-D matrix larger than a rank's
            share of all parameters is held as slabs of its long side by up to
            ``gpus_per_node`` ranks of one node, which run the exact quantile and the
            plain Newton–Schulz iteration together, all-reducing the Gram matrix;
            docs/distributed.md, "Split matrices"). Needs the device mesh to span every
            process.
        gpus_per_node: ranks per node for ``gram``'s holder sets (consecutive ranks);
            default ``LOCAL_WORLD_SIZE`` (torchrun sets it), else the world size.
        sync_in_backward: ``owner`` design with ``average_grads=True`` only: start each
            bucket's gradient reduce-scatter from gradient hooks during backward, as soon
            as every parameter of the bucket has its gradient (buckets in one fixed order
            on every rank), so that it runs behind the rest of backward as DDP's
            all-reduce does; the step waits for them (default False). A bucket's
            gradients are read when it starts: a change made to them after backward
            (clipping, unscaling) is not seen. To accumulate gradients over several
            backward passes, run all but the last inside ``with opt.no_sync():``; a
            gradient that grows after its bucket started makes the step stop with one
            line and update nothing. docs/distributed.md, "Reduce-scatter in backward".

    ``self.stats`` (:class:`StepStats`) describes this rank's last step.
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        average_grads: bool = False,
        ddp_design: str = "owner",
        overlap: bool = True,
        fsdp_design: str = "whole",
        gpus_per_node: int | None = None,
        sync_in_backward: bool = False,
        **kwargs: Any,
    ) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"Invalid bucket_bytes: {bucket_bytes!r} (must be an integer >= 1)")
        if not isinstance(average_grads, bool):
            raise ValueError(f"Invalid average_grads: {average_grads!r} (must be True or False)")
        if not isinstance(overlap, bool):
            raise ValueError(f"Invalid overlap: {overlap!r} (must be True or False)")
        if ddp_design not in DDP_DESIGNS:
            raise ValueError(
                f"Invalid ddp_design: {ddp_design!r} (choose {' or '.join(DDP_DESIGNS)})"
            )
        if fsdp_design not in FSDP_DESIGNS:
            raise ValueError(
                f"Invalid fsdp_design: {fsdp_design!r} (choose {' or '.join(FSDP_DESIGNS)})"
            )
        if gpus_per_node is not None and (
            isinstance(gpus_per_node, bool)
            or not isinstance(gpus_per_node, int)
            or gpus_per_node < 1
        ):
            raise ValueError(f"Invalid gpus_per_node: {gpus_per_node!r} (must be an integer >= 1)")
        if not isinstance(sync_in_backward, bool):
            raise ValueError(
                f"Invalid sync_in_backward: {sync_in_backward!r} (must be True or False)"
            )
        if sync_in_backward and not (ddp_design == "owner" and average_grads):
            raise ValueError(
                "Invalid sync_in_backward: True needs ddp_design='owner' and "
                "average_grads=True (otherwise the optimizer reduces no gradients)"
            )
        self.process_group = process_group
        self.bucket_bytes = bucket_bytes
        self.average_grads = average_grads
        self.ddp_design = ddp_design
        self.overlap = overlap
        self.fsdp_design = fsdp_design
        self.gpus_per_node = gpus_per_node
        self.sync_in_backward = sync_in_backward
        self._bsync: _BackwardSync | None = None
        self._hooks: list[Any] = []  # post-accumulate-grad hook handles (sync_in_backward)
        # gram: one process group per set of holders (new_group is collective over every
        # process; created in one order on every rank, kept for the optimizer's life)
        self._holder_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self.stats = StepStats()
        self._layout: OwnerLayout | None = None
        self._ready = False
        super().__init__(params, **kwargs)
        self._ready = True
        self._check_gram_mesh()
        if ddp_design == "owner":
            self._plan_owners()

    # ----------------------------------------------------------------------------------
    # eager state: every parameter has its full state before the first step, so that
    # torch.distributed.checkpoint never sees a partly created state
    # ----------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        before = len(self.param_groups)
        super().add_param_group(param_group)
        for group in self.param_groups[before:]:
            for p in group["params"]:
                if group["robust_scaling"] and _is_dtensor(p) and algorithm_of(group, p) == "root":
                    raise ValueError(
                        "robust_scaling is not supported for sharded (FSDP2) parameters; "
                        "turn it off or use DDP"
                    )
                self._init_state(group, p)  # ROOT's own: the same dtypes and keys
        if self._ready:
            self._check_gram_mesh()
        if self._ready and self.ddp_design == "owner":
            self._plan_owners()  # ownership may move: gather the state, plan, keep own

    # ----------------------------------------------------------------------------------
    # step
    # ----------------------------------------------------------------------------------
    def _sharded_any(self) -> bool:
        return any(_is_dtensor(p) for g in self.param_groups for p in g["params"])

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimization step across the process group (``closure`` re-evaluates
        the loss). With no group, or one rank and plain tensors: ROOT's own step."""
        start, blocked = time.perf_counter(), blocked_seconds()
        info = world(self.process_group)
        self.stats = StepStats()
        if info.world_size == 1 and not self._sharded_any():
            self._count_plain()
            self.stats.ns_seconds = float("nan")
            out = super().step(closure)
            self.stats.seconds = time.perf_counter() - start
            return out
        if self.telemetry_enabled:
            raise ValueError(
                "telemetry=True is not supported by DistributedROOT across ranks; "
                "turn it off (each owner sees only its own matrices)"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        owner = self._owner_on(info.world_size)
        try:
            # sync_in_backward: what backward did not start, before anything else
            late = self._start_rest(info.world_size) if owner else ""
            per_group = self._collect_dist(info.rank, info.world_size, late)
            if owner:
                self._step_owner(per_group, info.rank, info.world_size)
                per_group = [[e for e in entries if _is_dtensor(e[1])] for entries in per_group]
        finally:
            if self._bsync is not None:  # consumed by the update, or dropped on an error
                self._bsync.reset()
        replicated: list[_Task] = []
        sharded: list[_Task] = []
        for gi, (group, entries) in enumerate(zip(self.param_groups, per_group)):
            adamw = [e for e in entries if algorithm_of(group, e[1]) == "adamw"]
            root = [e for e in entries if algorithm_of(group, e[1]) == "root"]
            if adamw:
                self._adamw_local(group, adamw)
            if not root:
                continue
            vs = self._momentum_local(group, root)
            o = root_options(group, _local(root[0][1]).device, float(group["lr"]))
            splits = group.get("ns_split")
            for (pi, p, name, _), v in zip(root, vs):
                view = matrix_view(p.shape, group["nd_view"])
                mats = matrices(view, o, splits[pi] if splits else None)
                cost = sum(ns_cost(m.batch, m.rows, m.cols, group["ns_steps"]) for m in mats)
                task = _Task(group, gi, pi, p, name, view, mats, v, cost)
                (sharded if _is_dtensor(p) else replicated).append(task)
        if replicated:
            self._root_replicated(replicated, info.rank, info.world_size)
        if sharded:
            self._root_sharded(sharded)
        self.stats.comm_seconds = blocked_seconds() - blocked
        self.stats.seconds = time.perf_counter() - start
        return loss

    def _count_plain(self) -> None:
        for group in self.param_groups:
            for pi, p in enumerate(group["params"]):
                if algorithm_of(group, p) == "root" and p.grad is not None and p.numel() > 0:
                    for m in group_matrices(group, pi, p):
                        self.stats.ns_matrices += m.batch
                        self.stats.ns_cost += ns_cost(m.batch, m.rows, m.cols, group["ns_steps"])

    def _collect_dist(
        self, rank: int, world_size: int, late: str = ""
    ) -> list[list[tuple[int, Tensor, str, Tensor]]]:
        """Per group: ``(index, param, name, local gradient)`` of the parameters every rank will
        update. One all-reduce (MAX) of two flags per parameter makes the decision the
        same everywhere: a parameter with a gradient on any rank is updated on all ranks
        (a rank without one contributes zeros, so no rank skips a collective), and a
        NaN/Inf gradient on any rank is handled as ``nonfinite`` says on all of them.
        ``late`` (``sync_in_backward``): a parameter whose gradient grew after its bucket
        had started on this rank; carried in the same all-reduce (the first "has a
        gradient" flag set to 2), so that every rank refuses the step together."""
        entries: list[tuple[int, int, Tensor, str]] = []
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.numel() == 0:
                    continue
                name = self._name(gi, group, pi)
                g = p.grad
                if g is not None and g.is_sparse:
                    raise RuntimeError(f"ROOT does not support sparse gradients ({name})")
                if g is not None and g.is_complex():
                    raise RuntimeError(f"ROOT does not support complex gradients ({name})")
                entries.append((gi, pi, p, name))
        self.skipped = []
        per_group: list[list[tuple[int, Tensor, str, Tensor]]] = [[] for _ in self.param_groups]
        if not entries:
            return per_group
        dev = _local(entries[0][2]).device
        flags = torch.zeros(len(entries), 2, dtype=torch.int32, device=dev)
        has_grad = [p.grad is not None for _, _, p, _ in entries]
        flags[:, 0] = torch.tensor(has_grad, device=dev)
        if late:
            flags[0, 0] = 2
        held = [i for i, h in enumerate(has_grad) if h]  # positions, not a mask: no sync
        grads = [cast(Tensor, entries[i][2].grad) for i in held]
        if grads:  # ROOT's own check (one read of each gradient; optim/_finite.py)
            nonfinite = (~finite_flags([_local(g) for g in grads])).to(dev, torch.int32)
            if len(held) == len(entries):
                flags[:, 1] = nonfinite
            else:
                flags[held, 1] = nonfinite
        if world_size > 1:
            nbytes = flags.numel() * flags.element_size()
            collective(
                "all_reduce gradient flags",
                dist.all_reduce,
                flags,
                op=dist.ReduceOp.MAX,
                group=self.process_group,
            )
            self.stats.count("all_reduce", nbytes, nbytes)
        has, bad = flags[:, 0].tolist(), flags[:, 1].tolist()  # the one host sync
        if has[0] >= 2:
            raise ValueError(
                f"the gradient of {late or 'a parameter on another rank'} grew after its "
                "bucket's reduce-scatter had started (sync_in_backward): run every backward "
                "but the last of an accumulation inside `with opt.no_sync():`; nothing was "
                "updated"
            )
        bad_names = [e[3] for e, b in zip(entries, bad) if b]
        if bad_names and self.nonfinite == "error":
            more = f" (and {len(bad_names) - 1} more)" if len(bad_names) > 1 else ""
            raise NonFiniteGradientError(
                f"non-finite gradient (NaN/Inf) in parameter {bad_names[0]}{more}; "
                "nothing was updated"
            )
        self.skipped = bad_names
        active = [e for e, h, b in zip(entries, has, bad) if h and not b]
        if self.average_grads and world_size > 1 and not self._owner_on(world_size):
            self._average_grads([p for _, _, p, _ in active if not _is_dtensor(p)], world_size)
        for gi, pi, p, name in active:
            g = _local(p.grad) if p.grad is not None else torch.zeros_like(_local(p))
            per_group[gi].append((pi, p, name, g))
        return per_group

    def _average_grads(self, params: list[Tensor], world_size: int) -> None:
        """Sum-all-reduce the gradients (zeros where a rank has none) in buckets of
        ``bucket_bytes`` and divide by the world size: the mean over the global batch
        when every rank's loss is the mean over its equal share."""
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket: list[Tensor] = []
        size = 0

        def flush() -> None:
            nonlocal bucket, size
            if not bucket:
                return
            flat = torch.cat([g.reshape(-1).float() for g in bucket])
            collective("all_reduce gradients", dist.all_reduce, flat, group=self.process_group)
            nbytes = flat.numel() * 4
            self.stats.count("all_reduce", nbytes, nbytes)
            flat.div_(world_size)
            off = 0
            for g in bucket:
                g.copy_(flat[off : off + g.numel()].view_as(g))
                off += g.numel()
            bucket, size = [], 0

        for p in params:
            g = cast(Tensor, p.grad)
            if size and size + g.numel() * 4 > self.bucket_bytes:
                flush()
            bucket.append(g)
            size += g.numel() * 4
        flush()

    # ----------------------------------------------------------------------------------
    # the math, on local tensors (shards under FSDP2): ROOT's own functions
    # ----------------------------------------------------------------------------------
    def _adamw_local(
        self, group: dict[str, Any], entries: list[tuple[int, Tensor, str, Tensor]]
    ) -> None:
        states = [self.state[p] for _, p, _, _ in entries]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1)
        adamw_(
            [_local(p) for _, p, _, _ in entries], [g for *_, g in entries],
            [_local(s["exp_avg"]) for s in states], [_local(s["exp_avg_sq"]) for s in states],
            steps, lr=float(group["lr"]), betas=group["adamw_betas"], eps=group["adamw_eps"],
            weight_decay=group["weight_decay"],
        )  # fmt: skip

    def _momentum_local(
        self, group: dict[str, Any], entries: list[tuple[int, Tensor, str, Tensor]]
    ) -> list[Tensor]:
        """Momentum (and robust moments) of the local tensors; returns the local part of
        each vector to orthogonalize."""
        states = [self.state[p] for _, p, _, _ in entries]
        torch._foreach_add_([s["step"] for s in states], 1)
        bufs = [_local(s["momentum_buffer"]) for s in states]
        grads = [g.to(b.dtype) for (*_, g), b in zip(entries, bufs)]
        if group["robust_scaling"]:
            robust_moments_(
                [s["robust_mean"] for s in states], [s["robust_sq"] for s in states], grads,
                window=group["robust_window"],
            )  # fmt: skip
        return momentum_(bufs, grads, momentum=group["momentum"], nesterov=group["nesterov"])

    def _orthogonalize(self, tasks: list[_Task], full: list[Tensor]) -> list[Tensor]:
        """Threshold + orthogonalize whole matrices (this rank owns them), stacked as
        ROOT's batched path stacks them, one group at a time; returns each task's update
        (shaped like the parameter; a fused weight's block scales folded in)."""
        start = time.perf_counter()
        out: list[Tensor | None] = [None] * len(tasks)
        by_group: dict[int, list[int]] = {}
        for i, t in enumerate(tasks):
            by_group.setdefault(t.gi, []).append(i)
        for idx in by_group.values():
            group = tasks[idx[0]].group
            device = full[idx[0]].device
            splits = group.get("ns_split")

            def whole(
                new: list[int], _: list[Tensor | None], idx: list[int] = idx
            ) -> tuple[list[Tensor], bool]:
                return [full[idx[j]] for j in new], False  # not private: stacks copy them

            updates = _directions(
                [tasks[i].p.shape for i in idx], [full[i].dtype for i in idx],
                root_options(group, device, float(group["lr"])),
                coefficients_for(self._coeffs, group, device), whole, device=device,
                blocks=[splits[tasks[i].pi] for i in idx] if splits else None,
            )  # fmt: skip
            for done, Us, _ in updates:
                for j, U in zip(done, Us):
                    out[idx[j]] = U
        for t in tasks:
            self.stats.ns_matrices += sum(m.batch for m in t.mats)
            self.stats.ns_cost += t.cost
        self.stats.ns_seconds += time.perf_counter() - start
        return [cast(Tensor, u) for u in out]

    def _apply_local(self, tasks: list[_Task], Us: list[Tensor]) -> None:
        """Robust scaling (replicated only), decoupled decay and the scaled step on the
        local tensors, one :func:`apply_` call per group; ``Us``: the local parts."""
        by_group: dict[int, list[int]] = {}
        for i, t in enumerate(tasks):
            by_group.setdefault(t.gi, []).append(i)
        for idx in by_group.values():
            group = tasks[idx[0]].group
            o = root_options(group, _local(tasks[idx[0]].p).device, float(group["lr"]))
            updates = []
            for i in idx:
                t, U = tasks[i], Us[i].reshape(_local(tasks[i].p).shape)
                if group["robust_scaling"]:
                    st = self.state[t.p]
                    U = _robust(U, st["robust_mean"], st["robust_sq"], st["step"], o)
                updates.append(U)
            apply_(
                [_local(tasks[i].p) for i in idx], updates, lr=o.lr,
                weight_decay=o.weight_decay, scales=[tasks[i].scale for i in idx],
            )  # fmt: skip

    def _rounds(self, tasks: list[_Task]) -> list[list[_Task]]:
        """The ``gather`` design's rounds: tasks in :func:`~rootopt.distributed.plan.round_order`
        (shape, then position) cut into runs of at most ``bucket_bytes`` of whole float32
        matrices (at least one per round) by :func:`~rootopt.distributed.plan.cut_rounds`,
        as the cost model cuts them."""
        order = round_order([(t.view.rows, t.view.cols) for t in tasks])
        runs = cut_rounds([4 * tasks[i].numel for i in order], self.bucket_bytes)
        return [[tasks[order[j]] for j in run] for run in runs]

    def _root_replicated(self, tasks: list[_Task], rank: int, world_size: int) -> None:
        """Owners orthogonalize; ``all_gather_single`` of the updates, one per round;
        every rank applies every update to its full copy. Rounds run one after another:
        with two gloo collectives in flight at once, ranks were seen to abort
        ("terminate called without an active exception"), so nothing overlaps yet."""
        loads = [0.0] * world_size
        dev = _local(tasks[0].p).device
        for rnd in self._rounds(tasks):
            owners = assign_owners([t.cost for t in rnd], world_size, loads)
            sizes = [0] * world_size
            for t, o in zip(rnd, owners):
                sizes[o] += t.numel
            width = max(sizes)
            mine = [t for t, o in zip(rnd, owners) if o == rank]
            Us = self._orthogonalize(mine, [t.v for t in mine])
            send = torch.zeros(width, dtype=torch.float32, device=dev)
            off = 0
            for t, U in zip(mine, Us):
                send[off : off + t.numel] = U.reshape(-1)
                off += t.numel
            recv = torch.empty(width * world_size, dtype=torch.float32, device=dev)
            work = start_collective(
                "all_gather ROOT updates", _all_gather_fn, recv, send, group=self.process_group
            )
            self.stats.count("all_gather", 4 * width, 4 * width * (world_size - 1))
            self._finish_gather(work, recv, rnd, owners, width, world_size)

    def _finish_gather(
        self,
        work: PendingCollective,
        recv: Tensor,
        rnd: list[_Task],
        owners: list[int],
        width: int,
        world_size: int,
    ) -> None:
        work.wait()
        offs = [q * width for q in range(world_size)]
        Us = []
        for t, o in zip(rnd, owners):
            Us.append(recv[offs[o] : offs[o] + t.numel])
            offs[o] += t.numel
        self._apply_local(rnd, Us)

    def _root_sharded(self, tasks: list[_Task]) -> None:
        """FSDP2 parameters: shards → owner (all_to_all_single), whole-matrix threshold +
        orthogonalization on the owner, update → shards (all_to_all_single); one pair of
        all-to-alls per round of :func:`~rootopt.distributed.plan.owner_rounds`."""
        types = _dtensor_types()
        assert types is not None
        _, Shard = types
        mesh = tasks[0].p.device_mesh  # type: ignore[attr-defined]
        for t in tasks:
            pm = t.p.device_mesh  # type: ignore[attr-defined]
            if pm.ndim != 1 or tuple(t.p.placements) != (Shard(0),):  # type: ignore[attr-defined]
                raise ValueError(
                    f"{t.name}: DistributedROOT supports DTensor parameters sharded as "
                    f"Shard(0) on a 1-D mesh (FSDP2's default); got placements "
                    f"{tuple(t.p.placements)} on a {pm.ndim}-D mesh"  # type: ignore[attr-defined]
                )
            if pm != mesh:
                raise ValueError(f"{t.name}: all sharded parameters must share one device mesh")
        group = mesh.get_group()
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        for t in tasks:
            t.splits = chunk_rows(int(t.p.shape[0]), world_size)
            if t.v.shape[0] != t.splits[rank]:
                raise ValueError(
                    f"{t.name}: local shard has {t.v.shape[0]} rows, expected "
                    f"{t.splits[rank]} (dim 0 split like torch.chunk)"
                )
        dev = _local(tasks[0].p).device
        units = self._units(tasks, world_size)
        # owners over the whole step, rounds cut by the bytes each owner receives
        # (plan.owner_rounds: at a world size no smaller than the number of matrices, one
        # round, so no round waits for another's busiest rank); a split matrix's slabs on
        # distinct ranks of one node, all in one round
        rounds = owner_rounds(
            [u.cost for u in units],
            [4 * sum(u.counts) for u in units],
            [(u.task.view.rows, u.task.view.cols) for u in units],
            world_size,
            self.bucket_bytes,
            [u.ti if u.split else -1 for u in units],
            self._node_size(world_size),
        )
        holders: dict[int, list[int]] = {}  # split task -> its holders
        for rnd in rounds:
            for ui, o in rnd:
                if units[ui].split:
                    holders.setdefault(units[ui].ti, []).append(o)
        groups = self._holder_process_groups(group, holders)
        for rnd in rounds:
            by_owner: list[list[_Unit]] = [[] for _ in range(world_size)]
            for ui, o in rnd:
                by_owner[o].append(units[ui])
            mine = by_owner[rank]
            # shards → owners: to rank d, my piece of every matrix or slab d owns
            in_splits = [sum(u.counts[rank] for u in by_owner[d]) for d in range(world_size)]
            out_splits = [sum(u.counts[s] for u in mine) for s in range(world_size)]
            parts = [u.piece(u.task.v, rank) for d in range(world_size) for u in by_owner[d]]
            send = torch.cat(parts) if parts else torch.zeros(0, device=dev)
            recv = torch.empty(sum(out_splits), dtype=torch.float32, device=dev)
            collective(
                "all_to_all momentum shards to owners",
                dist.all_to_all_single,
                recv,
                send.float(),
                out_splits,
                in_splits,
                group=group,
            )
            self.stats.count(
                "all_to_all",
                4 * (sum(in_splits) - in_splits[rank]),
                4 * (sum(out_splits) - out_splits[rank]),
            )
            # rebuild each owned matrix or slab from the W pieces (exact sizes: no padding)
            pieces: list[list[Tensor]] = [[] for _ in mine]
            off = 0
            for s in range(world_size):
                for j, u in enumerate(mine):
                    n = u.counts[s]
                    pieces[j].append(recv[off : off + n])
                    off += n
            built = [u.rebuild(pc) for pc, u in zip(pieces, mine)]
            Us: list[Tensor | None] = [None] * len(mine)
            # slabs first, one split matrix after another in task order on every rank
            # (their holders wait for each other; one global order rules out a deadlock
            # between overlapping holder sets), then the whole matrices
            for j in sorted((j for j, u in enumerate(mine) if u.split), key=lambda j: mine[j].ti):
                Us[j] = self._orthogonalize_slab(mine[j], built[j], groups[mine[j].ti])
            whole = [j for j, u in enumerate(mine) if not u.split]
            done = self._orthogonalize([mine[j].task for j in whole], [built[j] for j in whole])
            for j, Uw in zip(whole, done):
                Us[j] = Uw
            # updates → shards: to rank s, its part of every matrix or slab I own, in the
            # dtype the round's updates are exact in (every rank computes the same one)
            back_dtype = _update_dtype([units[ui].task for ui, _ in rnd], dev)
            back: list[Tensor] = []
            for s in range(world_size):
                for u, Uo in zip(mine, Us):
                    back.append(u.back(cast(Tensor, Uo), s).to(back_dtype))
            send2 = torch.cat(back) if back else torch.zeros(0, dtype=back_dtype, device=dev)
            recv2 = torch.empty(sum(in_splits), dtype=back_dtype, device=dev)
            work = start_collective(
                "all_to_all ROOT updates to shards",
                dist.all_to_all_single,
                recv2,
                send2,
                in_splits,
                out_splits,
                group=group,
            )
            e = recv2.element_size()
            self.stats.count(
                "all_to_all",
                e * (sum(out_splits) - out_splits[rank]),
                e * (sum(in_splits) - in_splits[rank]),
            )
            self._finish_scatter(work, recv2, by_owner, rank)

    # ----------------------------------------------------------------------------------
    # split matrices (fsdp_design="gram"; split.py, docs/distributed.md "Split matrices")
    # ----------------------------------------------------------------------------------
    def _node_size(self, world_size: int) -> int:
        if self.gpus_per_node is not None:
            return min(self.gpus_per_node, world_size)
        return max(1, min(world(self.process_group).local_world_size, world_size))

    def _splittable(self, t: _Task) -> bool:
        """Only the plain iteration of one 2-D matrix is split: not a fused weight's
        blocks, a 3-D stack, SVD/QR, or a Newton–Schulz dtype that does not fold its norm
        into the Gram matrix (float16)."""
        g = t.group
        splits = g.get("ns_split")
        return (
            t.p.ndim == 2
            and len(t.mats) == 1
            and t.mats[0].block is None
            and not (splits and splits[t.pi])
            and g["ortho_method"] == "newton_schulz"
            and DTYPES[ns_dtype_name(g["ns_dtype"], _local(t.p).device)] in FOLD_DTYPES
        )

    def _units(self, tasks: list[_Task], world_size: int) -> list[_Unit]:
        """Each task whole, or (``gram``) its slabs when it is larger than a rank's share
        (:func:`~rootopt.distributed.split.split_count`, as the cost model splits)."""
        gram = self.fsdp_design == "gram"
        total = sum(p.numel() for g in self.param_groups for p in g["params"]) if gram else 0
        node = self._node_size(world_size)
        units: list[_Unit] = []
        for ti, t in enumerate(tasks):
            rows, cols = int(t.p.shape[0]), int(t.p.shape[-1])
            k = 1
            if gram and self._splittable(t):
                k = split_count(t.numel, max(rows, cols), total, world_size, node)
            if k == 1:
                units.append(_Unit(t, 0, 1, [n * t.rest for n in t.splits], t.cost, ti))
                continue
            cost = ns_cost(1, rows, cols, int(t.group["ns_steps"]), k)
            for j, counts in enumerate(slab_pieces(rows, cols, t.splits, k)):
                units.append(_Unit(t, j, k, counts, cost, ti))
        return units

    def _check_gram_mesh(self) -> None:
        """``gram`` creates process groups of holders with ``new_group``, which every
        process must join: refuse, before any step, a mesh that leaves processes out."""
        if self.fsdp_design != "gram" or not (dist.is_available() and dist.is_initialized()):
            return
        for group in self.param_groups:
            for p in group["params"]:
                if _is_dtensor(p):
                    size = p.device_mesh.size()  # type: ignore[attr-defined]
                    if size != dist.get_world_size():
                        raise ValueError(
                            f"fsdp_design='gram' needs the device mesh to span every process "
                            f"(mesh of {size}, world of {dist.get_world_size()}); use "
                            "fsdp_design='whole'"
                        )

    def _holder_process_groups(
        self, mesh_group: dist.ProcessGroup, holders: dict[int, list[int]]
    ) -> dict[int, dist.ProcessGroup]:
        """Each split task's process group of its holders (mesh ranks), created where
        missing: on every rank, in sorted order (``new_group`` is collective over every
        process)."""
        sets = {ti: tuple(sorted(h)) for ti, h in holders.items()}
        for hs in sorted(set(sets.values()) - set(self._holder_groups)):
            ranks = [dist.get_global_rank(mesh_group, r) for r in hs]
            pg = dist.new_group(
                ranks=ranks, timeout=datetime.timedelta(seconds=collective_timeout_s())
            )
            self._holder_groups[hs] = cast(dist.ProcessGroup, pg)
        return {ti: self._holder_groups[hs] for ti, hs in sets.items()}

    def _orthogonalize_slab(self, u: _Unit, slab: Tensor, pg: dist.ProcessGroup) -> Tensor:
        """Threshold + plain Newton–Schulz of this rank's slab of a split matrix, together
        with its other holders: the exact whole-matrix quantile
        (:func:`~rootopt.distributed.split.split_abs_quantile`) and the iteration on the
        wide orientation's column slabs (:func:`~rootopt.distributed.split.split_newton_schulz`).
        Returns the slab of ``U`` (before the step scale, as ``_orthogonalize``)."""
        start = time.perf_counter()
        t = u.task
        group = t.group
        dev = slab.device
        o = root_options(group, dev, float(group["lr"]))
        rows, cols = int(t.p.shape[0]), int(t.p.shape[1])

        def count(op: str, nbytes: int) -> None:
            self.stats.count(op, nbytes, nbytes)

        if o.quantile is not None:
            eps = split_abs_quantile(slab, o.quantile, pg, total=rows * cols, count=count)
            e = float(eps.add_(THRESHOLD_EPS).item()) if dev.type == "cpu" else None
            slab = slab.clamp_(-e, e) if e is not None else slab.clamp_(min=-eps, max=eps)
        sched = coefficients_for(self._coeffs, group, dev)(rows, cols)
        tall = u.axis == 0
        X = slab.mT if tall else slab
        U = split_newton_schulz(X, sched, dtype=o.ns_dtype, group=pg, count=count)
        self.stats.ns_matrices += 1
        self.stats.ns_cost += u.cost
        self.stats.ns_seconds += time.perf_counter() - start
        return U.mT.contiguous() if tall else U

    def _finish_scatter(
        self,
        work: PendingCollective,
        recv2: Tensor,
        by_owner: list[list[_Unit]],
        rank: int,
    ) -> None:
        work.wait()
        if recv2.dtype != torch.float32:  # the updates as the single-process step applies them
            recv2 = recv2.float()
        off = 0
        got: dict[int, tuple[_Task, list[tuple[_Unit, Tensor]]]] = {}
        for units in by_owner:
            for u in units:
                n = u.counts[rank]
                got.setdefault(id(u.task), (u.task, []))[1].append((u, recv2[off : off + n]))
                off += n
        done = [t for t, _ in got.values()]
        self._apply_local(done, [_assemble(t, parts, rank) for t, parts in got.values()])

    # ----------------------------------------------------------------------------------
    # the owner design: reduce-scatter → owner update → all-gather of parameters; with
    # sync_in_backward the reduce-scatters start from gradient hooks (_BackwardSync)
    # ----------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """As ROOT's, without the gradient hooks and the started buckets
        (``sync_in_backward``): they belong to this optimizer's parameters and process
        group; a copy starts every bucket with its step until it is planned again."""
        out = super().__getstate__()
        out["_bsync"], out["_hooks"] = None, []
        return out

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Like ``DistributedDataParallel.no_sync``: backward passes inside the block
        accumulate gradients without starting any reduce-scatter (``sync_in_backward``);
        the next backward outside it starts them with the accumulated gradients. Without
        ``sync_in_backward`` it does nothing, so a loop may use it either way."""
        s = self._bsync
        if s is None:
            yield
            return
        s.muted += 1
        try:
            yield
        finally:
            s.muted -= 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As :meth:`torch.optim.Optimizer.zero_grad`. With ``sync_in_backward``, a
        backward that ran since the last step (a hook saw a gradient) had its step skipped:
        its remaining buckets are started and every one waited for, as the step would
        have (the ranks issue the same collectives whichever of them started early), and
        the sums are dropped."""
        s = self._bsync
        if s is not None:
            if s.started or any(s.have):
                self._start_ready(final=True)
            pending = list(s.started.values())
            s.reset()
            for finish in pending:
                finish()
        super().zero_grad(set_to_none=set_to_none)

    def _arm_backward(self, layout: OwnerLayout | None, rank: int) -> None:
        """(Re)register the gradient hooks of ``layout``'s parameters (sync_in_backward)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._bsync = None
        if layout is None or not self.sync_in_backward:
            return
        flat = self._flat()
        need = [frozenset(layout.items[i].index for i in b.items) for b in layout.buckets]
        buckets_of: dict[int, list[int]] = {}
        for k, ids in enumerate(need):
            for i in sorted(ids):
                buckets_of.setdefault(i, []).append(k)
        ref = weakref.ref(self)
        for i in buckets_of:
            p = flat[i][2]
            if p.requires_grad:  # the others' buckets start with the step
                hook = functools.partial(_on_grad, ref, i)
                handle = p.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
                self._hooks.append(handle)
        self._bsync = _BackwardSync(layout, rank, flat, need, buckets_of)

    def _grad_ready(self, index: int) -> None:
        """Parameter ``index`` has its gradient for this backward: start every bucket that
        is now complete and next in order."""
        s = self._bsync
        if s is None or s.muted:
            return
        for k in s.buckets_of.get(index, ()):
            if k < s.next:
                if not s.late:
                    gi, pi, _ = s.flat[index]
                    s.late = self._name(gi, self.param_groups[gi], pi)
            else:
                s.have[k].add(index)
        with torch.no_grad():
            self._start_ready(final=False)

    def _start_ready(self, final: bool) -> None:
        """Start buckets in order while the next one is complete (``final``: all that are
        left, with the gradients there are; a missing one counts as zeros)."""
        s = self._bsync
        if s is None:
            return
        layout = s.layout
        while s.next < len(layout.buckets) and (
            final or len(s.have[s.next]) == len(s.need[s.next])
        ):
            k = s.next
            s.started[k] = self._start_owned_sum(
                layout, layout.buckets[k], s.flat, lambda i: s.flat[i][2].grad, s.rank
            )
            s.next += 1
            if not final:
                s.in_backward += 1

    def _start_rest(self, world_size: int) -> str:
        """At the start of the step: start every bucket backward did not; returns the
        name of a parameter whose gradient grew after its bucket had started ("" if
        none; the step refuses it on every rank, :meth:`_collect_dist`)."""
        s = self._bsync
        if s is None:
            return ""
        if s.layout.world != world_size:  # a new group: what started belongs to the old one
            self._plan_owners()
            return ""
        self.stats.in_backward = s.in_backward
        self._start_ready(final=True)
        return s.late

    @property
    def owner_layout(self) -> OwnerLayout | None:
        """The owner design's buckets and owners (None in the gather design or at world
        size 1)."""
        return self._layout

    def _owner_on(self, world_size: int) -> bool:
        """The owner design applies to plain parameters when there is more than one rank."""
        return self.ddp_design == "owner" and world_size > 1

    def _flat(self) -> list[tuple[int, int, Tensor]]:
        """``(group index, index in group, parameter)`` in the optimizer's order: the
        position is the parameter's index in :meth:`state_dict`."""
        return [
            (gi, pi, p)
            for gi, g in enumerate(self.param_groups)
            for pi, p in enumerate(g["params"])
        ]

    def _owner_items(self) -> list[LayoutItem]:
        """The plain parameters with elements, as the layout sees them: ROOT matrices with
        their Newton–Schulz cost (a fused weight's blocks summed), AdamW parameters with
        none; ``key``: dtype and device (one flat buffer holds one of each)."""
        items = []
        for index, (gi, pi, p) in enumerate(self._flat()):
            if _is_dtensor(p) or p.numel() == 0:
                continue
            group = self.param_groups[gi]
            root = algorithm_of(group, p) == "root"
            cost = 0.0
            if root:
                o = root_options(group, p.device, float(group["lr"]))
                splits = group.get("ns_split")
                mats = matrices(
                    matrix_view(p.shape, group["nd_view"]), o, splits[pi] if splits else None
                )
                cost = sum(ns_cost(m.batch, m.rows, m.cols, group["ns_steps"]) for m in mats)
            key = f"{str(p.dtype).removeprefix('torch.')}@{p.device.type}"
            items.append(
                LayoutItem(
                    index, self._name(gi, group, pi), p.numel(), cost, root, key, p.element_size()
                )
            )
        return items

    def _plan_owners(self) -> None:
        """Lay the plain parameters out in owner buckets, check that every rank has the
        same layout, and keep momentum / AdamW moments only where they are owned. A layout
        that changes (a new parameter group) first gathers the state it had spread."""
        info = world(self.process_group)
        if not self._owner_on(info.world_size):
            self._arm_backward(None, info.rank)
            return
        items = self._owner_items()
        if not items:
            self._layout = None
            self._arm_backward(None, info.rank)
            return
        if self._layout is not None:
            full = self._gather_state()
            flat = self._flat()
            for index, st in full.items():
                self.state[flat[index][2]].update(st)
        groups = OVERLAP_GROUPS if self.overlap else 1
        layout = owner_layout(items, info.world_size, self.bucket_bytes, groups)
        self._check_plan(layout, info.rank, info.world_size)
        self._layout = layout
        self._prune_state(info.rank)
        self._arm_backward(layout, info.rank)

    def _check_plan(self, layout: OwnerLayout, rank: int, world_size: int) -> None:
        """All-gather every rank's layout digest; on any difference every rank stops with
        one line (different layouts would issue collectives of different sizes: a hang or
        garbage)."""
        # sync_in_backward changes where the reduce-scatters are issued: part of the plan
        mode = f"{layout.digest()} sync_in_backward={self.sync_in_backward}"
        digest = hashlib.sha256(mode.encode()).hexdigest()
        raw = bytes.fromhex(digest)
        dev = self._flat()[layout.items[0].index][2].device
        words = torch.tensor(
            [int.from_bytes(raw[i : i + 8], "big", signed=True) for i in range(0, 32, 8)],
            dtype=torch.int64,
            device=dev,
        )
        out = torch.empty(4 * world_size, dtype=torch.int64, device=dev)
        collective(
            "all_gather owner plan digests", dist.all_gather_into_tensor, out, words,
            group=self.process_group,
        )  # fmt: skip
        rows = out.view(world_size, 4).tolist()
        differ = [r for r in range(world_size) if rows[r] != rows[rank]]
        if differ:
            raise ValueError(
                f"rank {rank}/{world_size}: the owner plan (digest {digest[:12]}) differs from "
                f"that of rank{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))}; "
                "build DistributedROOT with the same parameters (names, shapes, dtypes), "
                "groups, bucket_bytes, overlap and sync_in_backward on every rank"
            )

    def _prune_state(self, rank: int) -> None:
        layout = self._layout
        if layout is None:
            return
        flat = self._flat()
        mine: dict[int, LayoutItem] = {}
        for it, o in zip(layout.items, layout.owner):
            if o == rank:
                mine[it.index] = it
        for index in dict.fromkeys(it.index for it in layout.items):
            gi, _, p = flat[index]
            st, piece = self.state[p], mine.get(index)
            for key in _state_keys(self.param_groups[gi], p):
                if piece is None:
                    st.pop(key, None)
                elif piece.numel != p.numel() and st[key].numel() == p.numel():
                    st[key] = st[key].reshape(-1)[piece.start : piece.start + piece.numel].clone()

    def _backend(self) -> str:
        return str(dist.get_backend(self.process_group))

    def _gather_flat(
        self, send: Tensor, segments: Sequence[int], rank: int, world_size: int, name: str
    ) -> Tensor:
        """Every rank's segment, concatenated in rank order (waited for)."""
        out, work = self._start_gather_flat(send, segments, rank, world_size, name)
        work.wait()
        return out

    def _start_gather_flat(
        self, send: Tensor, segments: Sequence[int], rank: int, world_size: int, name: str
    ) -> tuple[Tensor, PendingCollective]:
        """Start gathering every rank's segment, concatenated in rank order:
        ``all_gather_into_tensor`` when the segments are equal; otherwise NCCL's uneven
        ``all_gather`` or, on gloo (which has none), an ``all_to_all_single`` that sends the
        segment to every rank. ``out`` is valid after ``wait()``."""
        total = sum(segments)
        out = torch.empty(total, dtype=send.dtype, device=send.device)
        e = send.element_size()
        seg = segments[rank]
        group = self.process_group
        if len(set(segments)) == 1:
            work = start_collective(name, dist.all_gather_into_tensor, out, send, group=group)
            self.stats.count("all_gather", e * seg * (world_size - 1), e * seg * (world_size - 1))
        elif self._backend() == "gloo":
            inp = send.repeat(world_size)
            work = start_collective(
                name, dist.all_to_all_single, out, inp, list(segments), [seg] * world_size,
                group=group,
            )  # fmt: skip
            work.keep = (inp,)
            self.stats.count("all_to_all", e * seg * (world_size - 1), e * (total - seg))
        else:
            work = start_collective(
                name, dist.all_gather, list(out.split_with_sizes(list(segments))), send,
                group=group,
            )  # fmt: skip
            self.stats.count("all_gather", e * seg * (world_size - 1), e * (total - seg))
        work.keep += (send,)  # read by the collective until it completes
        return out, work

    def _start_reduce_scatter_flat(
        self, flat: Tensor, segments: Sequence[int], rank: int, world_size: int
    ) -> Callable[[], Tensor]:
        """Start reducing every rank's ``flat`` to this rank's segment of the sum; returns
        what waits and gives that segment divided by the world size (the mean gradient).
        ``reduce_scatter_tensor`` when the segments are equal, the uneven
        ``reduce_scatter`` otherwise (NCCL); on gloo, whose reduce-scatter all-reduces the
        whole input (docs/distributed.md, "Cost model"), an ``all_to_all_single`` of the
        segments and a local sum. The bytes are counted when it is waited for (the step's
        own statistics)."""
        seg = segments[rank]
        e = flat.element_size()
        name = "reduce_scatter gradients to owners"
        group = self.process_group
        gloo = self._backend() == "gloo"
        if gloo:
            out = torch.empty(world_size * seg, dtype=flat.dtype, device=flat.device)
            work = start_collective(
                name, dist.all_to_all_single, out, flat, [seg] * world_size, list(segments),
                group=group,
            )  # fmt: skip
            counted = ("all_to_all", e * (flat.numel() - seg), e * seg * (world_size - 1))
        else:
            out = torch.empty(seg, dtype=flat.dtype, device=flat.device)
            if len(set(segments)) == 1:
                work = start_collective(name, dist.reduce_scatter_tensor, out, flat, group=group)
            else:
                work = start_collective(
                    name, dist.reduce_scatter, out, list(flat.split_with_sizes(list(segments))),
                    group=group,
                )  # fmt: skip
            counted = ("reduce_scatter", e * (flat.numel() - seg), e * (flat.numel() - seg))
        work.keep = (flat,)  # read by the collective until it completes

        def finish() -> Tensor:
            work.wait()
            self.stats.count(*counted)
            summed = out.view(world_size, seg).sum(0) if gloo else out
            return summed.div_(world_size)

        return finish

    def _start_owned_sum(
        self,
        layout: OwnerLayout,
        b: Bucket,
        flat: list[tuple[int, int, Tensor]],
        grad_of: Callable[[int], Tensor | None],
        rank: int,
    ) -> Callable[[], Tensor]:
        """Copy bucket ``b``'s gradients (``grad_of(optimizer position)``; None: zeros)
        into one flat buffer in owner order and start its reduce-scatter."""
        items, params, _, _ = _bucket_view(layout, b, flat, rank)
        buf = torch.zeros(b.numel, dtype=params[0].dtype, device=params[0].device)
        for it, off in zip(items, b.offsets):
            g = grad_of(it.index)
            if g is not None:
                buf[off : off + it.numel].copy_(g.reshape(-1)[it.start : it.start + it.numel])
        return self._start_reduce_scatter_flat(buf, b.segments, rank, layout.world)

    def _step_owner(
        self,
        per_group: list[list[tuple[int, Tensor, str, Tensor]]],
        rank: int,
        world_size: int,
    ) -> None:
        """The owner design for every plain parameter: every bucket's reduce-scatter of the
        gradients first (``average_grads``), then per bucket the owner's update of its
        parameters with ROOT's own functions and one all-gather of the new parameters.

        The reduce-scatters come first because each is a collective every rank joins:
        between two buckets' updates it would make every rank wait for the previous
        bucket's busiest rank, and the Newton–Schulz on the step's path would be the sum
        over buckets of each one's busiest rank instead of about the busiest rank's total
        (docs/distributed.md, "The step's path"). Their summed segments (1/W of the
        gradients) are held until the updates use them."""
        if self._layout is None or self._layout.world != world_size:
            self._plan_owners()
        layout = self._layout
        if layout is None:
            return
        flat = self._flat()
        index_of = {(gi, pi): i for i, (gi, pi, _) in enumerate(flat)}
        grads: dict[int, tuple[str, Tensor]] = {}
        for gi, entries in enumerate(per_group):
            for pi, p, name, g in entries:
                if not _is_dtensor(p):
                    grads[index_of[(gi, pi)]] = (name, g)
        # every rank counts the step of every updated parameter; an owner (of the parameter
        # or of one piece of it: at most one per rank) does it in the update itself
        owns = {it.index for it, o in zip(layout.items, layout.owner) if o == rank}
        others = [self.state[flat[i][2]]["step"] for i in grads if i not in owns]
        if others:
            torch._foreach_add_(others, 1)
        owned = [
            self._owned_grads(layout, k, b, flat, grads, rank) for k, b in enumerate(layout.buckets)
        ]
        # overlap: the all-gather of bucket k is in flight while bucket k + 1 is updated and
        # orthogonalized; at most two are in flight (the memory the cost model plans for),
        # and the step ends when the last one has arrived
        pending: list[Callable[[], None]] = []
        for b, mine in zip(layout.buckets, owned):
            if pending:
                self.stats.overlapped += 1
            finish = self._owner_bucket(layout, b, flat, grads, mine, rank, world_size)
            if not self.overlap:
                finish()
                continue
            pending.append(finish)
            if len(pending) > 1:
                pending.pop(0)()
        for finish in pending:
            finish()

    def _owned_grads(
        self,
        layout: OwnerLayout,
        k: int,
        b: Bucket,
        flat: list[tuple[int, int, Tensor]],
        grads: dict[int, tuple[str, Tensor]],
        rank: int,
    ) -> dict[int, Tensor]:
        """The averaged gradient of every item of bucket ``b`` this rank owns (by position
        in the bucket): one reduce-scatter with ``average_grads``, else the local gradient
        (already averaged by DDP). With ``sync_in_backward`` the reduce-scatter of bucket
        ``k`` started earlier (:class:`_BackwardSync`) and is waited for here; the
        gradients it carries of parameters the step skips (non-finite) are not used."""
        items, _, start, mine = _bucket_view(layout, b, flat, rank)
        owned: dict[int, Tensor] = {}  # item position in the bucket -> its summed gradient
        if self.average_grads:
            early = self._bsync.started.pop(k, None) if self._bsync is not None else None
            if early is None:
                early = self._start_owned_sum(
                    layout, b, flat, lambda i: grads[i][1] if i in grads else None, rank
                )
            summed = early()
            for j in mine:
                if items[j].index in grads:
                    off = b.offsets[j] - start
                    owned[j] = summed[off : off + items[j].numel]
        else:  # already averaged (DDP): the owner's own copy is the summed gradient / W
            owned = {
                j: grads[items[j].index][1].reshape(-1)[items[j].start :][: items[j].numel]
                for j in mine
                if items[j].index in grads
            }
        return owned

    def _owner_bucket(
        self,
        layout: OwnerLayout,
        b: Bucket,
        flat: list[tuple[int, int, Tensor]],
        grads: dict[int, tuple[str, Tensor]],
        owned: dict[int, Tensor],
        rank: int,
        world_size: int,
    ) -> Callable[[], None]:
        """Update what this rank owns in bucket ``b`` from its averaged gradients
        ``owned`` (:meth:`_owned_grads`), start the all-gather of the new parameters;
        returns what waits for it and copies them in."""
        items, params, start, mine = _bucket_view(layout, b, flat, rank)
        seg = b.segments[rank]
        dtype, dev = params[0].dtype, params[0].device
        by_group: dict[int, list[tuple[int, Tensor, str, Tensor]]] = {}
        pieces: list[tuple[int, LayoutItem, Tensor]] = []
        for j, g in owned.items():
            gi, pi, p = flat[items[j].index]
            if items[j].numel != p.numel():  # one piece of a split AdamW parameter
                pieces.append((gi, items[j], g))
                continue
            by_group.setdefault(gi, []).append((pi, p, grads[items[j].index][0], g.view_as(p)))
        for gi, it, g in pieces:
            self._adamw_piece(self.param_groups[gi], flat[it.index][2], it, g)
        tasks: list[_Task] = []
        vs: list[Tensor] = []
        for gi, entries in by_group.items():
            group = self.param_groups[gi]
            adamw = [e for e in entries if algorithm_of(group, e[1]) == "adamw"]
            root = [e for e in entries if algorithm_of(group, e[1]) == "root"]
            if adamw:
                self._adamw_local(group, adamw)
            if root:
                vs += self._momentum_local(group, root)
                o = root_options(group, dev, float(group["lr"]))
                splits = group.get("ns_split")
                for pi, p, name, _ in root:
                    view = matrix_view(p.shape, group["nd_view"])
                    mats = matrices(view, o, splits[pi] if splits else None)
                    cost = sum(ns_cost(m.batch, m.rows, m.cols, group["ns_steps"]) for m in mats)
                    tasks.append(_Task(group, gi, pi, p, name, view, mats, p, cost))
        if tasks:
            self._apply_local(tasks, self._orthogonalize(tasks, vs))
        send = torch.empty(seg, dtype=dtype, device=dev)
        for j in mine:
            off, it = b.offsets[j] - start, items[j]
            send[off : off + it.numel].copy_(params[j].reshape(-1)[it.start : it.start + it.numel])
        new, work = self._start_gather_flat(
            send, b.segments, rank, world_size, "all_gather owners' parameters"
        )

        def finish() -> None:
            """Wait for the new parameters of the other owners and copy them in."""
            work.wait()
            for j, (it, off) in enumerate(zip(items, b.offsets)):
                if b.owners[j] != rank:
                    part = new[off : off + it.numel]
                    if it.numel == params[j].numel():  # whole (any memory layout)
                        params[j].copy_(part.view(params[j].shape))
                    else:  # an AdamW piece of a contiguous parameter
                        params[j].view(-1)[it.start : it.start + it.numel].copy_(part)

        return finish

    def _adamw_piece(self, group: dict[str, Any], p: Tensor, it: LayoutItem, g: Tensor) -> None:
        """AdamW on one piece of a split parameter: its owner keeps the moments of the
        piece only (``state[p]["exp_avg"]`` has the piece's elements)."""
        st = self.state[p]
        st["step"] += 1
        adamw_(
            [p.view(-1)[it.start : it.start + it.numel]], [g], [st["exp_avg"]],
            [st["exp_avg_sq"]], [st["step"]], lr=float(group["lr"]), betas=group["adamw_betas"],
            eps=group["adamw_eps"], weight_decay=group["weight_decay"],
        )  # fmt: skip

    def _gather_state(self) -> dict[int, dict[str, Tensor]]:
        """The owner-only state of every parameter this rank does not own, gathered bucket
        by bucket (one all-gather each); keyed by position in the optimizer's order. Not
        counted in :attr:`stats` (not a step)."""
        layout = self._layout
        info = world(self.process_group)
        if layout is None or not self._owner_on(info.world_size):
            return {}
        rank, world_size = info.rank, info.world_size
        flat = self._flat()
        out: dict[int, dict[str, Tensor]] = {}
        step_stats, self.stats = self.stats, StepStats()  # not a step: keep its stats
        try:
            for b in layout.buckets:
                self._gather_bucket_state(layout, b, flat, rank, world_size, out)
        finally:
            self.stats = step_stats
        return out

    def _gather_bucket_state(
        self,
        layout: OwnerLayout,
        b: Bucket,
        flat: list[tuple[int, int, Tensor]],
        rank: int,
        world_size: int,
        out: dict[int, dict[str, Tensor]],
    ) -> None:
        items, params, _, _ = _bucket_view(layout, b, flat, rank)
        keys = [
            _state_keys(self.param_groups[flat[it.index][0]], p) for it, p in zip(items, params)
        ]
        sizes = [it.numel * len(k) for it, k in zip(items, keys)]
        segments = [0] * world_size
        for o, n in zip(b.owners, sizes):
            segments[o] += n
        dtype = state_dtype(params[0])
        send = torch.empty(segments[rank], dtype=dtype, device=params[0].device)
        off = 0
        for j, o in enumerate(b.owners):
            if o == rank:
                for key in keys[j]:
                    send[off : off + items[j].numel].copy_(self.state[params[j]][key].reshape(-1))
                    off += items[j].numel
        full = self._gather_flat(send, segments, rank, world_size, "all_gather owners' state")
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

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict; in the owner design with the state of every parameter
        gathered from its owner (a collective: call it on every rank), so that it is the
        same on every rank and loads at any world size."""
        sd = super().state_dict()
        full = self._gather_state()
        if full:
            sd["state"] = {k: dict(v) for k, v in sd["state"].items()}
            for index, st in full.items():
                sd["state"].setdefault(index, {}).update(st)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """ROOT's load; in the owner design each rank then keeps the state it owns."""
        super().load_state_dict(state_dict)
        if self._owner_on(world(self.process_group).world_size):
            if self._layout is None:
                self._plan_owners()
            else:
                self._prune_state(world(self.process_group).rank)


def _bucket_view(
    layout: OwnerLayout, b: Bucket, flat: list[tuple[int, int, Tensor]], rank: int
) -> tuple[list[LayoutItem], list[Tensor], int, list[int]]:
    """Bucket ``b``'s items and their parameters in buffer order, where ``rank``'s segment
    starts, and the positions of the items ``rank`` owns."""
    items = [layout.items[i] for i in b.items]
    params = [flat[it.index][2] for it in items]
    mine = [j for j, o in enumerate(b.owners) if o == rank]
    return items, params, b.segment_start(rank), mine


def _update_dtype(tasks: Sequence[_Task], device: torch.device) -> torch.dtype:
    """The dtype the updates ``U`` of ``tasks`` are exact in: the Newton–Schulz dtype when
    every one of them is a Newton–Schulz iterate in bfloat16 or float16 (``root_direction``
    returns the iteration dtype; ``_directions`` may cast it up to float32, which a cast
    back undoes exactly) and no fused weight's block scale is folded in (that product is
    float32); float32 otherwise. Sending the updates in it halves their bytes and changes
    no value (docs/distributed.md, "Sharded parameters")."""
    found: set[torch.dtype] = set()
    for t in tasks:
        g = t.group
        splits = g.get("ns_split")
        if g["ortho_method"] != "newton_schulz" or (splits and splits[t.pi]):
            return torch.float32
        found.add(DTYPES[ns_dtype_name(g["ns_dtype"], device)])
    if len(found) == 1 and (dt := found.pop()) in (torch.bfloat16, torch.float16):
        return dt
    return torch.float32


def _state_keys(group: dict[str, Any], p: Tensor) -> tuple[str, ...]:
    """What ROOT keeps per parameter besides its step count (:meth:`ROOT._init_state`)."""
    if algorithm_of(group, p) == "adamw":
        return ("exp_avg", "exp_avg_sq")
    return (
        ("momentum_buffer", "robust_mean", "robust_sq")
        if group["robust_scaling"]
        else ("momentum_buffer",)
    )


def _all_gather_fn(out: Tensor, inp: Tensor, *, async_op: bool, group: Any) -> Any:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, inp, group=group, async_op=async_op)
