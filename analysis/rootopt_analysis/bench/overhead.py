"""Overhead: step time and optimizer-state memory relative to AdamW on the same model, and the
orthogonalization's achieved GFLOP/s against this machine's measured float32 matmul peak.

Timed in the calling process with one thread (warm-up steps first, then the median of timed
steps), so numbers are comparable across optimizers on the same machine at the same time.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from rootopt._threads import one_thread
from rootopt.config import ModelConfig
from rootopt.optim.registry import REGISTRY, make_optimizer
from rootopt.tasks import LM_SEQ
from rootopt.train.models import LlamaLM, loss_fn

MODELS = {
    "lm-d64": ModelConfig(
        kind="llama", vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2
    ),
    "lm-d256": ModelConfig(
        kind="llama", vocab_size=256, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4
    ),
}
BIG_MODEL_OPTIMIZERS = ("adamw", "muon", "root", "root-svd")


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )


def time_optimizer(name: str, cfg: ModelConfig, *, steps: int, warmup: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = LlamaLM(cfg, LM_SEQ)
    spec = REGISTRY[name]
    opt, _ = make_optimizer(
        name, model, lr=spec.lr, weight_decay=0.1 if spec.decoupled_weight_decay else 0.0
    )
    gen = torch.Generator().manual_seed(0)
    # the model's own vocabulary (cfg.vocab_size 0 means the tokenizer's: byte tokens here)
    x = torch.randint(0, model.embed.num_embeddings, (16, LM_SEQ + 1), generator=gen)
    total, opt_only = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss = loss_fn(model(x[:, :-1]), x[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        if i >= warmup:
            total.append(t2 - t0)
            opt_only.append(t2 - t1)
    return {
        "step_ms": 1e3 * statistics.median(total),
        "opt_step_ms": 1e3 * statistics.median(opt_only),
        "state_bytes": _state_bytes(opt),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


def matmul_peak(sizes: tuple[int, ...] = (256, 512, 1024), reps: int = 5) -> dict[str, Any]:
    """Best float32 GEMM GFLOP/s over a few square sizes (one thread)."""
    best, rows = 0.0, {}
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            a @ b
            ts.append(time.perf_counter() - t0)
        g = 2 * n**3 / min(ts) / 1e9
        rows[str(n)] = g
        best = max(best, g)
    return {"gflops_by_size": rows, "peak_gflops": best}


def ortho_throughput(cfg: ModelConfig, *, reps: int = 5, ns_steps: int = 5) -> list[dict[str, Any]]:
    """GFLOP/s of 5-step Newton–Schulz on every distinct ROOT-routed shape of the model.

    FLOPs per iteration on ``X`` (m×n, m ≤ n after transposing): ``A = X Xᵀ`` 2m²n,
    ``B = bA + cA²`` 2m³, ``BX`` 2m²n.
    """
    from rootopt.optim.routing import param_groups
    from rootopt.ortho import orthogonalize

    model = LlamaLM(cfg, LM_SEQ)
    groups, _ = param_groups(model)
    shapes = sorted(
        {tuple(p.shape) for g in groups if g["algorithm"] == "root" for p in g["params"]}
    )
    out = []
    for shape in shapes:
        G = torch.randn(*shape)
        orthogonalize(G, steps=ns_steps)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            orthogonalize(G, steps=ns_steps)
            ts.append(time.perf_counter() - t0)
        m, n = min(shape), max(shape)
        flops = ns_steps * (4 * m * m * n + 2 * m**3)
        out.append({"shape": list(shape), "ms": 1e3 * min(ts), "gflops": flops / min(ts) / 1e9})
    return out


def overhead(
    *, quick: bool, optimizers: tuple[str, ...] | list[str], progress: bool
) -> dict[str, Any]:
    """Step time and state bytes per optimizer, on one thread (the caller's thread count
    is restored afterwards)."""
    with one_thread():
        return _overhead(quick=quick, optimizers=optimizers, progress=progress)


def _overhead(
    *, quick: bool, optimizers: tuple[str, ...] | list[str], progress: bool
) -> dict[str, Any]:
    t0 = time.perf_counter()
    steps, warmup = (3, 1) if quick else (10, 2)
    models: dict[str, Any] = {}
    for mname, mcfg in MODELS.items():
        if quick and mname != "lm-d64":
            continue
        names = [o for o in optimizers if mname == "lm-d64" or o in BIG_MODEL_OPTIMIZERS]
        if "adamw" not in names:
            names = ["adamw", *names]
        rows = {}
        for name in names:
            rows[name] = time_optimizer(name, mcfg, steps=steps, warmup=warmup)
            if progress:
                r = rows[name]
                print(
                    f"[overhead {mname}] {name:<20} step {r['step_ms']:.1f} ms, "
                    f"optimizer {r['opt_step_ms']:.1f} ms, state {r['state_bytes'] / 1024:.0f} KiB",
                    flush=True,
                )
        base = rows["adamw"]
        for r in rows.values():
            r["step_vs_adamw"] = r["step_ms"] / base["step_ms"]
            r["state_vs_adamw"] = (
                r["state_bytes"] / base["state_bytes"] if base["state_bytes"] else None
            )
            # Total training memory proxy: parameters + gradients + optimizer state.
            r["train_memory_vs_adamw"] = (2 * r["param_bytes"] + r["state_bytes"]) / (
                2 * base["param_bytes"] + base["state_bytes"]
            )
        models[mname] = {
            "config": {
                k: getattr(mcfg, k) for k in ("d_model", "n_layers", "n_heads", "n_kv_heads")
            },
            "optimizers": rows,
        }
    peak = matmul_peak((256, 512) if quick else (256, 512, 1024))
    big = MODELS["lm-d64" if quick else "lm-d256"]
    ortho = ortho_throughput(big, reps=2 if quick else 5)
    for o in ortho:
        o["fraction_of_peak"] = o["gflops"] / peak["peak_gflops"]
    return {
        "threads": 1,
        "timed_steps": steps,
        "models": models,
        "matmul": peak,
        "orthogonalization": ortho,
        "wall_s": time.perf_counter() - t0,
    }
