"""Optimizer step time, quantile cost and state memory on a small transformer's matrices.

Measures, in one run and on the same weights/gradients:
  * step time of ROOT (batched and reference path), ROOT's Muon mode, torch.optim.Muon and
    fused AdamW, reported as ratios to AdamW and to torch.optim.Muon;
  * per shape: exact quantile (rootopt.abs_quantile vs torch.quantile) vs Newton–Schulz;
  * optimizer-state bytes per parameter byte.

Usage: python benchmarks/bench_step.py [--d-model 768] [--layers 2] [--steps 3] [--json out.json]
Large elementwise ops are much slower with glibc's default malloc trimming, so the script
re-executes itself with MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 unless
--no-malloc-tuning is given; the setting is printed with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import rootopt
from rootopt.coeffs import resolve
from rootopt.ortho import newton_schulz

MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "68719476736"}


def transformer_matrices(d: int, layers: int, vocab: int) -> nn.Module:
    """The weights of a GPT-2-style decoder (fused QKV, 4x MLP), tied embedding."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.proj = nn.Linear(d, d, bias=False)
            self.fc = nn.Linear(d, 4 * d, bias=False)
            self.fc_out = nn.Linear(4 * d, d, bias=False)
            self.ln1 = nn.LayerNorm(d)
            self.ln2 = nn.LayerNorm(d)

    model = nn.Module()
    model.wte = nn.Embedding(vocab, d)
    model.blocks = nn.ModuleList(Block() for _ in range(layers))
    model.ln_f = nn.LayerNorm(d)
    return model


def timeit(fn: Callable[[], Any], steps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps


def state_bytes(opt: torch.optim.Optimizer) -> int:
    total = 0
    for s in opt.state.values():
        for v in s.values():
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--json", default="", help="also write the results as JSON here")
    ap.add_argument("--no-malloc-tuning", action="store_true")
    args = ap.parse_args()
    if not args.no_malloc_tuning and any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    model = transformer_matrices(args.d_model, args.layers, args.vocab)
    params = list(model.parameters())
    grads = [torch.randn_like(p) * 1e-2 for p in params]
    init = [p.detach().clone() for p in params]

    def reset() -> None:
        with torch.no_grad():
            for p, p0, g in zip(params, init, grads):
                p.copy_(p0)
                p.grad = g.clone()

    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and not n.startswith("wte")]
    others = [p for p in params if all(p is not m for m in matrices)]

    def root(**kw: Any) -> torch.optim.Optimizer:
        groups, _ = rootopt.param_groups(model, lr=1e-3)
        return rootopt.ROOT(groups, **kw)

    def torch_muon() -> list[torch.optim.Optimizer]:
        return [
            torch.optim.Muon(matrices, lr=1e-3, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(others, lr=1e-3, betas=(0.9, 0.95), fused=True),
        ]

    contenders: dict[str, Callable[[], list[torch.optim.Optimizer]]] = {
        "adamw_fused": lambda: [torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), fused=True)],
        "root": lambda: [root()],
        "root_reference_path": lambda: [root(batched=False)],
        "root_bf16_ns": lambda: [root(ns_dtype="bfloat16")],
        "root_muon_mode_fp32": lambda: [root(outlier_quantile=None, ns_coefficients="muon")],
        "root_muon_mode_bf16": lambda: [
            root(outlier_quantile=None, ns_coefficients="muon", ns_dtype="bfloat16")
        ],
        "torch_muon": torch_muon,
    }
    results: dict[str, Any] = {
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
            "malloc_env": {k: os.environ.get(k) for k in MALLOC_ENV},
        },
        "model": {
            "d_model": args.d_model,
            "layers": args.layers,
            "matrix_params": sum(p.numel() for p in matrices),
            "all_params": sum(p.numel() for p in params),
        },
        "step_s": {},
        "state_bytes_per_param_byte": {},
    }
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    for name, make in contenders.items():
        reset()
        opts = make()

        def step(opts: list[torch.optim.Optimizer] = opts) -> None:
            for o in opts:
                o.step()

        results["step_s"][name] = timeit(step, args.steps)
        results["state_bytes_per_param_byte"][name] = (
            sum(state_bytes(o) for o in opts) / param_bytes
        )
        print(f"  {name:<22} {results['step_s'][name] * 1e3:9.1f} ms/step", flush=True)
    base, muon = results["step_s"]["adamw_fused"], results["step_s"]["torch_muon"]
    results["ratio_vs_adamw"] = {k: v / base for k, v in results["step_s"].items()}
    results["ratio_vs_torch_muon"] = {k: v / muon for k, v in results["step_s"].items()}

    shapes = sorted({tuple(p.shape) for p in matrices})
    per_shape = []
    for shape in shapes:
        M = torch.randn(*shape)
        sched = resolve("adanewton", shape[0], shape[1], 5)
        t_q = timeit(lambda M=M: rootopt.abs_quantile(M, 0.9), args.steps)
        t_tq = timeit(lambda M=M: torch.quantile(M.abs().flatten(), 0.9), args.steps)
        t_ns = timeit(lambda M=M, s=sched: newton_schulz(M, s), args.steps)
        t_ns16 = timeit(lambda M=M, s=sched: newton_schulz(M, s, dtype=torch.bfloat16), args.steps)
        per_shape.append(
            {
                "shape": list(shape),
                "abs_quantile_ms": t_q * 1e3,
                "torch_quantile_ms": t_tq * 1e3,
                "quantile_speedup": t_tq / t_q,
                "ns5_fp32_ms": t_ns * 1e3,
                "ns5_bf16_ms": t_ns16 * 1e3,
                "quantile_over_ns_fp32": t_q / t_ns,
            }
        )
    results["quantile_vs_ns"] = per_shape

    print(f"\nmachine: {results['machine']}")
    print(f"model: {results['model']}\n")
    print(f"{'optimizer':<22} {'ms/step':>9} {'x AdamW':>8} {'x Muon':>8} {'state B/param B':>16}")
    for k, v in results["step_s"].items():
        print(
            f"{k:<22} {v * 1e3:9.1f} {results['ratio_vs_adamw'][k]:8.2f} "
            f"{results['ratio_vs_torch_muon'][k]:8.2f} {results['state_bytes_per_param_byte'][k]:16.2f}"
        )
    print(
        f"\n{'shape':<12} {'quantile ms':>11} {'torch.q ms':>10} {'speedup':>8} {'NS5 fp32':>9} {'NS5 bf16':>9} {'q/NS':>6}"
    )
    for r in per_shape:
        print(
            f"{'x'.join(map(str, r['shape'])):<12} {r['abs_quantile_ms']:11.1f} {r['torch_quantile_ms']:10.1f} "
            f"{r['quantile_speedup']:8.1f} {r['ns5_fp32_ms']:9.1f} {r['ns5_bf16_ms']:9.1f} {r['quantile_over_ns_fp32']:6.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
