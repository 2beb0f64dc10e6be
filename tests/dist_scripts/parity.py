"""Distributed ROOT vs single-process ROOT on the same global batch (under DDP, synchronising
the gradients itself, FSDP2), owner quantiles, NS work per rank, eager state, lr-0 no-op,
missing gradients."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from common import HYPER, global_batch, groups, make_model, refused, write
from torch.distributed.tensor import DTensor, Shard

import rootopt
import rootopt.optim.functional as fn
from rootopt.distributed import DistributedROOT, finish, init_distributed, wrap_model

STEPS = 4
DEVICE = torch.device("cpu")


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def reference(steps: int) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, float]]:
    """Single-process ROOT on the whole global batch; also the per-matrix thresholds."""
    model = make_model()
    opt = rootopt.ROOT(groups(model), telemetry=True, **HYPER)
    eps: dict[str, float] = {}
    for step in range(steps):
        ids, x, y = global_batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(ids, x), y).backward()
        opt.step()
        for name, rec in opt.telemetry.items():
            eps[f"{step}:{name}"] = float(rec["eps"])
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    named = dict(model.named_parameters())
    state = {n: {k: v for k, v in opt.state[p].items()} for n, p in named.items() if opt.state[p]}
    return params, state, eps


def train(mode: str, steps: int, **opt_kw: Any) -> tuple[torch.nn.Module, DistributedROOT]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model().to(DEVICE)
    if mode == "ddp":
        model = wrap_model(model, "ddp", find_unused_parameters=True)
    elif mode == "fsdp":
        model = wrap_model(model, "fsdp")
    inner = model.module if mode == "ddp" and world > 1 else model
    opt = DistributedROOT(groups(inner), **HYPER, **opt_kw)
    for step in range(steps):
        ids, x, y = (t.to(DEVICE) for t in global_batch(step))
        sl = torch.tensor_split(torch.arange(ids.numel()), world)[rank]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(ids[sl], x[sl]), y[sl]).backward()
        opt.step()
    return inner, opt


def max_diff(model: torch.nn.Module, ref: dict[str, torch.Tensor]) -> float:
    named = dict(model.named_parameters())
    assert sorted(named) == sorted(ref), (sorted(named), sorted(ref))
    return max(float((full(named[n]).detach().cpu() - ref[n]).abs().max()) for n in ref)


def full_state(opt: DistributedROOT, model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Every parameter's state by name, from ``state_dict()`` (which gathers the owner
    design's state from the owners; a collective on every rank)."""
    sd = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(params[i])]: st for i, st in sd["state"].items()}


def state_diff(opt: DistributedROOT, model: torch.nn.Module, ref: dict[str, Any]) -> float:
    worst = 0.0
    state = full_state(opt, model)
    for n, _ in model.named_parameters():
        if n not in ref:
            continue
        st = state[n]
        for k, v in ref[n].items():
            if isinstance(v, torch.Tensor):
                worst = max(worst, float((full(st[k]).cpu() - v).abs().max()))
            elif st[k] != v:
                return float("inf")
    return worst


def main() -> None:
    global DEVICE
    out_dir = sys.argv[1]
    backend = sys.argv[2] if len(sys.argv) > 2 else "gloo"
    if backend == "nccl":
        DEVICE = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        # HYPER's float32 iterations on both devices: bfloat16 on one of them would differ
        # by far more than the tolerance
    init_distributed(backend=backend, timeout_s=120)  # type: ignore[arg-type]
    rank, world = dist.get_rank(), dist.get_world_size()
    ref_params, ref_state, ref_eps = reference(STEPS)
    init = {n: p.detach().clone() for n, p in make_model().named_parameters()}
    moved = max(float((ref_params[n] - init[n]).abs().max()) for n in init)
    res: dict[str, Any] = {"world": world, "moved": moved}

    # under DDP (gradients averaged by DDP's all-reduce, the owner design's all-gather)
    model, opt = train("ddp", STEPS)
    ddp_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    res["ddp_param_diff"] = max_diff(model, ref_params)
    res["ddp_state_diff"] = state_diff(opt, model, ref_state)
    res["ns_matrices"] = opt.stats.ns_matrices
    res["ns_cost"] = opt.stats.ns_cost
    # the owner design synchronising the gradients itself: reduce-scattered to owners (from
    # backward on), parameters all-gathered; one bucket, then tiny buckets
    for key, kw in (
        ("owner", {"average_grads": True}),
        ("owner_buckets", {"average_grads": True, "comm_bucket_bytes": 256}),
    ):
        model, opt = train("plain", STEPS, **kw)
        res[f"{key}_param_diff"] = max_diff(model, ref_params)
        res[f"{key}_state_diff"] = state_diff(opt, model, ref_state)
        res[f"{key}_ns_matrices"] = opt.stats.ns_matrices
        res[f"{key}_collectives"] = sum(opt.stats.collectives.values())
        res[f"{key}_buckets"] = len(opt.owner_layout.buckets) if opt.owner_layout else 0
        res[f"{key}_in_backward"] = opt.stats.in_backward
        res[f"{key}_held"] = sorted(
            n
            for n, p in model.named_parameters()
            if "momentum_buffer" in opt.state[p] or "exp_avg" in opt.state[p]
        )

    # FSDP2, recording every threshold the owners compute
    seen: list[tuple[tuple[int, ...], list[float]]] = []
    plain_quantile = fn.abs_quantile

    def recording_quantile(M: torch.Tensor, q: float) -> torch.Tensor:
        out = plain_quantile(M, q)
        seen.append((tuple(M.shape), (out + fn.THRESHOLD_EPS).flatten().tolist()))
        return out

    fn.abs_quantile = recording_quantile  # type: ignore[assignment]
    model, opt = train("fsdp", STEPS)
    fn.abs_quantile = plain_quantile  # type: ignore[assignment]
    res["fsdp_param_diff"] = max_diff(model, ref_params)
    res["fsdp_vs_ddp"] = max_diff(model, ddp_params)
    # tiny rounds: at most 256 B (one matrix) received per owner and round
    model, opt = train("fsdp", STEPS, comm_bucket_bytes=256)
    res["fsdp_rounds_param_diff"] = max_diff(model, ref_params)
    res["fsdp_rounds"] = opt.stats.collectives.get("all_to_all", 0) // 2
    res["fsdp_state_diff"] = state_diff(opt, model, ref_state)
    res["fsdp_ns_matrices"] = opt.stats.ns_matrices
    w1 = dict(model.named_parameters())["w1"]
    # every state tensor but the 0-d step count (a plain tensor, as torch.optim keeps it)
    res["fsdp_state_sharded"] = all(
        isinstance(v, DTensor) and tuple(v.placements) == (Shard(0),)
        for p in model.parameters()
        for k, v in opt.state[p].items()
        if isinstance(v, torch.Tensor) and k != "step"
    ) and all(not isinstance(opt.state[p]["step"], DTensor) for p in model.parameters())
    res["w1_local_rows"] = int(w1.to_local().shape[0])
    # thresholds of the (10 x 33) matrix: rows do not divide by 3 or 4
    res["owner_eps_w1"] = [e for shape, eps in seen if shape == (1, 10, 33) for e in eps]
    res["ref_eps_w1"] = [ref_eps[f"{s}:w1"] for s in range(STEPS)]

    # eager state, lr-0 step with zero gradients changes nothing, a rank without a grad
    model = wrap_model(make_model().to(DEVICE), "fsdp")
    opt = DistributedROOT(groups(model), **{**HYPER, "lr": 0.0})
    res["eager_state"] = all(len(opt.state[p]) > 0 for g in opt.param_groups for p in g["params"])
    before = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    res["lr0_change"] = max(
        float((full(p).detach() - before[n]).abs().max()) for n, p in model.named_parameters()
    )
    ids, x, y = (t.to(DEVICE) for t in global_batch(0))
    opt.param_groups[0]["lr"] = opt.param_groups[1]["lr"] = 0.01
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(ids, x), y).backward()
    if rank == world - 1:
        model.w4.grad = None  # this rank has no gradient for w4: it must not skip a collective
    opt.step()
    res["missing_grad_ok"] = all(bool(torch.isfinite(full(p)).all()) for p in model.parameters())
    # a NaN gradient on one rank only: every rank refuses the step, nothing changes
    model = make_model()
    opt = DistributedROOT(groups(model), **HYPER)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids, x, y = global_batch(0)
    torch.nn.functional.mse_loss(model(ids, x), y).backward()
    if rank == 0:
        model.w1.grad[0, 0] = float("nan")
    try:
        opt.step()
        res["nan_refused"] = ""
    except rootopt.NonFiniteGradientError as exc:
        res["nan_refused"] = str(exc)
    res["nan_change"] = max(
        float((p.detach() - before[n]).abs().max()) for n, p in model.named_parameters()
    )
    # compile_step across ranks: refused on every rank before any collective (no hang)
    res["compile_refused"] = refused(
        lambda: DistributedROOT(groups(make_model()), **HYPER, compile_step=True)
    )
    write(out_dir, "parity", res)
    finish(0)


if __name__ == "__main__":
    main()
