"""Forward + backward + step per rank: where the gradient synchronisation of a ROOT step
runs. Three arms, interleaved in one launch so that a slow spell of the machine lands on
all of them:

* ``owner``  no DDP wrapper; ``DistributedROOT(average_grads=True)`` reduce-scatters each
             bucket from a gradient hook during backward (the design ``rootopt train``
             uses for ROOT and Muon);
* ``step``   the same with every backward inside ``opt.no_sync()``: every reduce-scatter
             starts when the step synchronises the gradients (what the hooks hide);
* ``ddp``    a ``DistributedDataParallel`` model (its all-reduce overlaps backward) and
             ``DistributedROOT(average_grads=False)``: DDP's all-reduce plus the
             all-gather (1.5x the bytes; ``rootopt train`` before).

Each rank trains ``--layers`` tanh layers of ``--width`` × ``--width`` on its own batch;
the slowest rank's median over ``--steps`` steps (after 2 warm-up steps) is reported per
round, then each arm's median over rounds and its ratio to ``owner``. Run it under
torchrun (``--json`` must name a new file; rank 0 writes it):

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_backward_sync.py
    # on GPUs: --backend nccl (one GPU per rank)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from rootopt.distributed import DistributedROOT, finish, init_distributed, wrap_model

ARMS = ("owner", "step", "ddp")


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
    ap.add_argument("--json", default="", help="write the medians here (a new file)")
    a = ap.parse_args()  # before the process group: a bad value is one line, exit 2
    if a.json and os.path.lexists(a.json):
        ap.error("--json PATH: the file exists; name a new one")
    info = init_distributed(backend=a.backend, timeout_s=600)
    dev = torch.device("cuda", info.local_rank) if a.backend == "nccl" else torch.device("cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for _ in range(a.rounds):
        for arm in ARMS:
            torch.manual_seed(0)
            layers = [
                nn.Sequential(nn.Linear(a.width, a.width), nn.Tanh()) for _ in range(a.layers)
            ]
            inner = nn.Sequential(*layers).to(dev)
            model = wrap_model(inner, "ddp") if arm == "ddp" else inner
            mats = [p for p in inner.parameters() if p.ndim == 2]
            rest = [p for p in inner.parameters() if p.ndim != 2]
            opt = DistributedROOT(
                [{"params": mats, "algorithm": "root"}, {"params": rest, "algorithm": "adamw"}],
                lr=0.01, average_grads=arm != "ddp", comm_bucket_bytes=a.bucket_kib << 10,
            )  # fmt: skip
            x = torch.randn(a.batch, a.width, device=dev)
            steps = []
            for _ in range(a.steps + 2):
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                opt.zero_grad()
                hold = opt.no_sync() if arm == "step" else contextlib.nullcontext()
                with hold:
                    model(x).pow(2).mean().backward()
                opt.step()
                sync()
                steps.append(time.perf_counter() - t0)
            t = torch.tensor([statistics.median(steps[2:]) * 1e3], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[arm].append(float(t))
            if info.rank == 0:
                layout = opt.owner_layout
                print(
                    f"{arm:6s}: {float(t):8.1f} ms per step (slowest rank's median); "
                    f"buckets {len(layout.buckets) if layout else 0}, started in backward "
                    f"{opt.stats.in_backward}, sent {opt.stats.bytes_sent} B in the step",
                    flush=True,
                )
    if info.rank == 0:
        med = {arm: statistics.median(v) for arm, v in times.items()}
        print(
            f"W = {info.world_size}, {a.backend}: "
            + ", ".join(f"{arm} {med[arm]:.1f} ms" for arm in ARMS)
            + f"; step / owner = {med['step'] / med['owner']:.3f}, "
            f"ddp / owner = {med['ddp'] / med['owner']:.3f}"
        )
        if a.json:
            repo = Path(__file__).resolve().parents[1]
            commit = subprocess.run(
                ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                capture_output=True, text=True, timeout=10,
            ).stdout.strip()  # fmt: skip
            dirty = subprocess.run(
                ["git", "-C", str(repo), "status", "--porcelain", "--", "src", "benchmarks"],
                capture_output=True, text=True, timeout=10,
            ).stdout.strip()  # fmt: skip
            rec = {
                "commit": commit + ("+changes" if dirty else ""),
                "torch": torch.__version__,
                "cpu": platform.processor() or platform.machine(),
                "cores": len(os.sched_getaffinity(0)),
                "cuda": torch.cuda.get_device_name(0) if dev.type == "cuda" else None,
                "world": info.world_size,
                "backend": a.backend,
                "width": a.width,
                "layers": a.layers,
                "batch": a.batch,
                "bucket_kib": a.bucket_kib,
                "steps": a.steps,
                "rounds": times,
                "median_ms": med,
            }
            with open(a.json, "x") as fh:
                json.dump(rec, fh, indent=1)
    finish(0)


if __name__ == "__main__":
    main()
