"""The owner design's communication on gloo: bytes per rank and collectives per step
measured with the collective counter for two models with different numbers of matrix
shapes and one whose largest parameter is an AdamW table (split over owners), today's
gather design and DDP AdamW's 2·f·P for comparison; every run against single-process ROOT
(parameters, the state gathered by ``state_dict()``, and a step after reloading it); and a
layout that differs on one rank stopping every rank with one line.

Usage: owner.py OUT_DIR (under torchrun).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from common import refused, write
from torch import nn

import rootopt
from rootopt.distributed import DistributedROOT, finish, init_distributed
from rootopt.distributed.counters import CollectiveCounter, TrafficCounter, bytes_written

HYPER: dict[str, Any] = dict(lr=0.02, weight_decay=0.1, outlier_quantile=0.9, momentum=0.9)
BATCH = 12  # divisible by 2, 3 and 4


class Model(nn.Module):
    """12 matrices (24 x 16 when ``shapes`` is 1; 6 shapes of the same size otherwise, so
    that both models have the same parameter count) and 6 biases for AdamW; ``table``: 4
    matrices and a 3,000 x 16 AdamW table, the largest parameter."""

    def __init__(self, shapes: int, table: bool = False) -> None:
        super().__init__()
        dims = [(24, 16), (16, 24), (32, 12), (12, 32), (48, 8), (8, 48)][:shapes]
        n = 4 if table else 12
        self.mats = nn.ParameterList(
            [nn.Parameter(torch.randn(*dims[i % shapes]) / 4) for i in range(n)]
        )
        self.biases = nn.ParameterList([nn.Parameter(torch.zeros(16)) for _ in range(6)])
        self.table = nn.Parameter(torch.randn(3000, 16) / 40) if table else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(())
        for i, m in enumerate(self.mats):
            h = x[:, : m.shape[1]] + self.biases[i % 6][: min(16, m.shape[1])].sum()
            out = out + torch.tanh(h @ m.T).pow(2).mean()
        if self.table is not None:
            t = self.table
            out = out + torch.tanh(x[:, :16] * t.sum(0) + t.pow(2).mean()).mean()
        return out


def groups(model: Model) -> list[dict[str, Any]]:
    adamw = list(model.biases) + ([model.table] if model.table is not None else [])
    return [
        {"params": list(model.mats), "algorithm": "root"},
        {"params": adamw, "algorithm": "adamw"},
    ]


STEPS = 3
# threshold + Newton–Schulz (and its stacking copies) left out of the elementwise count:
# the cost model charges them as FLOPs and per thresholded element
APART = [(DistributedROOT, "_orthogonalize")]


def reference(shapes: int, table: bool, x: torch.Tensor) -> tuple[Model, rootopt.ROOT]:
    torch.manual_seed(0)
    model = Model(shapes, table)
    opt = rootopt.ROOT(groups(model), **HYPER)
    for _ in range(STEPS):
        opt.zero_grad()
        model(x).backward()
        opt.step()
    return model, opt


def measure(shapes: int, design: str, table: bool = False, overlap: bool = True) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Model(shapes, table)
    kw: dict[str, Any] = {"average_grads": True, "ddp_design": design, "overlap": overlap}
    opt = DistributedROOT(groups(model), **HYPER, **kw)
    x = torch.randn(BATCH, 48, generator=torch.Generator().manual_seed(1))
    sl = torch.tensor_split(torch.arange(BATCH), world)[rank]
    res: dict[str, Any] = {}
    for step in range(STEPS):
        if step == STEPS - 1:
            # the state through state_dict() (gathered) and back (kept where owned)
            opt.load_state_dict(opt.state_dict())
        opt.zero_grad()
        model(x[sl]).backward()
        dist.barrier()
        before = bytes_written()
        with CollectiveCounter() as counts, TrafficCounter(APART) as traffic:
            opt.step()
        after = bytes_written()
        res = counts.as_dict()
        res["wrote"] = None if before is None or after is None else after - before
        res["traffic"] = traffic.bytes  # elementwise bytes read + written
    ref_model, ref_opt = reference(shapes, table, x)
    pairs = list(zip(model.parameters(), ref_model.parameters(), strict=True))
    res["param_diff"] = max(float((p - q).abs().max()) for p, q in pairs)
    got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert set(want) <= set(got), (sorted(got), sorted(want))  # eager: unused ones too
    res["state_diff"] = max(
        float((got[i][k] - v).abs().max()) for i in want for k, v in want[i].items()
    )
    torch.manual_seed(0)
    init = list(Model(shapes, table).parameters())
    res["moved"] = max(float((q - p0).abs().max()) for (_, q), p0 in zip(pairs, init))
    layout = opt.owner_layout
    res["pieces"] = len(layout.items) - len(pairs) if layout else 0
    res["params"] = sum(p.numel() for p in model.parameters())
    res["n_params"] = len(list(model.parameters()))
    res["shapes"] = len({tuple(p.shape) for p in model.mats})
    res["buckets"] = len(opt.owner_layout.buckets) if opt.owner_layout else 0
    res["overlapped"] = opt.stats.overlapped
    res["times"] = [opt.stats.ns_seconds, opt.stats.comm_seconds, opt.stats.seconds]
    res["segments"] = (
        [list(b.segments) for b in opt.owner_layout.buckets] if opt.owner_layout else []
    )
    return res


def mismatch() -> str:
    """The last rank builds with another bucket size: a different layout."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Model(1)
    bucket = 1024 if rank == world - 1 else 32 << 20
    return refused(
        lambda: DistributedROOT(groups(model), **HYPER, ddp_design="owner", bucket_bytes=bucket)
    )


def main() -> None:
    init_distributed(backend="gloo", timeout_s=60)
    payload: dict[str, Any] = {"world": dist.get_world_size()}
    for shapes in (1, 6):
        for design in ("gather", "owner"):
            payload[f"{design}_{shapes}"] = measure(shapes, design)
    for design in ("gather", "owner"):
        payload[f"{design}_table"] = measure(1, design, table=True)
    payload["owner_6_sync"] = measure(6, "owner", overlap=False)  # one bucket, waited for
    # the branches NCCL takes for equal segments (reduce_scatter_tensor,
    # all_gather_into_tensor), run on gloo, which has both for equal parts; its missing
    # uneven all_gather is why gloo takes all-to-alls otherwise
    real = DistributedROOT._backend
    DistributedROOT._backend = lambda self: "nccl"  # type: ignore[method-assign]
    try:
        payload["nccl_branches"] = measure(6, "owner", overlap=False)
    finally:
        DistributedROOT._backend = real  # type: ignore[method-assign]
    payload["mismatch"] = mismatch()
    # the group is still usable after the refusal (nobody is left inside a collective)
    t = torch.ones(1)
    dist.all_reduce(t)
    payload["after_mismatch"] = float(t)
    write(sys.argv[1], "owner", payload)
    finish(0)


if __name__ == "__main__":
    main()
