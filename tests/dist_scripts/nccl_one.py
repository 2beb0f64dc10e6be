"""The CUDA path of DistributedROOT's collectives on one GPU with NCCL (world size 1): FSDP2
parameters go through the sharded path (the flag all-reduce and both all-to-alls run on
NCCL, the updates return in bfloat16 under ``ns_dtype="bfloat16"``), compared with
single-process ROOT on the same GPU; the step's collectives are counted. Run under
``torchrun --nproc_per_node 1``.

Usage: nccl_one.py OUT_DIR
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from common import HYPER, global_batch, groups, make_model, write
from torch.distributed.tensor import DTensor

import rootopt
from rootopt.distributed import DistributedROOT, finish, init_distributed, wrap_model
from rootopt_analysis.counters import CollectiveCounter

STEPS = 4


def main() -> None:
    out_dir = sys.argv[1]
    init_distributed(backend="nccl", timeout_s=120)
    dev = torch.device("cuda", 0)
    res: dict[str, Any] = {"world": dist.get_world_size(), "backend": dist.get_backend()}
    ref = make_model().to(dev)
    bf16 = {**HYPER, "ns_dtype": "bfloat16"}  # what ROOT's "auto" picks on a GPU with bf16 units
    ref_opt = rootopt.ROOT(groups(ref), **bf16)
    model = wrap_model(make_model().to(dev), "fsdp")
    opt = DistributedROOT(groups(model), **bf16)
    res["sharded"] = all(isinstance(p, DTensor) for p in model.parameters())
    for step in range(STEPS):
        ids, x, y = (t.to(dev) for t in global_batch(step))
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(ids, x), y).backward()
        ref_opt.step()
        with CollectiveCounter() as counts:
            opt.step()
        res["counts"] = counts.as_dict()
    named_ref = dict(ref.named_parameters())
    res["param_diff"] = max(
        float((p.full_tensor() - named_ref[n]).detach().abs().max())
        for n, p in model.named_parameters()
    )
    init = dict(make_model().named_parameters())
    res["moved"] = max(
        float((named_ref[n].detach().cpu() - init[n]).abs().max()) for n in named_ref
    )
    res["ns_matrices"] = opt.stats.ns_matrices
    res["ns_dtype"] = str(opt.param_groups[0]["ns_dtype"])
    write(out_dir, "nccl_one", res)
    finish(0)


if __name__ == "__main__":
    main()
