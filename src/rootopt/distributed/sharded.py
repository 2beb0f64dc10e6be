"""The sharded step of :class:`~rootopt.distributed.DistributedROOT`: whole-matrix owners over
all-to-all, for ``DTensor`` parameters sharded ``Shard(0)`` on a 1-D mesh (FSDP2's
``fully_shard``).

Momentum and AdamW state are ``DTensor``s placed like the parameter and stay sharded;
momentum and AdamW run on the local shards. ROOT's threshold is a quantile of the whole
matrix (paper, arXiv 2511.20626), so each matrix gets one owner (by Newton–Schulz cost,
:func:`~rootopt.distributed.layout.owner_rounds`). Per round:

1. ``all_to_all_single``: every rank sends its shard of each matrix's Nesterov vector to
   the matrix's owner (exact split sizes, no padding; an empty shard is a zero-length
   split and its rank still joins);
2. the owner rebuilds each whole matrix, thresholds it at the quantile of its true
   ``rows x cols`` entries and orthogonalizes it (:func:`rootopt.optim.functional._directions`,
   the stacked path ROOT itself runs);
3. ``all_to_all_single``: the owner sends every rank the rows of the update it holds, in
   the dtype the update is exact in (bfloat16 when Newton–Schulz ran in it), and every
   rank applies decay and the scaled step to its shard (:func:`~rootopt.optim.functional.apply_`).

The list form of ``all_to_all`` is avoided: gloo supports only ``all_to_all_single``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from rootopt.distributed.group import collective, start_collective
from rootopt.distributed.layout import owner_rounds
from rootopt.distributed.owners import chunk_rows, ns_cost
from rootopt.optim._coefficients import coefficients_for
from rootopt.optim._options import DTYPES, group_ns_dtype, root_options
from rootopt.optim.adamw import adamw_
from rootopt.optim.functional import (
    Matrix,
    MatrixView,
    _directions,
    apply_,
    matrices,
    matrix_view,
    momentum_,
)
from rootopt.optim.root import algorithm_of

if TYPE_CHECKING:
    from rootopt.distributed.root import DistributedROOT

# (index in group, DTensor parameter, name, local gradient shard)
Local = tuple[int, Tensor, str, Tensor]


def local(t: Tensor) -> Tensor:
    """The local tensor of a DTensor (shares storage under no_grad); ``t`` otherwise."""
    to_local = getattr(t, "to_local", None)
    return cast(Tensor, to_local()) if to_local is not None else t


@dataclass
class _Task:
    """One sharded ROOT parameter in one step."""

    group: dict[str, Any]
    gi: int
    pi: int  # index in the group (for ns_split)
    p: Tensor
    name: str
    view: MatrixView
    mats: list[Matrix]  # the view's matrices, or a fused weight's blocks
    v: Tensor  # this rank's shard of the vector to orthogonalize
    cost: float
    splits: list[int] = field(default_factory=list)  # rows per rank

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

    def counts(self) -> list[int]:
        """Elements of the matrix each rank holds (and sends)."""
        return [n * self.rest for n in self.splits]


def step(opt: DistributedROOT, groups: list[list[Local]]) -> None:
    """One step of the sharded parameters that have gradients (``groups[gi]``: group gi's)."""
    tasks: list[_Task] = []
    for gi, (group, entries) in enumerate(zip(opt.param_groups, groups)):
        if not entries:
            continue
        states = [opt.state[p] for _, p, _, _ in entries]
        torch._foreach_add_([s["step"] for s in states], 1)
        adamw = [e for e in entries if algorithm_of(group, e[1]) == "adamw"]
        root = [e for e in entries if algorithm_of(group, e[1]) == "root"]
        if adamw:
            _adamw(opt, group, adamw)
        if not root:
            continue
        bufs = [local(opt.state[p]["momentum_buffer"]) for _, p, _, _ in root]
        grads = [g.to(b.dtype) for (*_, g), b in zip(root, bufs)]
        vs = momentum_(bufs, grads, momentum=group["momentum"], nesterov=group["nesterov"])
        o = root_options(group, local(root[0][1]).device, float(group["lr"]))
        splits = group.get("ns_split")
        for (pi, p, name, _), v in zip(root, vs):
            view = matrix_view(p.shape, group["nd_view"])
            mats = matrices(view, o, splits[pi] if splits else None)
            cost = sum(ns_cost(m.batch, m.rows, m.cols, group["ns_steps"]) for m in mats)
            tasks.append(_Task(group, gi, pi, p, name, view, mats, v, cost))
    if tasks:
        _orthogonalize_sharded(opt, tasks)


def _adamw(opt: DistributedROOT, group: dict[str, Any], entries: list[Local]) -> None:
    states = [opt.state[p] for _, p, _, _ in entries]
    adamw_(
        [local(p) for _, p, _, _ in entries], [g for *_, g in entries],
        [local(s["exp_avg"]) for s in states], [local(s["exp_avg_sq"]) for s in states],
        [s["step"] for s in states], lr=float(group["lr"]), betas=group["adamw_betas"],
        eps=group["adamw_eps"], weight_decay=group["weight_decay"],
    )  # fmt: skip


def check_placement(tasks: Sequence[tuple[str, Tensor]]) -> Any:
    """The one device mesh of the sharded parameters; refuses anything but ``Shard(0)`` on
    a 1-D mesh (HSDP, tensor parallelism) with one line."""
    from torch.distributed.tensor import Shard

    mesh = tasks[0][1].device_mesh  # type: ignore[attr-defined]
    for name, p in tasks:
        pm = p.device_mesh  # type: ignore[attr-defined]
        if pm.ndim != 1 or tuple(p.placements) != (Shard(0),):  # type: ignore[attr-defined]
            raise ValueError(
                f"{name}: DistributedROOT supports DTensor parameters sharded as "
                f"Shard(0) on a 1-D mesh (FSDP2's default); got placements "
                f"{tuple(p.placements)} on a {pm.ndim}-D mesh"  # type: ignore[attr-defined]
            )
        if pm != mesh:
            raise ValueError(f"{name}: all sharded parameters must share one device mesh")
    return mesh


def _orthogonalize_sharded(opt: DistributedROOT, tasks: list[_Task]) -> None:
    """Shards → owner, whole-matrix threshold + orthogonalization, update → shards: one pair
    of all-to-alls per round of :func:`~rootopt.distributed.layout.owner_rounds`."""
    mesh = check_placement([(t.name, t.p) for t in tasks])
    group = mesh.get_group()
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    for t in tasks:
        t.splits = chunk_rows(int(t.p.shape[0]), world_size)
        if t.v.shape[0] != t.splits[rank]:
            raise ValueError(
                f"{t.name}: local shard has {t.v.shape[0]} rows, expected "
                f"{t.splits[rank]} (dim 0 split like torch.chunk)"
            )
    dev = local(tasks[0].p).device
    # owners over the whole step, rounds cut by the bytes each owner receives: at a world
    # size no smaller than the number of matrices, one round, so no round waits for
    # another's busiest rank
    rounds = owner_rounds(
        [t.cost for t in tasks],
        [4 * t.numel for t in tasks],
        [(t.view.rows, t.view.cols) for t in tasks],
        world_size,
        opt.comm_bucket_bytes,
    )
    stats = opt.stats
    for rnd in rounds:
        by_owner: list[list[_Task]] = [[] for _ in range(world_size)]
        for ti, o in rnd:
            by_owner[o].append(tasks[ti])
        mine = by_owner[rank]
        # shards → owners: to rank d, my shard of every matrix d owns
        in_splits = [sum(t.counts()[rank] for t in by_owner[d]) for d in range(world_size)]
        out_splits = [sum(t.counts()[s] for t in mine) for s in range(world_size)]
        parts = [t.v.reshape(-1) for d in range(world_size) for t in by_owner[d]]
        send = torch.cat(parts) if parts else torch.zeros(0, device=dev)
        recv = torch.empty(sum(out_splits), dtype=torch.float32, device=dev)
        collective(
            "all_to_all momentum shards to owners", dist.all_to_all_single, recv, send.float(),
            out_splits, in_splits, group=group,
        )  # fmt: skip
        stats.count(
            "all_to_all",
            4 * (sum(in_splits) - in_splits[rank]),
            4 * (sum(out_splits) - out_splits[rank]),
        )
        # rebuild each owned matrix from the W shards (exact sizes: no padding)
        pieces: list[list[Tensor]] = [[] for _ in mine]
        off = 0
        for s in range(world_size):
            for j, t in enumerate(mine):
                n = t.counts()[s]
                pieces[j].append(recv[off : off + n])
                off += n
        built = [torch.cat(pc).reshape(t.p.shape) for pc, t in zip(pieces, mine)]
        Us = _orthogonalize(opt, mine, built)
        # updates → shards: to rank s, its rows of every matrix I own, in the dtype the
        # round's updates are exact in (every rank computes the same one)
        back_dtype = update_dtype([tasks[ti] for ti, _ in rnd], dev)
        back: list[Tensor] = []
        for s in range(world_size):
            for t, U in zip(mine, Us):
                r0 = sum(t.splits[:s])
                back.append(U[r0 : r0 + t.splits[s]].reshape(-1).to(back_dtype))
        send2 = torch.cat(back) if back else torch.zeros(0, dtype=back_dtype, device=dev)
        recv2 = torch.empty(sum(in_splits), dtype=back_dtype, device=dev)
        work = start_collective(
            "all_to_all ROOT updates to shards", dist.all_to_all_single, recv2, send2,
            in_splits, out_splits, group=group,
        )  # fmt: skip
        e = recv2.element_size()
        stats.count(
            "all_to_all",
            e * (sum(out_splits) - out_splits[rank]),
            e * (sum(in_splits) - in_splits[rank]),
        )
        work.wait()
        if recv2.dtype != torch.float32:  # the updates as the single-process step applies them
            recv2 = recv2.float()
        got: list[_Task] = []
        updates: list[Tensor] = []
        off = 0
        for ts in by_owner:
            for t in ts:
                n = t.counts()[rank]
                got.append(t)
                updates.append(recv2[off : off + n])
                off += n
        _apply_local(got, updates)


def _orthogonalize(opt: DistributedROOT, tasks: list[_Task], full: list[Tensor]) -> list[Tensor]:
    """Threshold + orthogonalize whole matrices (this rank owns them), stacked as ROOT's
    batched path stacks them, one group at a time; returns each task's update (shaped like
    the parameter; a fused weight's block scales folded in)."""
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
            coefficients_for(opt._coeffs, group, device), whole, device=device,
            blocks=[splits[tasks[i].pi] for i in idx] if splits else None,
        )  # fmt: skip
        for done, Us, _ in updates:
            for j, U in zip(done, Us):
                out[idx[j]] = U
    for t in tasks:
        opt.stats.ns_matrices += sum(m.batch for m in t.mats)
        opt.stats.ns_cost += t.cost
    opt.stats.ns_seconds += time.perf_counter() - start
    return [cast(Tensor, u) for u in out]


def _apply_local(tasks: list[_Task], Us: list[Tensor]) -> None:
    """Decoupled decay and the scaled step on the local shards, one :func:`apply_` call per
    group; ``Us``: the local parts of the updates."""
    by_group: dict[int, list[int]] = {}
    for i, t in enumerate(tasks):
        by_group.setdefault(t.gi, []).append(i)
    for idx in by_group.values():
        group = tasks[idx[0]].group
        o = root_options(group, local(tasks[idx[0]].p).device, float(group["lr"]))
        apply_(
            [local(tasks[i].p) for i in idx],
            [Us[i].reshape(local(tasks[i].p).shape) for i in idx],
            lr=o.lr, weight_decay=o.weight_decay, scales=[tasks[i].scale for i in idx],
        )  # fmt: skip


def update_dtype(tasks: Sequence[_Task], device: torch.device) -> torch.dtype:
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
        found.add(DTYPES[group_ns_dtype(g, device)])
    if len(found) == 1 and (dt := found.pop()) in (torch.bfloat16, torch.float16):
        return dt
    return torch.float32
