"""The owner design's gradient reduce-scatter in the step or started in backward
(``DistributedROOT(sync_in_backward=True)``): forward + backward + step per rank, the two
interleaved in one launch so that a slow spell of the machine lands on both.

Each rank trains ``--layers`` tanh layers of ``--width`` × ``--width`` on its own batch;
the slowest rank's median over ``--steps`` steps (after 2 warm-up steps) is reported per
round, then the ratio backward / step of the medians over rounds. Run it under torchrun:

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_backward_sync.py
    # on GPUs: --backend nccl (one GPU per rank)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from rootopt.distributed import DistributedROOT, finish, init_distributed


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--width", type=_positive, default=512)
    ap.add_argument("--layers", type=_positive, default=8)
    ap.add_argument("--batch", type=_positive, default=512)
    ap.add_argument("--bucket-kib", type=_positive, default=1024)
    ap.add_argument("--steps", type=_positive, default=6)
    ap.add_argument("--rounds", type=_positive, default=2)
    a = ap.parse_args()  # before the process group: a bad value is one line, exit 2
    info = init_distributed(backend=a.backend, timeout_s=600)
    dev = torch.device("cuda", info.local_rank) if a.backend == "nccl" else torch.device("cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(a.rounds):
        for early in (False, True):
            torch.manual_seed(0)
            layers = [
                nn.Sequential(nn.Linear(a.width, a.width), nn.Tanh()) for _ in range(a.layers)
            ]
            model = nn.Sequential(*layers).to(dev)
            mats = [p for p in model.parameters() if p.ndim == 2]
            rest = [p for p in model.parameters() if p.ndim != 2]
            opt = DistributedROOT(
                [{"params": mats, "algorithm": "root"}, {"params": rest, "algorithm": "adamw"}],
                lr=0.01, average_grads=True, bucket_bytes=a.bucket_kib << 10,
                sync_in_backward=early,
            )  # fmt: skip
            x = torch.randn(a.batch, a.width, device=dev)
            steps = []
            for _ in range(a.steps + 2):
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
                sync()
                steps.append(time.perf_counter() - t0)
            t = torch.tensor([statistics.median(steps[2:]) * 1e3], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[early].append(float(t))
            if info.rank == 0:
                where = "backward" if early else "step"
                layout = opt.owner_layout
                print(
                    f"reduce-scatter in {where:8s}: {float(t):8.1f} ms per step "
                    f"(slowest rank's median); buckets {len(layout.buckets) if layout else 0}, "
                    f"started in backward {opt.stats.in_backward}",
                    flush=True,
                )
    if info.rank == 0:
        step, back = statistics.median(times[False]), statistics.median(times[True])
        print(
            f"W = {info.world_size}, {a.backend}: in the step {step:.1f} ms, in backward "
            f"{back:.1f} ms; backward / step = {back / step:.3f}"
        )
    finish(0)


if __name__ == "__main__":
    main()
