"""Uneven and empty shards, matrices fewer than ranks, a rank without a gradient, and the
bytes gloo really writes: run under torchrun (gloo, CPU).

Usage: edge.py OUT_DIR ROWS[,ROWS...] [owner] [wire] [bf16]

For every ``rows`` a matrix ``(rows, 6)`` is in the model (plus a ``(7, 6)`` matrix that
every rank holds rows of, and a bias for AdamW). Each layout (FSDP2's sharded path, and
each replicated DDP design) trains 3 steps on the same global batch and is compared with
single-process ROOT (``owner``: the replicated design synchronising the gradients); the
step's collectives, bytes and DTensor ``full_tensor`` calls are counted, and the bytes this process wrote to its sockets during the step are measured.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from common import write
from torch import nn
from torch.distributed.tensor import DTensor

import rootopt
from rootopt.distributed import DistributedROOT, finish, init_distributed, wrap_model
from rootopt_analysis.counters import CollectiveCounter, bytes_written

STEPS = 3
BATCH = 24  # divisible by 2, 3, 4 and 8: every rank's mean loss has the same weight
# float32 iterations (not bfloat16, the default on a device with bf16 units): the ranks are
# compared with one process to float32 rounding, and the counted bytes assume float32 updates
HYPER: dict[str, Any] = dict(
    lr=0.02, weight_decay=0.1, outlier_quantile=0.9, momentum=0.9, ns_dtype="float32"
)


class Stack(nn.Module):
    def __init__(self, rows: list[int]) -> None:
        super().__init__()
        self.mats = nn.ParameterList([nn.Parameter(torch.randn(r, 6) / 3) for r in rows])
        self.shared = nn.Parameter(torch.randn(7, 6) / 3)
        self.bias = nn.Parameter(torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x + self.bias)
        out = torch.tanh(h @ self.shared.T).pow(2).mean()
        for m in self.mats:
            out = out + torch.tanh(h @ m.T).pow(2).mean()
        return out


def make(rows: list[int]) -> Stack:
    torch.manual_seed(0)
    return Stack(rows)


def groups(model: nn.Module) -> list[dict[str, Any]]:
    named = dict(model.named_parameters())
    root = [n for n in named if n != "bias"]
    return [
        {"params": [named[n] for n in root], "param_names": root, "algorithm": "root"},
        {"params": [named["bias"]], "param_names": ["bias"], "algorithm": "adamw"},
    ]


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(BATCH, 6, generator=g)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def reference(rows: list[int], **kw: Any) -> dict[str, torch.Tensor]:
    model = make(rows)
    opt = rootopt.ROOT(groups(model), **{**HYPER, **kw})
    for step in range(STEPS):
        opt.zero_grad()
        model(batch(step)).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run(rows: list[int], layout: str, design: str, drop: bool) -> dict[str, Any]:
    """Train STEPS steps; with ``drop``, the last rank has no gradient for the first
    matrix in the last step (it must not hang; the others still update it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make(rows)
    kw: dict[str, Any] = {}
    if layout in ("fsdp", "fsdp16"):  # fsdp16: bfloat16 Newton–Schulz, updates sent back in it
        model = wrap_model(model, "fsdp")
        kw = {"ns_dtype": "bfloat16"} if layout == "fsdp16" else {}
    else:  # the owner design synchronising the gradients
        kw = {"average_grads": True}
    opt = DistributedROOT(groups(model), **{**HYPER, **kw})
    res: dict[str, Any] = {"layout": layout, "design": design}
    sl = torch.tensor_split(torch.arange(BATCH), world)[rank]
    for step in range(STEPS):
        opt.zero_grad()
        # inside no_sync(): every reduce-scatter starts with the step, where it is counted
        # (and a gradient dropped after backward is a rank without one, not a change)
        with opt.no_sync():
            model(batch(step)[sl]).backward()
        if drop and step == STEPS - 1 and rank == world - 1:
            model.mats[0].grad = None
        dist.barrier()
        before = bytes_written()
        with CollectiveCounter() as counts:
            opt.step()
        after = bytes_written()
        res["counts"] = counts.as_dict()
        res["wrote"] = None if before is None or after is None else after - before
        res["stats_sent"] = opt.stats.bytes_sent
    named = dict(model.named_parameters())
    res["local_rows"] = {
        n: int(p.to_local().shape[0]) if isinstance(p, DTensor) else int(p.shape[0])
        for n, p in named.items()
    }
    res["params"] = {n: full(p).detach().tolist() for n, p in named.items()}
    res["finite"] = all(bool(torch.isfinite(full(p)).all()) for p in named.values())
    return res


def max_diff(params: dict[str, Any], ref: dict[str, torch.Tensor]) -> float:
    assert sorted(params) == sorted(ref), (sorted(params), sorted(ref))
    return max(float((torch.tensor(params[n]) - ref[n]).abs().max()) for n in ref)


def wire() -> dict[str, Any]:
    """Each gloo collective the optimizer uses, on 1 MiB tensors: the bytes the counter
    assigns to this rank and the bytes the process wrote (/proc/self/io)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 1 << 18
    uneven = [n * (1 + r % 3) for r in range(world)]  # parts of 1, 2, 3, 1, ... x n
    uneven[-1] = 0 if world > 2 else uneven[-1]  # and an empty one
    cases = {
        "all_reduce": lambda: dist.all_reduce(torch.ones(world * n)),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
            torch.empty(world * n), torch.ones(n)
        ),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            torch.empty(n), torch.ones(world * n)
        ),
        "all_to_all_single": lambda: dist.all_to_all_single(
            torch.empty(world * uneven[rank]),
            torch.ones(sum(uneven)),
            [uneven[rank]] * world,
            uneven,
        ),
        "broadcast": lambda: dist.broadcast(torch.ones(n), src=0),
    }
    out: dict[str, Any] = {}
    for name, fn in cases.items():
        dist.barrier()
        before = bytes_written()
        with CollectiveCounter() as counts:
            fn()
        after = bytes_written()
        dist.barrier()
        out[name] = {
            "counted": counts.bytes_sent,
            "wrote": None if before is None or after is None else after - before,
        }
    return out


def main() -> None:
    out_dir = sys.argv[1]
    rows = [int(r) for r in sys.argv[2].split(",")]
    designs = sys.argv[3].split(",") if len(sys.argv) > 3 else ["owner"]
    init_distributed(backend="gloo", timeout_s=60)
    ref = reference(rows)
    init = {n: p.detach().clone() for n, p in make(rows).named_parameters()}
    payload: dict[str, Any] = {
        "world": dist.get_world_size(),
        "moved": max(float((ref[n] - init[n]).abs().max()) for n in ref),
        "runs": [],
    }
    layouts = [("fsdp", "fsdp")] + [("ddp", d) for d in designs]
    refs = {"fsdp16": reference(rows, ns_dtype="bfloat16")} if "bf16" in sys.argv[4:] else {}
    layouts += [("fsdp16", "fsdp")] if refs else []
    for layout, design in layouts:
        res = run(rows, layout, design, drop=False)
        res["diff"] = max_diff(res.pop("params"), refs.get(layout, ref))
        payload["runs"].append(res)
        dropped = run(rows, layout, design, drop=True)
        dropped["drop"] = True
        payload["runs"].append(dropped)
    if "wire" in sys.argv[4:]:
        payload["wire"] = wire()
    write(out_dir, "edge", payload)
    finish(0)


if __name__ == "__main__":
    main()
