"""The owner design's communication on gloo: bytes per rank and collectives per step
measured with the collective counter for two models with different numbers of matrix
shapes and one whose largest parameter is an AdamW table (split over owners), against DDP
AdamW's 2·f·P; the same bytes whether the reduce-scatters start in backward or with the
step; every run against single-process ROOT (parameters, the state gathered by
``state_dict()``, and a step after reloading it); and a layout that differs on one rank
stopping every rank with one line.

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
import rootopt.distributed.flat as flat
import rootopt.optim.functional as F
from rootopt.distributed import DistributedROOT, finish, init_distributed
from rootopt_analysis.counters import CollectiveCounter, TrafficCounter, bytes_written

# float32 iterations (not bfloat16, the default on a device with bf16 units): the ranks are
# compared with one process to float32 rounding, and the counted bytes assume float32 updates
HYPER: dict[str, Any] = dict(
    lr=0.02, weight_decay=0.1, outlier_quantile=0.9, momentum=0.9, ns_dtype="float32"
)
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
APART = [(F, "root_direction")]


def reference(shapes: int, table: bool, x: torch.Tensor) -> tuple[Model, rootopt.ROOT]:
    torch.manual_seed(0)
    model = Model(shapes, table)
    opt = rootopt.ROOT(groups(model), **HYPER)
    for _ in range(STEPS):
        opt.zero_grad()
        model(x).backward()
        opt.step()
    return model, opt


def measure(shapes: int, table: bool = False, early: bool = False) -> dict[str, Any]:
    """3 steps of the owner design. ``early``: backward starts the reduce-scatters (counted
    over backward + step); otherwise backward runs inside ``no_sync()`` and every one starts
    with the step (counted over the step, with its elementwise bytes)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Model(shapes, table)
    opt = DistributedROOT(groups(model), **HYPER, average_grads=True)
    x = torch.randn(BATCH, 48, generator=torch.Generator().manual_seed(1))
    sl = torch.tensor_split(torch.arange(BATCH), world)[rank]
    res: dict[str, Any] = {}
    for step in range(STEPS):
        if step == STEPS - 1:
            # the state through state_dict() (gathered) and back (kept where owned)
            opt.load_state_dict(opt.state_dict())
        opt.zero_grad()
        dist.barrier()
        if early:
            before = bytes_written()
            with CollectiveCounter() as counts:
                model(x[sl]).backward()
                opt.step()
            after = bytes_written()
            res = counts.as_dict()
            res["traffic"] = None
        else:
            with opt.no_sync():
                model(x[sl]).backward()
            before = bytes_written()
            with CollectiveCounter() as counts, TrafficCounter(APART) as traffic:
                opt.step()
            after = bytes_written()
            res = counts.as_dict()
            res["traffic"] = traffic.bytes  # elementwise bytes read + written
        res["wrote"] = None if before is None or after is None else after - before
        res["in_backward"] = opt.stats.in_backward
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
    # the optimizer state this rank holds (momentum, AdamW moments; step counts aside), and
    # one process's for every parameter (float32 momentum per matrix element, two moments
    # per AdamW element; ROOT creates it lazily, DistributedROOT for all at construction)
    res["state_bytes"] = sum(
        v.numel() * v.element_size()
        for st in opt.state.values()
        for k, v in st.items()
        if isinstance(v, torch.Tensor) and k != "step"
    )
    res["state_bytes_one"] = 4 * sum(
        p.numel() * (1 if g["algorithm"] == "root" else 2)
        for g in groups(model)
        for p in g["params"]
    )
    layout = opt.owner_layout
    res["pieces"] = len(layout.items) - len(pairs) if layout else 0
    res["params"] = sum(p.numel() for p in model.parameters())
    res["n_params"] = len(list(model.parameters()))
    res["shapes"] = len({tuple(p.shape) for p in model.mats})
    res["buckets"] = len(opt.owner_layout.buckets) if opt.owner_layout else 0
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
    return refused(lambda: DistributedROOT(groups(model), **HYPER, comm_bucket_bytes=bucket))


def main() -> None:
    init_distributed(backend="gloo", timeout_s=60)
    payload: dict[str, Any] = {"world": dist.get_world_size()}
    for shapes in (1, 6):
        payload[f"owner_{shapes}"] = measure(shapes)
    payload["owner_table"] = measure(1, table=True)
    payload["owner_6_early"] = measure(6, early=True)  # reduce-scatters from backward
    # the branches NCCL takes for equal segments (reduce_scatter_tensor,
    # all_gather_into_tensor), run on gloo, which has both for equal parts; its missing
    # uneven all_gather is why gloo takes all-to-alls otherwise
    real = flat.backend
    flat.backend = lambda group: "nccl"  # type: ignore[assignment]
    try:
        payload["nccl_branches"] = measure(6)
    finally:
        flat.backend = real  # type: ignore[assignment]
    payload["mismatch"] = mismatch()
    # the group is still usable after the refusal (nobody is left inside a collective)
    t = torch.ones(1)
    dist.all_reduce(t)
    payload["after_mismatch"] = float(t)
    write(sys.argv[1], "owner", payload)
    finish(0)


if __name__ == "__main__":
    main()
