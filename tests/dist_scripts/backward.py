"""The owner design's reduce-scatter started in backward (``average_grads=True``) on gloo:
equal to one process and to the same design with every backward inside ``no_sync()`` (all
reduce-scatters with the step); the buckets started from gradient hooks, counted; the same
bytes and collectives, counted over backward + step; a parameter without a gradient on one
rank; gradient accumulation with ``no_sync()``; a gradient accumulated again, or scaled,
after its bucket started refused with one line and nothing updated; a backward discarded by
``zero_grad()``; unscaling and clipping through ``sync_grads`` / ``clip_grad_norm_`` equal to
doing it on one process's gradients; and a rank built with ``average_grads=False`` refused
at construction.

Usage: backward.py OUT_DIR (under torchrun).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from common import HYPER, global_batch, groups, make_model, refused, write
from owner import BATCH, Model
from owner import groups as owner_groups

import rootopt
from rootopt.distributed import DistributedROOT, finish, init_distributed
from rootopt_analysis.counters import CollectiveCounter

STEPS = 3
SMALL_BUCKETS = 2048  # bytes: about one owner.py matrix per bucket, so several start early


def diffs(model: torch.nn.Module, opt: Any, ref: torch.nn.Module, ref_opt: Any) -> dict[str, float]:
    pairs = list(zip(model.parameters(), ref.parameters(), strict=True))
    got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert set(want) <= set(got), (sorted(got), sorted(want))
    return {
        "param_diff": max(float((p - q).abs().max()) for p, q in pairs),
        "state_diff": max(
            float((got[i][k] - v).abs().max()) for i in want for k, v in want[i].items()
        ),
    }


# ---------------------------------------------------------------------------------------
# owner.py's model: parity, buckets started in backward, bytes and collectives
# ---------------------------------------------------------------------------------------
def owner_model(early: bool) -> dict[str, Any]:
    """``early``: plain backward (the hooks start the reduce-scatters); otherwise backward
    inside ``no_sync()``, and every reduce-scatter starts with the step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Model(6)
    opt = DistributedROOT(
        owner_groups(model), **HYPER, average_grads=True, comm_bucket_bytes=SMALL_BUCKETS
    )
    x = torch.randn(BATCH, 48, generator=torch.Generator().manual_seed(1))
    sl = torch.tensor_split(torch.arange(BATCH), world)[rank]
    res: dict[str, Any] = {}
    for _ in range(STEPS):
        opt.zero_grad()
        dist.barrier()
        hold = opt.no_sync() if not early else contextlib.nullcontext()
        with CollectiveCounter() as in_backward, hold:
            model(x[sl]).backward()
        with CollectiveCounter() as in_step:
            opt.step()
        res = {
            "backward_collectives": in_backward.collectives,
            "backward_by_op": in_backward.by_op(),
            "collectives": in_backward.collectives + in_step.collectives,
            "bytes_sent": in_backward.bytes_sent + in_step.bytes_sent,
            "bytes_received": in_backward.bytes_received + in_step.bytes_received,
            "stats_sent": opt.stats.bytes_sent,
            "in_backward": opt.stats.in_backward,
        }
    torch.manual_seed(0)
    ref = Model(6)
    ref_opt = rootopt.ROOT(owner_groups(ref), **HYPER)
    for _ in range(STEPS):
        ref_opt.zero_grad()
        ref(x).backward()
        ref_opt.step()
    res.update(diffs(model, opt, ref, ref_opt))
    res["buckets"] = len(opt.owner_layout.buckets) if opt.owner_layout else 0
    res["params"] = [p.detach().tolist() for p in model.parameters()]
    return res


# ---------------------------------------------------------------------------------------
# common.Net: an unused parameter, one without a gradient on rank 0, accumulation, misuse
# ---------------------------------------------------------------------------------------
def net_loss(model: Any, rank: int, part: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """common.Net's loss, except that rank 0 leaves the embedding out: no gradient there.
    The embedding is alone in the first bucket (the layout's reverse optimizer order, in
    which a submodule's parameters come last), so rank 0 starts every bucket with the
    step while the others start that one in backward: the same collectives, in the same
    order, issued at different times."""
    ids, x, y = part
    if rank != 0:
        return torch.nn.functional.mse_loss(model(ids, x), y)
    h = torch.tanh(x @ model.w4.T)
    h = torch.tanh(h @ model.w1.T + model.b1)
    h = torch.tanh(h @ model.w3[0].T)
    h = torch.tanh(h @ model.w3[1].T)
    return torch.nn.functional.mse_loss((h @ model.w2.T) @ model.w5.T, y)


def net_batches(step: int, micro: int, world: int) -> list[list[tuple[torch.Tensor, ...]]]:
    """Per micro-batch, every rank's part of the global batch."""
    ids, x, y = global_batch(step, 12 * micro)
    out = []
    for m in range(micro):
        sl = slice(12 * m, 12 * (m + 1))
        out.append(
            [
                tuple(t[s] for t in (ids[sl], x[sl], y[sl]))
                for s in torch.tensor_split(torch.arange(12), world)
            ]
        )
    return out


def net_reference(micro: int, world: int, steps: int) -> tuple[Any, Any]:
    """One process: per step the mean over ranks of each rank's loss, per micro-batch,
    gradients summed over micro-batches (what the ranks' averaged gradients are)."""
    model = make_model()
    opt = rootopt.ROOT(groups(model), **HYPER)
    for step in range(steps):
        opt.zero_grad()
        for parts in net_batches(step, micro, world):
            loss = sum(net_loss(model, r, parts[r]) for r in range(world)) / world
            loss.backward()  # type: ignore[union-attr]
        opt.step()
    return model, opt


def net_run(
    micro: int, steps: int, before_step: Callable[[Any, Any, int], None] | None = None
) -> tuple[Any, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    opt = DistributedROOT(groups(model), **HYPER, average_grads=True, comm_bucket_bytes=256)
    for step in range(steps):
        opt.zero_grad()
        if before_step is not None:
            before_step(model, opt, step)
        batches = net_batches(step, micro, world)
        for m, parts in enumerate(batches):
            if m < micro - 1:
                with opt.no_sync():
                    net_loss(model, rank, parts[rank]).backward()
            else:
                net_loss(model, rank, parts[rank]).backward()
        opt.step()
    return model, opt


def net_cases() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for micro in (1, 2):
        model, opt = net_run(micro, STEPS)
        ref, ref_opt = net_reference(micro, world, STEPS)
        out[f"micro{micro}"] = diffs(model, opt, ref, ref_opt)
        out[f"micro{micro}"]["in_backward"] = opt.stats.in_backward
        out[f"micro{micro}"]["buckets"] = len(opt.owner_layout.buckets)
        out[f"micro{micro}"]["emb_grad"] = model.emb.weight.grad is not None
        out[f"micro{micro}"]["first_bucket"] = [
            opt.owner_layout.items[i].name for i in opt.owner_layout.buckets[0].items
        ]

    # a backward discarded by zero_grad: its buckets started, the step never ran
    def discard(model: Any, opt: Any, step: int) -> None:
        if step == 1:
            parts = net_batches(99, 1, world)[0]
            net_loss(model, rank, parts[rank]).backward()
            opt.zero_grad()

    model, opt = net_run(1, STEPS, discard)
    ref, ref_opt = net_reference(1, world, STEPS)
    out["discarded"] = diffs(model, opt, ref, ref_opt)

    # two backward passes without no_sync, or p.grad scaled after backward (clipping it
    # by hand): refused on every rank, nothing updated, the next step fine
    for case in ("late", "scaled"):
        model = make_model()
        opt = DistributedROOT(groups(model), **HYPER, average_grads=True, comm_bucket_bytes=256)
        parts = net_batches(0, 2, world)
        before = [p.detach().clone() for p in model.parameters()]
        state_before = {k: dict(v) for k, v in opt.state_dict()["state"].items()}
        for m in range(2 if case == "late" else 1):
            net_loss(model, rank, parts[m][rank]).backward()
        if case == "scaled" and rank == world - 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        try:
            opt.step()
            out[case] = ""
        except ValueError as exc:
            out[case] = str(exc)
        out[f"{case}_unchanged"] = all(
            torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True)
        )
        state_after = opt.state_dict()["state"]
        out[f"{case}_state_unchanged"] = all(
            torch.equal(state_after[i][k], v)
            for i, st in state_before.items()
            for k, v in st.items()
        )
        opt.zero_grad()
        net_loss(model, rank, net_batches(0, 1, world)[0][rank]).backward()
        opt.step()
        ref, ref_opt = net_reference(1, world, 1)
        out[f"after_{case}"] = diffs(model, opt, ref, ref_opt)
    out.update(unscale_and_clip())
    return out


def unscale_and_clip() -> dict[str, Any]:
    """A loss scaled by 1024, unscaled by sync_grads(inv_scale=...), clipped by
    clip_grad_norm_: the same update and norm as one process that unscales and clips its
    averaged gradients with torch's clip_grad_norm_ (3 steps, the norm clipped each)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    opt = DistributedROOT(groups(model), **HYPER, average_grads=True, comm_bucket_bytes=256)
    ref = make_model()
    ref_opt = rootopt.ROOT(groups(ref), **HYPER)
    norms, ref_norms = [], []
    for step in range(STEPS):
        parts = net_batches(step, 1, world)[0]
        opt.zero_grad()
        (net_loss(model, rank, parts[rank]) * 1024).backward()
        opt.sync_grads(inv_scale=1 / 1024)
        norms.append(float(opt.clip_grad_norm_(0.01)))
        opt.step()
        ref_opt.zero_grad()
        loss = sum(net_loss(ref, r, parts[r]) for r in range(world)) / world
        loss.backward()  # type: ignore[union-attr]
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)))
        ref_opt.step()
    return {"clipped": {**diffs(model, opt, ref, ref_opt), "norms": norms, "ref_norms": ref_norms}}


def mismatch() -> str:
    """The last rank builds with average_grads=False (it would issue no reduce-scatter): a
    different plan."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    return refused(lambda: DistributedROOT(groups(model), **HYPER, average_grads=rank != world - 1))


def main() -> None:
    init_distributed(backend="gloo", timeout_s=60)
    payload: dict[str, Any] = {"world": dist.get_world_size()}
    payload["early"] = owner_model(True)
    payload["in_step"] = owner_model(False)
    payload.update(net_cases())
    payload["mismatch"] = mismatch()
    t = torch.ones(1)
    dist.all_reduce(t)  # the group still works after the refusal
    payload["after_mismatch"] = float(t)
    write(sys.argv[1], "backward", payload)
    finish(0)


if __name__ == "__main__":
    main()
