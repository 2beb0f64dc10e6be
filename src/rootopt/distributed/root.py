"""ROOT across processes: each matrix is thresholded and orthogonalized by one owner rank
(docs/distributed.md).

:class:`DistributedROOT` is a thin shell over one design per layout of a parameter:

* plain tensors (replicated: DDP-style training, a user's own loop) — the owner design,
  :mod:`rootopt.distributed.replicated`: gradients reduce-scattered to their owners
  (started during backward), the owner's update, the new parameters all-gathered; DDP
  AdamW's bytes;
* ``DTensor`` sharded ``Shard(0)`` on a 1-D mesh (FSDP2) — whole-matrix owners over
  all-to-all, :mod:`rootopt.distributed.sharded`.

Both run ROOT's functional core (:mod:`rootopt.optim.functional`, paper arXiv 2511.20626);
the owner design runs :meth:`rootopt.ROOT._root` itself on what a rank owns. This class
validates, keeps the state eager and owner-independent in its state dict (so checkpoints
load at any world size), and synchronises the gradients: :meth:`sync_grads` finishes the
reduce-scatters, unscales the synchronised gradients and agrees across ranks on which
parameters have gradients, which are non-finite and the global gradient norm, in one
all-reduce; :meth:`clip_grad_norm_` clips them there (ZeRO style), so a training loop needs
no DDP wrapper. At world size 1 with plain tensors :meth:`step` *is*
:meth:`rootopt.ROOT.step` (``tests/test_paths.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from rootopt.distributed import sharded
from rootopt.distributed.flat import StepStats
from rootopt.distributed.group import blocked_seconds, collective, world
from rootopt.distributed.layout import OwnerLayout
from rootopt.distributed.owners import ns_cost
from rootopt.distributed.replicated import Replicated
from rootopt.optim._coefficients import group_matrices
from rootopt.optim._finite import finite_flags
from rootopt.optim._norm import clip_grads_, sum_of_squares
from rootopt.optim.root import DEFAULT_BUCKET_BYTES, ROOT, NonFiniteGradientError, algorithm_of

# Options of earlier releases and what replaced them (one line each when one is passed).
REMOVED = {
    "ddp_design": "the owner design is the one design for plain tensors "
    "(the 'gather' design moved 1.375x DDP AdamW's bytes)",
    "overlap": "buckets are updated one after another (overlapping the all-gather with the "
    "next bucket's update measured no gain)",
    "sync_in_backward": "with average_grads=True the reduce-scatter always starts in "
    "backward; unscale and clip with sync_grads() / clip_grad_norm_()",
    "fsdp_design": "sharded matrices are orthogonalized whole on their owner "
    "(the 'gram' design was 2x slower where measured)",
    "gpus_per_node": "it sized the removed fsdp_design='gram' groups",
}
# Options of earlier releases that have a new name here (one line each when one is passed).
RENAMED = {
    "bucket_bytes": "comm_bucket_bytes=... (the bytes of one communication bucket); ROOT's "
    "stacking budget bucket_bytes is a parameter group option here",
}


@dataclass
class _Synced:
    """One step's synchronised gradients (:meth:`DistributedROOT.sync_grads`)."""

    norm: Tensor  # global L2 norm, the same on every rank
    active: set[int]  # optimizer positions updated on every rank
    bad: list[str]  # parameters with a non-finite gradient on some rank
    owned: dict[int, Tensor]  # replicated: layout position -> averaged gradient (flat)
    shards: dict[int, Tensor]  # sharded: optimizer position -> local gradient shard
    start: float
    blocked: float
    pieces: list[Tensor] = field(default_factory=list)  # every tensor above, once


def _compile_refused(where: str) -> str:
    return (
        f"compile_step is not supported by DistributedROOT {where}: its step runs "
        "collectives between the owners' updates; leave it off (it is ROOT's own step, "
        "compiled, in one process with plain tensors)"
    )


def _is_dtensor(t: object) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch builds without distributed
        return False
    return isinstance(t, DTensor)


class DistributedROOT(ROOT):
    """:class:`rootopt.ROOT` whose Newton–Schulz work is spread over the ranks of a
    process group (docs/distributed.md).

    Args:
        params, **kwargs: as :class:`rootopt.ROOT`.
        process_group: the group to work in (default: the default group; none started →
            the plain single-process step).
        comm_bucket_bytes: bounds the extra memory of a step's communication (default
            32 MiB): the bytes of one owner bucket (plain tensors); of whole float32
            matrices one owner receives in one sharded round. (ROOT's ``bucket_bytes``, the
            stacking budget, is a parameter group option here.)
        average_grads: the optimizer synchronises the gradients of plain parameters:
            reduce-scatters them to their owners, each bucket starting during backward
            once its gradients are complete (no DDP wrapper: DDP AdamW's bytes). Leave
            False when the model is wrapped in DDP, which already averages them (then the
            step moves DDP's all-reduce plus the all-gather, 1.5x). With True, ``p.grad``
            is read when its bucket starts: accumulate with ``with opt.no_sync():`` around
            all but the last backward, and unscale / clip with :meth:`sync_grads` and
            :meth:`clip_grad_norm_`; a gradient changed after its bucket started is
            refused at the step on every rank with one line, nothing updated.
        compile_step: as :class:`rootopt.ROOT` where the step *is* ROOT's (one process,
            plain tensors); refused across ranks and for sharded parameters, whose step runs
            collectives between the owners' updates.

    ``self.stats`` (:class:`~rootopt.distributed.flat.StepStats`) describes this rank's
    last step.
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        process_group: dist.ProcessGroup | None = None,
        comm_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        average_grads: bool = False,
        **kwargs: Any,
    ) -> None:
        for key, why in REMOVED.items():
            if key in kwargs:
                raise ValueError(f"DistributedROOT({key}=...) was removed: {why}")
        for key, new in RENAMED.items():
            if key in kwargs:
                raise ValueError(f"DistributedROOT({key}=...) is now {new}")
        n = comm_bucket_bytes
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"Invalid comm_bucket_bytes: {n!r} (must be an integer >= 1)")
        if not isinstance(average_grads, bool):
            raise ValueError(f"Invalid average_grads: {average_grads!r} (must be True or False)")
        size = world(process_group).world_size
        if kwargs.get("compile_step") and size > 1:
            raise ValueError(_compile_refused(f"at world size {size}"))
        self.process_group = process_group
        self.comm_bucket_bytes = comm_bucket_bytes
        self.average_grads = average_grads
        self.stats = StepStats()
        self._replicated = Replicated(average_grads, comm_bucket_bytes)
        self._synced: _Synced | None = None
        self._ready = False
        super().__init__(params, **kwargs)
        self._ready = True
        self._replicated.lay_out(self)

    # ------------------------------------------------------------- groups and eager state
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """ROOT's, then every parameter's full state is created now (so that
        ``torch.distributed.checkpoint`` never sees a partly created state), and the owner
        layout is laid out again (ownership may move: the state is gathered first)."""
        before = len(self.param_groups)
        super().add_param_group(param_group)
        for group in self.param_groups[before:]:
            for p in group["params"]:
                if group["robust_scaling"] and _is_dtensor(p) and algorithm_of(group, p) == "root":
                    raise ValueError(
                        "robust_scaling is not supported for sharded (FSDP2) parameters; "
                        "turn it off or use DDP"
                    )
                if self.compile_step and _is_dtensor(p):
                    raise ValueError(_compile_refused("for sharded (FSDP2) parameters"))
                self._init_state(group, p)  # ROOT's own: the same dtypes and keys
        if self._ready:
            self._replicated.lay_out(self)

    @property
    def owner_layout(self) -> OwnerLayout | None:
        """The owner design's buckets and owners (None at world size 1)."""
        return self._replicated.layout

    def _flat(self) -> list[tuple[int, int, Tensor]]:
        """``(group index, index in group, parameter)`` in the optimizer's order: the
        position is the parameter's index in :meth:`state_dict`."""
        return [
            (gi, pi, p)
            for gi, g in enumerate(self.param_groups)
            for pi, p in enumerate(g["params"])
        ]

    def _plain_world_one(self) -> bool:
        return world(self.process_group).world_size == 1 and not any(
            _is_dtensor(p) for _, _, p in self._flat()
        )

    # --------------------------------------------------------------- gradient synchronisation
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Like ``DistributedDataParallel.no_sync``: backward passes inside the block
        accumulate gradients without starting any reduce-scatter; the next backward outside
        it starts them with the accumulated gradients. A no-op where the optimizer does not
        synchronise gradients, so a loop may use it either way."""
        bw = self._replicated.backward
        if bw is None:
            yield
            return
        bw.muted += 1
        try:
            yield
        finally:
            bw.muted -= 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As :meth:`torch.optim.Optimizer.zero_grad`, after finishing a backward whose step
        is skipped: its remaining buckets are started and every one waited for (the ranks
        issue the same collectives whichever of them started early), the sums dropped."""
        self._replicated.drain(self)
        self._synced = None
        super().zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def sync_grads(self, *, inv_scale: float | Tensor | None = None) -> Tensor:
        """Synchronise this step's gradients and return their global L2 norm (a float32
        0-d tensor, the same on every rank; non-finite when a gradient is).

        Finishes the reduce-scatters (plain tensors, ``average_grads=True``), multiplies
        the synchronised gradients by ``inv_scale`` (AMP unscaling), and agrees across
        ranks, in one all-reduce, on the parameters that have a gradient, those whose
        gradient is non-finite and the sum of squares. :meth:`step` calls it when the
        caller did not; call it (or :meth:`clip_grad_norm_`) first to unscale or clip."""
        if self._synced is not None:
            if inv_scale is not None:
                raise ValueError(
                    "sync_grads(inv_scale=...): this step's gradients are synchronised already"
                )
            return self._synced.norm
        start, blocked = time.perf_counter(), blocked_seconds()
        self.stats = StepStats()
        info = world(self.process_group)
        flat = self._flat()
        entries = [i for i, (_, _, p) in enumerate(flat) if p.numel() > 0]
        self._check_kinds(flat, entries)
        rep = self._replicated
        owned: dict[int, Tensor] = {}
        if info.world_size > 1:
            if rep.layout is None or rep.layout.world != info.world_size:
                rep.lay_out(self)
            if rep.layout is not None:
                owned = rep.reduce(self, info.rank)
        answered, shards = self._answered(flat, entries, owned, info.world_size)
        pieces = [g for _, g in answered]
        if inv_scale is not None and pieces:
            torch._foreach_mul_(pieces, inv_scale)
        flags, late = self._flags(flat, entries, answered, info.world_size)
        values = self._agree(flags, len(entries), late, info.world_size)
        n = len(entries)
        names = [self._name(flat[i][0], self.param_groups[flat[i][0]], flat[i][1]) for i in entries]
        bad = [names[k] for k in range(n) if values[n + k] > 0]
        active = {i for k, i in enumerate(entries) if values[k] > 0 and values[n + k] == 0}
        norm = flags[2 * n + 1].sqrt().float()
        self._synced = _Synced(norm, active, bad, owned, shards, start, blocked, pieces)
        return norm

    def _check_kinds(self, flat: list[tuple[int, int, Tensor]], entries: list[int]) -> None:
        """ROOT's refusal of sparse and complex gradients, before anything is sent."""
        for i in entries:
            gi, pi, p = flat[i]
            g = p.grad
            if g is not None and (g.is_sparse or g.is_complex()):
                kind = "sparse" if g.is_sparse else "complex"
                name = self._name(gi, self.param_groups[gi], pi)
                raise RuntimeError(f"ROOT does not support {kind} gradients ({name})")

    def _answered(
        self,
        flat: list[tuple[int, int, Tensor]],
        entries: list[int],
        owned: dict[int, Tensor],
        world_size: int,
    ) -> tuple[list[tuple[int, Tensor]], dict[int, Tensor]]:
        """The gradient tensors this rank answers for, by optimizer position: what it owns
        (``owned``, by layout position), its shards, or (one process, plain tensors) every
        gradient; and the shards alone (a zero shard where a sharded parameter has none)."""
        layout = self._replicated.layout
        answered: list[tuple[int, Tensor]] = []
        if layout is not None and world_size > 1:
            answered += [(layout.items[li].index, g) for li, g in owned.items()]
        shards: dict[int, Tensor] = {}
        for i in entries:
            p = flat[i][2]
            if _is_dtensor(p):
                g = p.grad
                shards[i] = (
                    sharded.local(g) if g is not None else torch.zeros_like(sharded.local(p))
                )
                answered.append((i, shards[i]))
            elif world_size == 1 and p.grad is not None:
                answered.append((i, p.grad))
        return answered, shards

    def _flags(
        self,
        flat: list[tuple[int, int, Tensor]],
        entries: list[int],
        answered: list[tuple[int, Tensor]],
        world_size: int,
    ) -> tuple[Tensor, str]:
        """This rank's float64 flags, summed over the ranks by :meth:`_agree`: per entry
        "has a gradient" (n), then "non-finite here" (n), "changed after its reduce-scatter
        started" (1) and the sum of squares of what it answers for (1); and the name of
        the parameter whose gradient changed here ("" if none)."""
        rep = self._replicated
        n = len(entries)
        dev = sharded.local(flat[entries[0]][2]).device if entries else torch.device("cpu")
        flags = torch.zeros(2 * n + 2, dtype=torch.float64, device=dev)
        if n:
            flags[:n] = torch.tensor([flat[i][2].grad is not None for i in entries], device=dev)
        where = {i: k for k, i in enumerate(entries)}
        # checked for NaN/Inf: what this rank answers for; under DDP (gradients not reduced
        # here) every local gradient, so that one rank's bad copy stops every rank
        checked = answered
        if rep.layout is not None and world_size > 1 and not rep.average_grads:
            checked = [(i, g) for i, g in answered if _is_dtensor(flat[i][2])] + [
                (i, cast(Tensor, flat[i][2].grad))
                for i in entries
                if not _is_dtensor(flat[i][2]) and flat[i][2].grad is not None
            ]
        checked = [(i, g) for i, g in checked if g.numel()]
        if checked:
            idx = torch.tensor([n + where[i] for i, _ in checked], device=dev)
            ok = finite_flags([g for _, g in checked])
            flags.index_add_(0, idx, (~ok).to(dev, torch.float64))
        full = [g for _, g in answered if g.numel()]
        if full:
            # in chunks: float32 norms of long tensors are off by up to 1e-4 and depend on
            # where the owned parts are cut (rootopt.optim._norm)
            flags[2 * n + 1] = sum_of_squares(full).to(dev)
        late = rep.changed(self) if world_size > 1 else ""
        flags[2 * n] = float(bool(late))
        return flags, late

    def _agree(self, flags: Tensor, n: int, late: str, world_size: int) -> list[float]:
        """Sum ``flags`` over the ranks (one all-reduce) and read them (the one host
        synchronisation); a gradient changed after its reduce-scatter started on any rank
        is refused on every rank, nothing updated."""
        if world_size > 1:
            nbytes = flags.numel() * flags.element_size()
            collective(
                "all_reduce gradient flags", dist.all_reduce, flags, group=self.process_group
            )
            self.stats.count("all_reduce", nbytes, nbytes)
        values: list[float] = flags[: 2 * n + 1].tolist()
        if values[2 * n] > 0:
            if self._replicated.backward is not None:
                self._replicated.backward.reset()
            raise ValueError(
                f"the gradient of {late or 'a parameter on another rank'} changed after "
                "its bucket's reduce-scatter had started (a second backward outside "
                "`with opt.no_sync():`, or p.grad changed after backward: unscale and clip "
                "with opt.sync_grads(inv_scale=...) / opt.clip_grad_norm_(...)); nothing was "
                "updated"
            )
        return values

    def owned_grads(self) -> list[Tensor]:
        """The synchronised gradients this rank answers for (the parts it owns, its
        shards; one process: every gradient), after :meth:`sync_grads`: scaling them
        scales what the update uses, e.g. for clipping."""
        if self._synced is None:
            self.sync_grads()
        assert self._synced is not None
        return list(self._synced.pieces)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` on the synchronised gradients: the global
        norm from :meth:`sync_grads` (one all-reduce), each rank scaling what it owns by
        ``min(1, max_norm / (norm + 1e-6))``. Returns the norm before clipping."""
        norm = self.sync_grads()
        clip_grads_(self.owned_grads(), max_norm, norm)
        return norm

    # ----------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimization step across the process group (``closure`` re-evaluates
        the loss). With no group, or one rank and plain tensors: ROOT's own step."""
        if self._plain_world_one():
            synced, self._synced = self._synced, None
            start = synced.start if synced is not None else time.perf_counter()
            if synced is None:
                self.stats = StepStats()
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
        if self._synced is None:
            self.sync_grads()
        synced = cast(_Synced, self._synced)
        self._synced = None
        rep = self._replicated
        try:
            if synced.bad and self.nonfinite == "error":
                more = f" (and {len(synced.bad) - 1} more)" if len(synced.bad) > 1 else ""
                raise NonFiniteGradientError(
                    f"non-finite gradient (NaN/Inf) in parameter {synced.bad[0]}{more}; "
                    "nothing was updated"
                )
            self.skipped = synced.bad
            info = world(self.process_group)
            if rep.layout is not None and info.world_size > 1:
                rep.update(self, synced.owned, synced.active, info.rank)
            flat = self._flat()
            local: list[list[sharded.Local]] = [[] for _ in self.param_groups]
            for i, g in synced.shards.items():
                if i in synced.active:
                    gi, pi, p = flat[i]
                    local[gi].append((pi, p, self._name(gi, self.param_groups[gi], pi), g))
            if any(local):
                sharded.step(self, local)
        finally:
            if rep.backward is not None:
                rep.backward.reset()
        self.stats.comm_seconds = blocked_seconds() - synced.blocked
        self.stats.seconds = time.perf_counter() - synced.start
        return loss

    def _count_plain(self) -> None:
        for group in self.param_groups:
            for pi, p in enumerate(group["params"]):
                if algorithm_of(group, p) == "root" and p.grad is not None and p.numel() > 0:
                    for m in group_matrices(group, pi, p):
                        self.stats.ns_matrices += m.batch
                        self.stats.ns_cost += ns_cost(m.batch, m.rows, m.cols, group["ns_steps"])

    # ----------------------------------------------------------------------- state dicts
    def __getstate__(self) -> dict[str, Any]:
        """As ROOT's, without this step's synchronised gradients."""
        out = super().__getstate__()
        out["_synced"] = None
        return out

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict with the state of every parameter gathered from its owner (a
        collective: call it on every rank), so that it is the same on every rank and loads
        at any world size."""
        sd = super().state_dict()
        full = self._replicated.gather_state(self)
        if full:
            sd["state"] = {k: dict(v) for k, v in sd["state"].items()}
            for index, st in full.items():
                sd["state"].setdefault(index, {}).update(st)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """ROOT's load; then each rank keeps the state it owns."""
        super().load_state_dict(state_dict)
        info = world(self.process_group)
        if info.world_size > 1:
            if self._replicated.layout is None:
                self._replicated.lay_out(self)
            else:
                self._replicated.prune_state(self, info.rank)
