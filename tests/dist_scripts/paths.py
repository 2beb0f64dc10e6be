"""Worker of ``tests/test_paths.py``: DistributedROOT across the launched ranks on every
option set of ``tests/path_cases.py``, replicated (plain tensors, the same gradient on
every rank, as after DDP's all-reduce) and sharded (``DTensor`` parameters, ``Shard(0)`` on
a 1-D mesh, as FSDP2 holds them). Rank 0 writes the full parameters and optimizer state
of each run to ``OUT/<mode>-<option set>.pt``. Usage: paths.py OUT."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from path_cases import LR, OPTION_SETS, gradients, groups, make_params
from rootopt.distributed import DistributedROOT, finish, init_distributed


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def run(out: Path, mode: str, name: str) -> None:
    """``mode``: ``replicated`` (the owner design, the gradients already averaged as after
    DDP's all-reduce), ``averaged`` (the owner design reduce-scattering the gradients
    itself: equal on every rank here, so their mean is each) or ``sharded`` (DTensor
    parameters)."""
    options, dtype = OPTION_SETS[name]
    params = make_params(dtype)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),)) if mode == "sharded" else None
    if mesh is not None:
        params = {
            n: nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]))
            for n, p in params.items()
        }
    avg = {"average_grads": True} if mode == "averaged" else {}
    opt = DistributedROOT(groups(params, options), lr=LR, **options, **avg)
    for grads in gradients(dtype):
        for n, p in params.items():
            g = grads[n]
            p.grad = g if mesh is None else distribute_tensor(g, mesh, [Shard(0)])
        opt.step()
    # state_dict(): the owner design's state gathered from the owners (every rank calls it)
    order = [p for g in opt.param_groups for p in g["params"]]
    names = {id(p): n for n, p in params.items()}
    state = {names[id(order[i])]: st for i, st in opt.state_dict()["state"].items()}
    result: dict[str, Any] = {
        "params": {n: full(p.detach()).clone() for n, p in params.items()},
        "state": {n: {k: full(v).clone() for k, v in state[n].items()} for n in params},
        "world": dist.get_world_size(),
    }
    if dist.get_rank() == 0:
        torch.save(result, out / f"{mode}-{name}.pt")


def main() -> None:
    out = Path(sys.argv[1])
    init_distributed(backend="gloo", timeout_s=120)
    for name in OPTION_SETS:
        run(out, "replicated", name)
        run(out, "averaged", name)
        if not OPTION_SETS[name][0].get("robust_scaling"):  # not supported when sharded
            run(out, "sharded", name)
    finish(0)


if __name__ == "__main__":
    main()
