"""Distributed ROOT: per-rank step time, Newton–Schulz time and work, bytes moved and
collectives issued per step, optimizer state and peak memory, at several world sizes (CPU
processes with gloo, or GPUs with NCCL); and ``rootopt train`` itself at those world sizes.

Designs compared, each in its own torchrun launch (so peak memory is per design):
  * ``owner``     DistributedROOT on plain tensors with ``average_grads=True`` (no DDP
                  wrapper): per bucket one reduce-scatter of the gradients to their owners,
                  the owners' update, one all-gather of the new parameters.
  * ``adamw``     DDP AdamW: the gradients all-reduced in 25 MiB float32 buckets (what
                  DDP's reducer does) and torch.optim.AdamW (foreach).
  * ``fsdp``      DistributedROOT on FSDP2-sharded parameters: shards to owners and
                  updates back with all_to_all_single (FSDP2's own gradient reduce-scatter
                  is not part of the step).
  * ``broadcast`` rank 0 thresholds + orthogonalizes every matrix and broadcasts the
                  updates; the other ranks wait (no gradient synchronisation in the step).
The bytes and collectives are what the step issues, counted by
``rootopt_analysis.counters.CollectiveCounter`` (gradient synchronisation included for owner
and adamw), with the cost model's prediction (``rootopt_analysis.costmodel``) beside them;
``state MiB`` is the optimizer state this rank holds (its tensors' bytes), ``x1/W`` that
over one process's ROOT state divided by W.

``--train`` adds ``rootopt train`` rows: the embedded default model (or ``--train-set``
overrides) at each W > 1 with ROOT and with AdamW under DDP, ``comm_bytes`` (metrics.jsonl:
what each rank sent per step, counted at the collectives; AdamW's from DDP's bucket sizes),
steps/s and the final loss; ROOT's bytes over AdamW's is the target (≤ 1.05).

``--calibrate`` checks the cost model's *time* (``costmodel.step_time``, the model of the
GPU verdicts, with this machine's constants) against measured gloo steps of ``owner``:

1. constants from microbenchmarks, never from the steps they predict: the Newton–Schulz
   rate (ROOT's own ``root_direction`` without the clip, on the bench model's matrix
   shapes), the bytes/s of the step's own elementwise functions (the non-finite check,
   momentum, decay + update, AdamW, a bucket's flatten and copy back, each from a cold
   cache; bytes as ``counters.TrafficCounter`` counts them), the seconds per ROOT element
   of the quantile + clamp, and at each W the latency and bandwidth of gloo's all-to-all,
   all-gather and all-reduce (``t = latency + bytes / link``). ``--constants alone``
   (default): one rank's rates, shared ``min(1, cores / W)``; ``together``: the slowest
   rank's rates with all W ranks at once. Every constant is the median of ``--repeats``
   launches;
2. the model's optimizer time for ``owner`` at each W from those constants;
3. the measured step (the slowest rank's median over ``--steps`` steps; the median of
   ``--repeats`` launches), predicted / measured and the verdict against ``--tolerance``.

Usage: python benchmarks/bench_dist.py [--worlds 1 2 4] [--designs owner adamw fsdp
       broadcast] [--d-model 256] [--layers 4] [--steps 5] [--backend gloo] [--json out.json]
       [--train [--train-steps 20]] [--calibrate [--repeats 3] [--constants alone|together]]
       (--json must name a new file; it records the commit and the machine)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_step import transformer_matrices  # noqa: E402

DESIGNS = ("owner", "adamw", "fsdp", "broadcast")
SHARDED = ("fsdp",)
DDP_BUCKET_BYTES = 25 << 20  # torch DistributedDataParallel(bucket_cap_mb=25)


# ---------------------------------------------------------------------------------------
# worker (one rank)
# ---------------------------------------------------------------------------------------
def _groups(model: nn.Module) -> list[dict[str, Any]]:
    root, adamw = [], []
    for n, p in model.named_parameters():
        (root if p.ndim == 2 and not n.startswith("wte") else adamw).append(p)
    return [{"params": root, "algorithm": "root"}, {"params": adamw, "algorithm": "adamw"}]


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    from rootopt.distributed import DistributedROOT, finish, init_distributed, ns_cost, wrap_model
    from rootopt.optim._coefficients import coefficients_for
    from rootopt.optim.functional import root_direction
    from rootopt_analysis import costmodel as P
    from rootopt_analysis.counters import CollectiveCounter

    info = init_distributed(backend=args.backend, timeout_s=600)
    dev = torch.device("cuda", info.local_rank) if args.backend == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    model = transformer_matrices(args.d_model, args.layers, args.vocab).to(dev)
    full_grads = {n: torch.randn_like(p) * 1e-2 for n, p in model.named_parameters()}
    if args.design in SHARDED:
        model = wrap_model(model, "fsdp")
    params = dict(model.named_parameters())
    p_root = sum(p.numel() for g in _groups(model)[:1] for p in g["params"])
    p_all = sum(p.numel() for p in params.values())
    stats: dict[str, Any] = {}
    groups = _groups(model)
    specs = [
        P.ParamSpec(f"p{i}", tuple(p.shape), g["algorithm"])
        for i, (g, p) in enumerate((g, p) for g in groups for p in g["params"])
    ]

    def set_grads() -> None:
        for n, p in params.items():
            g = full_grads[n]
            if args.design in SHARDED:
                p.grad = distribute_tensor(g, p.device_mesh, p.placements)
            else:
                p.grad = g.clone()

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if args.design in ("owner", *SHARDED):
        kw: dict[str, Any] = {"average_grads": True} if args.design == "owner" else {}
        opt: torch.optim.Optimizer = DistributedROOT(groups, lr=1e-3, **kw)

        def step() -> None:
            opt.step()
            s = opt.stats  # type: ignore[attr-defined]
            stats.update(
                ns_s=s.ns_seconds,
                comm_s=s.comm_seconds,
                ns_matrices=s.ns_matrices,
                ns_cost=s.ns_cost,
                sent=s.bytes_sent,
                received=s.bytes_received,
            )

    elif args.design == "adamw":
        opt = torch.optim.AdamW(params.values(), lr=1e-3, betas=(0.9, 0.95), foreach=True)
        grads_in_order = list(reversed(list(params.values())))  # about backward's order

        def step() -> None:
            if info.world_size > 1:  # DDP's reducer: bucketed all-reduce, then ÷ W
                bucket: list[torch.Tensor] = []
                for i, p in enumerate(grads_in_order):
                    bucket.append(p.grad)
                    size = sum(g.numel() for g in bucket) * 4
                    if size >= DDP_BUCKET_BYTES or i == len(grads_in_order) - 1:
                        flat = torch.cat([g.reshape(-1) for g in bucket])
                        dist.all_reduce(flat)
                        flat.div_(info.world_size)
                        off = 0
                        for g in bucket:
                            g.copy_(flat[off : off + g.numel()].view_as(g))
                            off += g.numel()
                        bucket = []
            opt.step()
            stats.update(ns_s=0.0, comm_s=math.nan, ns_matrices=0, ns_cost=0.0, sent=0, received=0)

    else:  # broadcast: rank 0 orthogonalizes everything, then one broadcast
        # for momentum, AdamW and schedules (one process's ROOT: every state on every rank)
        import rootopt

        opt = rootopt.ROOT(groups, lr=1e-3)
        for g in opt.param_groups:  # every state now (ROOT creates it at the first step)
            for p in g["params"]:
                opt._init_state(g, p)  # type: ignore[attr-defined]
        root_group = opt.param_groups[0]
        mats = root_group["params"]
        buf = torch.empty(sum(p.numel() for p in mats), device=dev)

        def step() -> None:
            t0 = time.perf_counter()
            n_ns, cost = 0, 0.0
            if info.rank == 0:
                off = 0
                for p in mats:
                    st = opt.state[p]
                    st["momentum_buffer"].mul_(0.95).add_(p.grad)
                    v = p.grad.add(st["momentum_buffer"], alpha=0.95)
                    sched = coefficients_for(opt._coeffs, root_group, dev)(*p.shape)  # type: ignore[attr-defined]
                    U = root_direction(v, sched, quantile=0.9)
                    buf[off : off + p.numel()] = U.reshape(-1)
                    off += p.numel()
                    n_ns += 1
                    cost += ns_cost(1, p.shape[0], p.shape[1], root_group["ns_steps"])
                sync()
            ns = time.perf_counter() - t0
            if info.world_size > 1:
                dist.broadcast(buf, src=0)
            off = 0
            for p in mats:
                p.data.mul_(1 - 1e-4).sub_(buf[off : off + p.numel()].view_as(p), alpha=1e-3)
                off += p.numel()
            nbytes = buf.numel() * 4
            stats.update(
                ns_s=ns,
                comm_s=math.nan,
                ns_matrices=n_ns,
                ns_cost=cost,
                sent=nbytes * (info.world_size - 1) if info.rank == 0 else 0,
                received=0 if info.rank == 0 or info.world_size == 1 else nbytes,
            )

    times, ns_times, comm_times = [], [], []
    for i in range(args.warmup + args.steps):
        set_grads()
        if info.world_size > 1:
            dist.barrier()
        sync()
        t0 = time.perf_counter()
        with CollectiveCounter() as counts:
            step()
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            ns_times.append(stats["ns_s"])
            comm_times.append(stats["comm_s"])
    traffic = math.nan  # one more step: its elementwise bytes (threshold + NS apart)
    if args.design == "owner":
        import rootopt.optim.functional as F
        from rootopt_analysis.counters import TrafficCounter

        set_grads()
        if info.world_size > 1:
            dist.barrier()
        with TrafficCounter([(F, "root_direction")]) as counted:
            step()
        traffic = float(counted.bytes)
    W = info.world_size
    if args.design in ("owner", *SHARDED):
        opts = P.Options(
            backend=args.backend,
            average_grads=args.design not in SHARDED,
            gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", W)),
        )
        est = P.estimate(specs, W, args.design, opts)  # type: ignore[arg-type]
        model_sent, model_received = est.step_sent[info.rank], est.step_received[info.rank]
        model_colls = est.exposed_collectives
    elif args.design == "adamw":
        model_sent = model_received = 2 * (W - 1) / W * p_all * 4  # ring all-reduce
        model_colls = -(-p_all * 4 // DDP_BUCKET_BYTES) if W > 1 else 0
    else:
        model_sent = model_received = float("nan")
        model_colls = -1
    # the optimizer state this rank holds (momentum, AdamW moments; step counts aside),
    # against one process's ROOT state divided by W (momentum per matrix element, two
    # moments per AdamW element)
    held = sum(
        (v.to_local() if hasattr(v, "to_local") else v).numel() * v.element_size()
        for st in opt.state.values()
        for k, v in st.items()
        if isinstance(v, torch.Tensor) and k != "step"
    )
    one = 4 * (p_root + 2 * (p_all - p_root))
    rec = {
        "traffic_bytes": traffic,  # counted (TrafficCounter), owner
        "design": args.design,
        "world": info.world_size,
        "rank": info.rank,
        "step_ms": 1e3 * statistics.median(times),
        "ns_ms": 1e3 * statistics.median(ns_times),
        # blocked in the optimizer's collectives (StepStats.comm_seconds; NaN: not timed)
        "comm_ms": 1e3 * statistics.median(comm_times),
        "ns_matrices": stats["ns_matrices"],
        "ns_cost": stats["ns_cost"],
        "bytes_sent": counts.bytes_sent,
        "bytes_received": counts.bytes_received,
        "collectives": counts.collectives,
        "by_op": counts.by_op(),
        "model_sent": float(model_sent),
        "model_received": float(model_received),
        "model_collectives": int(model_colls),
        "adamw_bytes": 2 * (W - 1) / W * p_all * 4,  # DDP AdamW's ring all-reduce
        "root_params": p_root,
        "all_params": p_all,
        "state_bytes": held,
        "state_vs_one_over_w": held / (one / W) if args.design != "adamw" else math.nan,
        "peak_rss_mib": _peak_rss_mib(),
        "peak_cuda_mib": torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else None,
    }
    with open(Path(args.out) / f"rank{info.rank}.json", "w") as fh:
        json.dump(rec, fh)
    finish(0)


# ---------------------------------------------------------------------------------------
# calibration: microbenchmarks (one rank), the model's prediction, the measured steps
# ---------------------------------------------------------------------------------------
COLL_ELEMENTS = (1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22)  # float32 per rank
COLL_OPS = ("all_to_all_single", "all_gather_into_tensor", "all_reduce")
COLL_KINDS = ("all_to_all", "all_gather", "all_reduce")  # plan.LINK_KINDS, per op
ALONE_CONSTANTS = ("ns_flops_per_s", "memory_bytes_per_s", "clip_s_per_element")


def _median_time(fn: Any, reps: int, sync: Any = None) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


FLUSH_BYTES = 256 << 20  # more than any CPU's last-level cache: evicts a pass's tensors


def streaming_rate(model: nn.Module, groups: list[dict[str, Any]], reps: int) -> float:
    """Bytes/s of the step's own elementwise functions on tensors shaped like the model's
    parameters: the non-finite check (every gradient), momentum + Nesterov and decay +
    update (the matrices), AdamW (the rest), and a bucket's flatten + copy back (every
    gradient). Bytes as ``TrafficCounter`` counts them; each timed call starts from a
    cold cache (a 256 MiB write first), as in a step, where the Newton–Schulz workspace
    and the other passes evict a pass's tensors (warm, on a model that fits the
    last-level cache, ``apply_`` alone ran at 85 GB/s, all the passes cold at 24.7:
    docs/distributed.md)."""
    from rootopt.optim._finite import finite_flags
    from rootopt.optim.adamw import adamw_
    from rootopt.optim.functional import apply_, momentum_
    from rootopt_analysis.counters import TrafficCounter

    mats, rest = list(groups[0]["params"]), list(groups[1]["params"])
    R, A = [torch.randn_like(p) for p in mats], [torch.randn_like(p) for p in rest]
    g_r, g_a = [torch.randn_like(p) for p in R], [torch.randn_like(p) for p in A]
    bufs, U = [torch.zeros_like(p) for p in R], [torch.randn_like(p) for p in R]
    m, v = [torch.zeros_like(p) for p in A], [torch.zeros_like(p) for p in A]
    steps = [torch.tensor(1.0) for _ in A]
    grads = g_r + g_a

    def bucket() -> None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    passes = [
        lambda: finite_flags(grads),
        lambda: momentum_(bufs, g_r, momentum=0.95, nesterov=True),
        lambda: apply_(R, U, lr=1e-3, weight_decay=0.1, scales=[1.0] * len(R)),
        lambda: adamw_(A, g_a, m, v, steps, lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                       weight_decay=0.1),
        bucket,
    ]  # fmt: skip
    flush = torch.empty(FLUSH_BYTES // 4)
    nbytes = seconds = 0.0
    for fn in passes:
        with TrafficCounter() as traffic:
            fn()
        nbytes += traffic.bytes
        seconds += _median_time(fn, reps, sync=lambda: flush.fill_(1.0))
    return nbytes / seconds


def compute_constants(args: argparse.Namespace, reps: int = 5) -> dict[str, float]:
    """This rank's Newton–Schulz FLOP/s, the bytes/s of streaming elementwise passes and
    the seconds per ROOT element of the quantile + clamp, on the bench model's tensors
    (ROOT's own functions; one torch thread)."""
    import rootopt
    from rootopt.optim._coefficients import coefficients_for
    from rootopt.optim.functional import root_direction
    from rootopt.optim.quantile import abs_quantile
    from rootopt_analysis import costmodel as P

    torch.manual_seed(0)
    model = transformer_matrices(args.d_model, args.layers, args.vocab)
    groups = _groups(model)
    opt = rootopt.ROOT(groups, lr=1e-3)
    group = opt.param_groups[0]
    mats = list(group["params"])
    q = float(group["outlier_quantile"])
    flops = ns_s = 0.0
    for shape in sorted({tuple(p.shape) for p in mats}):
        n = sum(1 for p in mats if tuple(p.shape) == shape)
        sched = coefficients_for(opt._coeffs, group, torch.device("cpu"))(*shape)
        V = torch.randn(shape)
        t = _median_time(
            lambda V=V, sched=sched: root_direction(V.clone(), sched, quantile=None), reps
        )
        ns_s += n * t
        flops += n * P.ns_flops(P.ParamSpec("m", shape), group["ns_steps"])
    vs = [torch.randn_like(p) for p in mats]

    def clip() -> None:
        for v in vs:  # the clip as root_direction does it on the CPU
            v.clamp_(-(e := float(abs_quantile(v, q))), e)

    clip_s = _median_time(clip, reps) / sum(p.numel() for p in mats)
    stream = streaming_rate(model, groups, reps)
    return {
        "ns_flops_per_s": flops / ns_s,
        "memory_bytes_per_s": stream,
        "clip_s_per_element": clip_s,
    }


def calib_worker(args: argparse.Namespace) -> None:
    """One rank of a microbenchmark launch: compute constants while all W ranks compute
    at once (a check of the shared-cores term), then gloo collective times by size."""
    import torch.distributed as dist

    from rootopt.distributed import finish, init_distributed
    from rootopt_analysis.counters import collective_bytes

    info = init_distributed(backend="gloo", timeout_s=600)
    W, rank = info.world_size, info.rank
    barrier = dist.barrier if W > 1 else (lambda: None)
    barrier()
    rec: dict[str, Any] = {"world": W, "rank": rank, **compute_constants(args)}
    points: list[dict[str, Any]] = []
    for op in COLL_OPS if W > 1 else ():
        for n in COLL_ELEMENTS:
            if op == "all_to_all_single":
                inp, out = torch.randn(W * n), torch.empty(W * n)
                fn: Any = lambda out=out, inp=inp: dist.all_to_all_single(out, inp)  # noqa: E731
                s, r = collective_bytes(op, "gloo", W, rank, in_splits=[n] * W, out_splits=[n] * W)
            elif op == "all_gather_into_tensor":
                inp, out = torch.randn(n), torch.empty(W * n)
                fn = lambda out=out, inp=inp: dist.all_gather_into_tensor(out, inp)  # noqa: E731
                s, r = collective_bytes(op, "gloo", W, rank, numel=n)
            else:
                inp = torch.randn(n)
                fn = lambda inp=inp: dist.all_reduce(inp)  # noqa: E731
                s, r = collective_bytes(op, "gloo", W, rank, numel=n)
            reps = 9 if n <= 1 << 18 else 5
            t = _median_time(fn, reps, sync=barrier)
            points.append({"op": op, "elements": n, "bytes": max(s, r), "seconds": t})
    rec["collectives"] = points
    with open(Path(args.out) / f"rank{rank}.json", "w") as fh:
        json.dump(rec, fh)
    finish(0)


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "nan"


def calibrate(args: argparse.Namespace) -> int:
    from rootopt_analysis import costmodel as P

    try:
        cores = float(len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        cores = float(os.cpu_count() or 1)
    args.backend = "gloo"
    worlds = [w for w in args.worlds if w > 1] or [2, 3, 4]
    # the one-rank constants, each the median over --repeats launches (a single launch
    # that ran slow biased every prediction of a model by 40-75 %: docs/distributed.md)
    alones = [launch(args, "calib", 1)[0] for _ in range(args.repeats)]
    alone = {k: statistics.median(a[k] for a in alones) for k in ALONE_CONSTANTS}
    print(
        f"calibration: d_model={args.d_model} layers={args.layers} vocab={args.vocab} gloo, "
        f"1 thread/rank, {cores:.0f} cores ({torch.backends.cpu.get_cpu_capability()}), "
        f"torch={torch.__version__}, load {_loadavg()}"
    )
    print(
        f"  one rank alone: Newton–Schulz {alone['ns_flops_per_s'] / 1e9:.2f} GFLOP/s, "
        f"streaming passes {alone['memory_bytes_per_s'] / 1e9:.2f} GB/s (read + written), "
        f"quantile + clamp {1e9 * alone['clip_s_per_element']:.2f} ns per ROOT element"
        f" (median of {len(alones)} launches: NS "
        + " ".join(f"{a['ns_flops_per_s'] / 1e9:.1f}" for a in alones)
        + ")"
    )
    torch.manual_seed(0)
    model = transformer_matrices(args.d_model, args.layers, args.vocab)
    specs = [
        P.ParamSpec(f"p{i}", tuple(p.shape), g["algorithm"])
        for i, (g, p) in enumerate((g, p) for g in _groups(model) for p in g["params"])
    ]
    rows: list[dict[str, Any]] = []
    for W in worlds:
        # the same microbenchmarks with all W ranks at once, --repeats launches: per
        # launch the slowest rank's rates, then the median over launches
        together = [launch(args, "calib", W) for _ in range(args.repeats)]
        slowest = [
            {
                "ns_flops_per_s": min(r["ns_flops_per_s"] for r in recs),
                "memory_bytes_per_s": min(r["memory_bytes_per_s"] for r in recs),
                "clip_s_per_element": max(r["clip_s_per_element"] for r in recs),
            }
            for recs in together
        ]
        at_once = {k: statistics.median(c[k] for c in slowest) for k in ALONE_CONSTANTS}
        share = min(1.0, cores / W)
        print(
            f"  W={W}: all {W} ranks at once (slowest rank, median of {len(together)} "
            f"launches): Newton–Schulz {at_once['ns_flops_per_s'] / 1e9:.2f} GFLOP/s, "
            f"streaming {at_once['memory_bytes_per_s'] / 1e9:.2f} GB/s, quantile + clamp "
            f"{1e9 * at_once['clip_s_per_element']:.2f} ns; alone × min(1, cores/W): "
            f"{share * alone['ns_flops_per_s'] / 1e9:.2f} GFLOP/s, "
            f"{share * alone['memory_bytes_per_s'] / 1e9:.2f} GB/s, "
            f"{1e9 * alone['clip_s_per_element'] / share:.2f} ns"
        )
        # one line through the slowest rank's times of every op and size (the median
        # over launches of each launch's slowest rank)
        times: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for recs in together:
            worst: dict[tuple[str, int], tuple[float, float]] = {}
            for r in recs:
                for pt in r["collectives"]:
                    key = (pt["op"], pt["elements"])
                    if key not in worst or pt["seconds"] > worst[key][1]:
                        worst[key] = (pt["bytes"], pt["seconds"])
            for key, v in worst.items():
                times.setdefault(key, []).append(v)
        fit = {k: (v[0][0], statistics.median(t for _, t in v)) for k, v in times.items()}
        # per collective kind: latency = its smallest message's time (at W > cores mostly
        # the scheduling delay of ranks that share a core), link = the slope above it
        links: dict[str, tuple[float, float]] = {}
        for op, kind in zip(COLL_OPS, COLL_KINDS):
            links[kind] = P.fit_link([v for k, v in fit.items() if k[0] == op])
            lat, bw = links[kind]
            print(f"    {op:<24} latency {1e6 * lat:8.0f} µs  link {bw / 1e6:8.0f} MB/s")
        # --constants alone (default): one rank's rates, shared min(1, cores/W) by
        # step_time; together: the slowest rank's rates with all W at once (contention
        # included, so no share on top). docs/distributed.md compares them.
        if args.constants == "together":
            base, units = at_once, math.inf
        else:
            base, units = alone, cores
        hw = P.measured_hardware(
            f"this machine at W={W}",
            ns_flops_per_s=base["ns_flops_per_s"],
            memory_bytes_per_s=base["memory_bytes_per_s"],
            clip_s_per_element=base["clip_s_per_element"],
            links=links,
            compute_units=units,
        )
        # --repeats launches; measured = the median over launches of each launch's
        # slowest-rank median step
        launches: dict[str, list[list[dict[str, Any]]]] = {"owner": []}
        for _ in range(args.repeats):
            for design in launches:
                launches[design].append(launch(args, design, W))
        for design in launches:
            opts = P.Options(backend="gloo", average_grads=True)
            est = P.estimate(specs, W, design, opts)  # type: ignore[arg-type]
            t = P.step_time(est, hw)
            # what StepStats.ns_seconds times is the owner's whole update (threshold and
            # Newton–Schulz, and the momentum and decay passes around them); the model's
            # side of that column is its threshold + Newton–Schulz (the clamp is booked
            # under elementwise)
            thr = t.threshold
            load = _loadavg()
            per_launch = sorted(max(r["step_ms"] for r in rs) / 1e3 for rs in launches[design])
            measured = statistics.median(per_launch)
            # the step split on the rank the others wait for (the least time blocked in
            # collectives, StepStats.comm_seconds): its threshold + NS, its collectives
            # (close to the wire time: nobody is late for it) and the rest (elementwise
            # passes, bucket copies, Python)
            crit = [min(rs, key=lambda r: r["comm_ms"]) for rs in launches[design]]
            split = {
                k: statistics.median(f(r) for r in crit)
                for k, f in (
                    ("ns", lambda r: r["ns_ms"]),
                    ("comm", lambda r: r["comm_ms"]),
                    ("other", lambda r: r["step_ms"] - r["ns_ms"] - r["comm_ms"]),
                )
            }
            rows.append(
                {
                    "world": W,
                    "design": design,
                    "constants": {"kind": args.constants, **base},
                    "predicted_ms": 1e3 * t.optimizer,
                    "ns_ms": 1e3 * t.ns,
                    "threshold_ns_ms": 1e3 * (t.ns + thr),
                    "elementwise_ms": 1e3 * t.elementwise,
                    "comm_ms": 1e3 * t.comm,
                    "latency_ms": 1e3 * t.latency,
                    "measured_ms": 1e3 * measured,
                    # the in-step threshold + orthogonalization (StepStats.ns_seconds),
                    # slowest rank: which term of the model a miss comes from
                    "measured_ns_ms": statistics.median(
                        max(r["ns_ms"] for r in rs) for rs in launches[design]
                    ),
                    "launches_ms": [1e3 * x for x in per_launch],
                    # by term, model vs the critical rank (above)
                    "model_comm_ms": 1e3 * (t.comm + t.latency),
                    "model_other_ms": 1e3 * (t.elementwise - thr),
                    "crit_ns_ms": split["ns"],
                    "crit_comm_ms": split["comm"],
                    "crit_other_ms": split["other"],
                    # elementwise bytes of the busiest rank: the model's, and counted
                    "traffic_model_mb": float(est.traffic.max()) / 1e6,
                    "traffic_counted_mb": statistics.median(
                        max(r["traffic_bytes"] for r in rs) for rs in launches[design]
                    )
                    / 1e6,
                    "ratio": t.optimizer / measured,
                    "load": load,
                }
            )
    print(
        f"{'W':>3} {'design':<7}{'predicted ms':>13}{'(NS':>8}{'elem':>7}{'comm':>7}"
        f"{'lat)':>7}{'thr+NS':>8}{'measured ms':>12}{'(thr+NS)':>9}{'ratio':>7}{'load':>6}"
        f"  verdict (±{100 * args.tolerance:.0f} %)   launches (ms)"
    )
    ok = True
    for r in rows:
        hit = abs(r["ratio"] - 1) <= args.tolerance
        ok &= hit
        print(
            f"{r['world']:>3} {r['design']:<7}{r['predicted_ms']:>13.1f}{r['ns_ms']:>8.1f}"
            f"{r['elementwise_ms']:>7.1f}{r['comm_ms']:>7.1f}{r['latency_ms']:>7.1f}"
            f"{r['threshold_ns_ms']:>8.1f}{r['measured_ms']:>12.1f}{r['measured_ns_ms']:>9.1f}"
            f"{r['ratio']:>7.2f}{r['load']:>6}  "
            + ("within " if hit else "outside")
            + "   "
            + " ".join(f"{x:.0f}" for x in r["launches_ms"])
        )
    print(
        "by term, model / measured on the rank the others wait for (least time blocked in"
        " collectives):"
    )
    print(
        f"{'W':>3} {'design':<7}{'thr+NS':>20}{'elementwise+rest':>20}{'comm+latency':>20}"
        f"{'elementwise MB':>22}"
    )
    for r in rows:
        cells = [
            (r["threshold_ns_ms"], r["crit_ns_ms"]),
            (r["model_other_ms"], r["crit_other_ms"]),
            (r["model_comm_ms"], r["crit_comm_ms"]),
            (r["traffic_model_mb"], r["traffic_counted_mb"]),
        ]
        print(
            f"{r['world']:>3} {r['design']:<7}"
            + "".join(
                f"{f'{a:.1f} / {b:.1f} ({a / b if b > 0 else math.nan:.2f})':>22}" for a, b in cells
            )
        )
    print(
        "verdict:",
        "every W within" if ok else "not every W within",
        f"±{100 * args.tolerance:.0f} %",
    )
    if args.json:
        with open(args.json, "x") as fh:
            out = {"machine": machine(), "alone": alone, "alone_launches": alones, "rows": rows}
            fh.write(json.dumps(out, indent=1))
    return 0


# ---------------------------------------------------------------------------------------
# rootopt train at several world sizes: ROOT (no DDP wrapper) against AdamW under DDP
# ---------------------------------------------------------------------------------------
def train_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``rootopt train`` under torchrun at each W > 1 of ``--worlds`` with ROOT and with
    AdamW: the median ``comm_bytes`` per step (rank 0's metrics.jsonl), the steps/s and
    tokens/s after two warm-up steps (and MFU where the run logs it), the final loss."""
    n = args.train_steps
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        data: Path | None = None
        for world in [w for w in args.worlds if w > 1]:
            for optimizer in ("ROOT", "AdamW"):
                run = Path(tmp) / f"{optimizer}-{world}"
                cmd = [
                    sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={world}", "-m", "rootopt.train", "--log_dir", str(run),
                    *(["--data_path", str(data)] if data is not None else []),
                    f"run.max_steps={n}", "run.log_every=1", "run.eval_every=0",
                    f"checkpoint.every={n}", "monitoring.progress_bar=false",
                    "monitoring.tensorboard=false", "monitoring.plot=false",
                    "monitoring.histogram_every=0", f"optimization.optimizer={optimizer}",
                    *args.train_set,
                ]  # fmt: skip
                env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
                env["PYTHONPATH"] = os.pathsep.join(
                    [
                        str(HERE.parent / "src"),
                        str(HERE.parent / "analysis"),
                        env.get("PYTHONPATH", ""),
                    ]
                )
                proc = subprocess.run(
                    cmd, env=env, capture_output=True, text=True, timeout=args.timeout
                )
                if proc.returncode != 0:
                    sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
                    raise SystemExit(f"bench_dist: rootopt train {optimizer} at {world} failed")
                if data is None:
                    data = run / "data"  # prepared by the first run, read by the others
                recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
                steps = [r for r in recs if r.get("loss") is not None and "steps_per_s" in r]
                later = steps[2:] or steps
                comm = [r["comm_bytes"] for r in steps if "comm_bytes" in r]
                mfu = [r["mfu"] for r in later if isinstance(r.get("mfu"), (int, float))]
                rows.append(
                    {
                        "world": world,
                        "optimizer": optimizer,
                        "steps": len(steps),
                        "comm_bytes": statistics.median(comm) if comm else math.nan,
                        "steps_per_s": statistics.median(r["steps_per_s"] for r in later),
                        "tokens_per_s": statistics.median(
                            r["tokens_per_s"] for r in later if r.get("tokens_per_s")
                        ),
                        "mfu": statistics.median(mfu) if mfu else None,
                        "final_loss": steps[-1]["loss"],
                        "overrides": list(args.train_set),
                    }
                )
    for w in {r["world"] for r in rows}:
        here = {r["optimizer"]: r for r in rows if r["world"] == w}
        ratio = here["ROOT"]["comm_bytes"] / here["AdamW"]["comm_bytes"]
        here["ROOT"]["comm_vs_adamw"] = ratio
    return rows


def machine() -> dict[str, Any]:
    """What the numbers were measured on, and the code (the commit) they were measured with."""
    import platform

    try:
        commit = subprocess.run(
            ["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()  # fmt: skip
        dirty = bool(
            subprocess.run(
                ["git", "-C", str(HERE.parent), "status", "--porcelain", "--", "src", "benchmarks"],
                capture_output=True, text=True, timeout=10,
            ).stdout.strip()
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", False
    return {
        "commit": commit + ("+changes" if dirty else ""),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cores": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load": _loadavg(),
    }


# ---------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(args: argparse.Namespace, design: str, world: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "1", "--nproc_per_node", str(world),
            "--rdzv-backend", "c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
            str(Path(__file__).resolve()), "--worker", "--design", design, "--out", out,
            "--d-model", str(args.d_model), "--layers", str(args.layers),
            "--vocab", str(args.vocab), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--backend", args.backend,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        # the workers count bytes with rootopt_analysis.counters: this checkout's copy
        paths = [str(HERE.parent / d) for d in ("src", "analysis")]
        env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-8000:])
            raise SystemExit(f"bench_dist: {design} at world {world} failed (rc {proc.returncode})")
        recs = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    if len(recs) != world:
        raise SystemExit(f"bench_dist: {design} at world {world}: {len(recs)} rank results")
    return recs


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--designs", nargs="+", choices=DESIGNS, default=list(DESIGNS))
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    ap.add_argument("--json", default="")
    ap.add_argument("--train", action="store_true", help="add the rootopt train rows")
    ap.add_argument("--train-steps", type=int, default=20, help="--train: steps per run")
    ap.add_argument(
        "--train-set", nargs="*", default=[], metavar="KEY=VALUE",
        help="--train: config overrides (default: the embedded default model)",
    )  # fmt: skip
    ap.add_argument(
        "--calibrate", action="store_true", help="check the cost model's time (see above)"
    )
    ap.add_argument("--tolerance", type=float, default=0.15, help="--calibrate's target")
    ap.add_argument(
        "--constants",
        choices=("alone", "together"),
        default="alone",
        help="--calibrate: compute rates of one rank alone, shared min(1, cores/W) "
        "(default), or of the slowest rank with all W ranks at once",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="--calibrate: launches per design and W (interleaved) and of the one-rank "
        "constants; medians are compared",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--design", default="owner", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats: must be at least 1")
    if args.json and os.path.lexists(args.json):  # checked before any run, never overwritten
        ap.error("--json PATH: the file exists; name a new one")
    if args.worker:
        if args.design == "calib":
            calib_worker(args)
        else:
            worker(args)
        return 0
    if args.calibrate:
        return calibrate(args)
    rows: list[dict[str, Any]] = []
    for world in args.worlds:
        for design in args.designs:
            rows.extend(launch(args, design, world))
    head = (
        f"{'design':<10}{'W':>3}{'rank':>5}{'step ms':>10}{'NS ms':>9}{'NS mats':>8}"
        f"{'NS work':>9}{'sent MiB':>10}{'recv MiB':>10}{'model MiB':>10}{'xAdamW':>7}"
        f"{'colls':>6}{'model':>6}{'state MiB':>10}{'x1/W':>6}{'peak RSS MiB':>13}"
    )
    print(
        f"d_model={args.d_model} layers={args.layers} vocab={args.vocab} backend={args.backend} "
        f"threads/rank={args.threads} steps={args.steps} (median) torch={torch.__version__}"
    )
    print(head)
    mib = 2.0**20
    for r in rows:
        total_cost = sum(
            x["ns_cost"] for x in rows if x["design"] == r["design"] and x["world"] == r["world"]
        )
        share = r["ns_cost"] / total_cost if total_cost else float("nan")
        most = max(r["bytes_sent"], r["bytes_received"])
        vs_adamw = most / r["adamw_bytes"] if r["adamw_bytes"] else float("nan")
        print(
            f"{r['design']:<10}{r['world']:>3}{r['rank']:>5}{r['step_ms']:>10.1f}{r['ns_ms']:>9.1f}"
            f"{r['ns_matrices']:>8}{share:>9.2f}{r['bytes_sent'] / mib:>10.2f}"
            f"{r['bytes_received'] / mib:>10.2f}{r['model_sent'] / mib:>10.2f}"
            f"{vs_adamw:>7.3f}{r['collectives']:>6}{r['model_collectives']:>6}"
            f"{r['state_bytes'] / mib:>10.2f}{r['state_vs_one_over_w']:>6.2f}"
            f"{r['peak_rss_mib']:>13.0f}"
        )
    train = train_rows(args) if args.train else []
    if train:
        print(f"rootopt train, {args.train_steps} steps, overrides {args.train_set or 'none'}:")
        print(
            f"{'W':>3} {'optimizer':<9}{'comm B/step':>13}{'xAdamW':>8}{'steps/s':>9}{'tokens/s':>10}{'final loss':>11}"
        )
        for t in train:
            print(
                f"{t['world']:>3} {t['optimizer']:<9}{t['comm_bytes']:>13.0f}"
                f"{t.get('comm_vs_adamw', 1.0):>8.4f}{t['steps_per_s']:>9.2f}"
                f"{t['tokens_per_s']:>10.0f}{t['final_loss']:>11.4f}"
            )
    if args.json:
        out = {
            "machine": machine(),
            "args": {k: v for k, v in vars(args).items() if k not in ("worker", "design", "out")},
            "rows": rows,
            "train": train,
        }
        with open(args.json, "x") as fh:
            fh.write(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
