"""Worker of ``tests/test_dist_gram.py``: ``DistributedROOT(fsdp_design="gram")`` on DTensor
parameters (``Shard(0)`` on a 1-D mesh, as FSDP2 holds them) against the single-process
:class:`rootopt.ROOT` on the same full tensors and gradients, for cases whose large
matrices are split (wide, tall, both, one with fewer rows than ranks) and option sets
(default, bf16 iteration, AdaNewton, no threshold). ``ns_gram="off"`` on both sides: only
the plain iteration is split, and ``auto`` may pick another one in one process.

Per case and option set, every rank writes (rank-local JSON, ``gram-rank<r>.json``): the
largest parameter and momentum difference to the reference, the reference's largest move,
the matrices this rank held slabs of, the collectives and bytes this rank issued in the
last step (:class:`~rootopt.distributed.counters.CollectiveCounter`) and the cost model's
prediction of them (:func:`rootopt.distributed.plan.estimate`, design ``gram``).
Usage: gram.py OUT [GPUS_PER_NODE]."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from rootopt import ROOT
from rootopt.distributed import DistributedROOT, finish, init_distributed
from rootopt.distributed.counters import CollectiveCounter
from rootopt.distributed.plan import Options, ParamSpec, estimate

STEPS = 3
SMALL: dict[str, tuple[int, ...]] = {
    "small": (8, 12),
    "odd": (7, 13),
    "conv": (6, 3, 3, 3),
    "stack": (3, 8, 12),
    "bias": (24,),
}
CASES: dict[str, dict[str, tuple[int, ...]]] = {
    "wide": {"wide": (20, 301), **SMALL},
    "tall": {"tall": (301, 20), **SMALL},
    "both": {"wide": (20, 301), "tall": (301, 20), **SMALL},
    "thin": {"thin": (3, 2000), **SMALL},  # fewer rows than ranks at 4: an empty shard
}
OPTIONS: dict[str, dict[str, Any]] = {
    "default": {},
    "bf16_iteration": {"ns_dtype": "bfloat16"},
    "adanewton": {"ns_coefficients": "adanewton"},
    "no_threshold": {"outlier_quantile": None},
}
HYPER: dict[str, Any] = dict(lr=0.02, weight_decay=0.1, momentum=0.9, ns_gram="off")


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def make(
    shapes: dict[str, tuple[int, ...]],
) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    init = {n: torch.randn(s, generator=g) / 4 for n, s in shapes.items()}
    grads = []
    for _ in range(STEPS):
        step = {}
        for n, s in shapes.items():
            t = torch.randn(s, generator=g)
            t.view(-1)[:: max(1, t.numel() // 7)] *= 25  # a few outliers
            step[n] = t
        grads.append(step)
    return init, grads


def groups(params: dict[str, nn.Parameter], opts: dict[str, Any]) -> list[dict[str, Any]]:
    names = list(params)
    return [{"params": [params[n] for n in names], "param_names": names, **opts}]


def run(case: str, opt_name: str, node: int | None) -> dict[str, Any]:
    shapes = CASES[case]
    init, grads = make(shapes)
    opts = OPTIONS[opt_name]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # the reference: one process, whole tensors
    ref = {n: nn.Parameter(t.clone()) for n, t in init.items()}
    ref_opt = ROOT(groups(ref, opts), **HYPER)
    for step in grads:
        for n, p in ref.items():
            p.grad = step[n].clone()
        ref_opt.step()
    params = {
        n: nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for n, t in init.items()
    }
    opt = DistributedROOT(groups(params, opts), fsdp_design="gram", gpus_per_node=node, **HYPER)
    counted: dict[str, Any] = {}
    for k, step in enumerate(grads):
        for n, p in params.items():
            p.grad = distribute_tensor(step[n].clone(), mesh, [Shard(0)])
        if k == len(grads) - 1:
            with CollectiveCounter() as counts:
                opt.step()
            counted = counts.as_dict()
        else:
            opt.step()
    diffs, moves, state_diffs = {}, {}, {}
    for n in shapes:
        got = full(params[n].detach())
        diffs[n] = float((got - ref[n].detach()).abs().max())
        moves[n] = float((ref[n].detach() - init[n]).abs().max())
        if "momentum_buffer" in opt.state[params[n]]:
            mb = full(opt.state[params[n]]["momentum_buffer"])
            state_diffs[n] = float((mb - ref_opt.state[ref[n]]["momentum_buffer"]).abs().max())
    specs = [ParamSpec(n, s, "root" if len(s) >= 2 else "adamw") for n, s in shapes.items()]
    world = dist.get_world_size()
    model = Options(
        backend="gloo",
        gpus_per_node=node or world,
        ns_bytes=2 if opts.get("ns_dtype") == "bfloat16" else 4,
        threshold=opts.get("outlier_quantile", 0.9) is not None,
    )
    est = estimate(specs, world, "gram", model)
    rank = dist.get_rank()
    return {
        "param_diff": diffs,
        "move": moves,
        "state_diff": state_diffs,
        "ns_matrices": opt.stats.ns_matrices,
        "groups": sorted(opt._holder_groups),
        "counted": counted,
        "model": {
            "sent": float(est.step_sent[rank]),
            "received": float(est.step_received[rank]),
            "collectives": est.exposed_collectives,
            "notes": est.notes,
        },
    }


def main() -> None:
    out = Path(sys.argv[1])
    node = int(sys.argv[2]) if len(sys.argv) > 2 else None
    init_distributed(backend="gloo", timeout_s=120)
    result: dict[str, Any] = {"world": dist.get_world_size(), "runs": {}}
    for case in CASES:
        for opt_name in OPTIONS:
            result["runs"][f"{case}/{opt_name}"] = run(case, opt_name, node)
    (out / f"gram-rank{dist.get_rank()}.json").write_text(json.dumps(result, indent=1))
    finish(0)


if __name__ == "__main__":
    main()
