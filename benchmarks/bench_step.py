"""One optimizer step: launches, time against Muon, Newton–Schulz against the matmul peak.

Prints, in one run:
  1. operations dispatched per step (``rootopt_analysis.opcount``: a TorchDispatchMode counter
     on meta tensors, i.e. what the step dispatches on an accelerator) for ROOT (default
     and bf16 iteration), ROOT's Muon mode and torch.optim.Muon, on the d = 2048, 8-layer
     decoder's 32 matrices (``--count-d-model``/``--count-layers``) and on this run's model;
  2. step time (process CPU time, all threads; wall time beside it) on the weights and
     gradients of a GPT-2-style decoder (``--d-model``, ``--layers``; fused QKV, 4x MLP,
     tied embedding): ROOT default (fp32 iteration), ROOT's own Muon mode (threshold off,
     Muon's tuple) in fp32, ROOT with a bf16 iteration, ROOT's Muon mode in bf16 and
     ROOT with the plain bf16 iteration everywhere (torch.optim.Muon's algorithm plus the
     threshold), torch.optim.Muon (bf16 iteration) + fused AdamW for the rest. Every contender owns a
     copy; rounds interleave them (order rotated) and each ratio is the median over rounds
     of the ratio within a round;
  3. per matrix shape: Newton–Schulz GFLOP/s (plain and Gram, fp32 and bf16, and the
     spectral evaluation the bf16 iteration uses on wide shapes) against the
     measured matmul peak at that shape (``X Xᵀ``, the iteration's dominant product), and
     what the exact threshold costs;
  4. the targets: ROOT <= 1.05x its own Muon mode (fp32); bf16 ROOT <= 1.0x
     torch.optim.Muon (both bf16); ops per step <= torch.optim.Muon's.

Usage: python benchmarks/bench_step.py [--threads 1] [--d-model 768] [--layers 2]
[--rounds 5] [--skip-bf16] [--skip-shapes] [--json out.json]. glibc's malloc trimming
makes large elementwise ops several times slower, so the script re-executes itself with
MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 unless --no-malloc-tuning is given
(printed below).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import rootopt
from rootopt.coeffs import resolve
from rootopt.ortho import gram_newton_schulz, newton_schulz, spectral_newton_schulz
from rootopt_analysis.opcount import optimizer_counts, standard_makers

MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "68719476736"}
NS_STEPS = 5
MUON_MODE: dict[str, Any] = {"outlier_quantile": None, "ns_coefficients": "muon"}
FP32_CONTENDERS = ("root", "root_muon_mode_fp32")  # what --skip-bf16 times


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


def best_of(fn: Callable[[], Any], reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        ts.append(time.process_time() - t0)
    return min(ts)


def ns_flops(m: int, n: int, form: str) -> float:
    """Flops of K quintic steps on an m x n matrix (m <= n), as the code runs them
    (``spectral``: its three matrix products; the eigensolver is not counted)."""
    if form == "spectral":
        return 4 * m * m * n + 2 * m**3
    if form == "gram":
        # A0 and Q X0 (2 m² n each), then per step A² and Z A Z and Z Q (the first step
        # has no Z Q, the last no Z A Z): (4 K - 3) m x m products of 2 m³.
        return 4 * m * m * n + (4 * NS_STEPS - 3) * 2 * m**3
    return NS_STEPS * (4 * m * m * n + 2 * m**3)


def contenders(matrices_of: Callable[[nn.Module], list[nn.Parameter]]) -> dict[str, Any]:
    def root(**kw: Any) -> Callable[[nn.Module], list[torch.optim.Optimizer]]:
        def make(m: nn.Module) -> list[torch.optim.Optimizer]:
            groups, _ = rootopt.param_groups(m, lr=1e-3)
            return [rootopt.ROOT(groups, **kw)]

        return make

    def torch_muon(m: nn.Module) -> list[torch.optim.Optimizer]:
        mats = matrices_of(m)
        others = [p for p in m.parameters() if all(p is not q for q in mats)]
        return [
            torch.optim.Muon(mats, lr=1e-3, adjust_lr_fn="match_rms_adamw"),  # type: ignore[attr-defined]
            torch.optim.AdamW(others, lr=1e-3, betas=(0.9, 0.95), fused=True),
        ]

    return {
        "root": root(),
        "root_muon_mode_fp32": root(**MUON_MODE),
        "root_bf16": root(ns_dtype="bfloat16"),
        # the plain bfloat16 iteration everywhere: torch.optim.Muon's algorithm, plus the threshold
        "root_bf16_plain": root(ns_dtype="bfloat16", ns_gram="off"),
        "root_muon_mode_bf16": root(ns_dtype="bfloat16", **MUON_MODE),
        "torch_muon": torch_muon,
    }


def per_shape(shapes: list[tuple[int, int]], reps: int) -> list[dict[str, Any]]:
    rows = []
    for shape in shapes:
        m, n = min(shape), max(shape)
        M = torch.randn(*shape)
        sched = resolve("muon", shape[0], shape[1], NS_STEPS)
        W = M if shape[0] <= shape[1] else M.mT.contiguous()
        W16 = W.bfloat16()
        row: dict[str, Any] = {"shape": list(shape)}
        row["abs_quantile_ms"] = best_of(lambda M=M: rootopt.abs_quantile(M, 0.9), reps) * 1e3
        peaks = {
            "fp32": 2 * m * m * n / best_of(lambda W=W: W @ W.mT, reps) / 1e9,
            "bf16": 2 * m * m * n / best_of(lambda W=W16: W @ W.mT, reps) / 1e9,
        }
        row["matmul_gflops"] = peaks
        for label, fn, dt, form in [
            ("ns_fp32", newton_schulz, torch.float32, "plain"),
            ("gram_fp32", gram_newton_schulz, torch.float32, "gram"),
            ("ns_bf16", newton_schulz, torch.bfloat16, "plain"),
            ("gram_bf16", gram_newton_schulz, torch.bfloat16, "gram"),
            ("spectral_bf16", spectral_newton_schulz, torch.bfloat16, "spectral"),
        ]:
            t = best_of(lambda fn=fn, dt=dt, M=M, s=sched: fn(M, s, dtype=dt), reps)
            gf = ns_flops(m, n, form) / t / 1e9
            row[label] = {"ms": t * 1e3, "gflops": gf, "of_peak": gf / peaks[label[-4:]]}
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--count-d-model", type=int, default=2048)
    ap.add_argument("--count-layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per shape measurement")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--skip-shapes", action="store_true", help="no per-shape table")
    ap.add_argument(
        "--skip-bf16",
        action="store_true",
        help="time the float32 contenders only (a CPU without native bfloat16 matmuls, "
        "e.g. AVX2: there a bf16 step takes minutes); the bf16 target is then not measured",
    )
    ap.add_argument("--json", default="", help="also write the results as JSON here")
    ap.add_argument("--no-malloc-tuning", action="store_true")
    args = ap.parse_args()
    if args.json and os.path.lexists(args.json):
        # checked before minutes of timing, not after: the file is never overwritten
        ap.error(f"--json {args.json}: the file exists; name a new one")
    if not args.no_malloc_tuning and any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    base = transformer_matrices(args.d_model, args.layers, args.vocab)
    grads = {n: torch.randn_like(p) * 1e-2 for n, p in base.named_parameters()}

    def matrices_of(m: nn.Module) -> list[nn.Parameter]:
        return [p for n, p in m.named_parameters() if p.ndim == 2 and not n.startswith("wte")]

    def fresh() -> nn.Module:
        m = copy.deepcopy(base)
        for n, p in m.named_parameters():
            p.grad = grads[n].clone()
        return m

    results: dict[str, Any] = {
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
            # AVX512 / AVX2: whether bfloat16 matmuls run natively (docs/performance.md)
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "load_avg_at_start": os.getloadavg(),
            "malloc_env": {k: os.environ.get(k) for k in MALLOC_ENV},
        },
        "model": {
            "d_model": args.d_model,
            "layers": args.layers,
            "matrix_shapes": sorted({tuple(p.shape) for p in matrices_of(base)}),
        },
    }
    # 1. launches
    counted = {args.count_d_model: args.count_layers, args.d_model: args.layers}
    results["op_counts"] = {
        f"d{d}x{layers}": {
            k: {x: v[x] for x in ("ops", "kernels", "syncs")}
            for k, v in optimizer_counts(standard_makers(), d_model=d, layers=layers).items()
        }
        for d, layers in counted.items()
    }
    # 2. step time
    makers = contenders(matrices_of)
    if args.skip_bf16:
        makers = {k: v for k, v in makers.items() if k in FP32_CONTENDERS}
    models = {k: fresh() for k in makers}
    opts = {k: make(models[k]) for k, make in makers.items()}
    cpu: dict[str, list[float]] = {k: [] for k in makers}
    wall: dict[str, list[float]] = {k: [] for k in makers}
    order = list(makers)
    for r in range(args.rounds + 1):  # round 0 is the warm-up
        for k in order[r % len(order) :] + order[: r % len(order)]:
            w0, c0 = time.perf_counter(), time.process_time()
            for o in opts[k]:
                o.step()
            if r > 0:
                wall[k].append(time.perf_counter() - w0)
                cpu[k].append(time.process_time() - c0)
        if r > 0:
            print(
                f"  round {r} cpu ms: " + " ".join(f"{k}={cpu[k][-1] * 1e3:.0f}" for k in order),
                flush=True,
            )

    def ratio(a: str, b: str, clock: dict[str, list[float]] = cpu) -> float:
        if a not in clock or b not in clock:  # --skip-bf16
            return float("nan")
        return statistics.median(x / y for x, y in zip(clock[a], clock[b], strict=True))

    results["step_cpu_ms_median"] = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
    results["step_wall_ms_median"] = {k: statistics.median(v) * 1e3 for k, v in wall.items()}
    results["ratios"] = {
        "root / root_muon_mode_fp32": ratio("root", "root_muon_mode_fp32"),
        "root_bf16 / root_muon_mode_bf16": ratio("root_bf16", "root_muon_mode_bf16"),
        "root_bf16 / torch_muon": ratio("root_bf16", "torch_muon"),
        "root_muon_mode_bf16 / torch_muon": ratio("root_muon_mode_bf16", "torch_muon"),
        "root_bf16_plain / torch_muon": ratio("root_bf16_plain", "torch_muon"),
        "root (fp32) / torch_muon (bf16)": ratio("root", "torch_muon"),
    }
    results["ratios_wall"] = {
        "root / root_muon_mode_fp32": ratio("root", "root_muon_mode_fp32", wall),
        "root_bf16 / torch_muon": ratio("root_bf16", "torch_muon", wall),
    }
    del models, opts
    # 3. per shape
    results["per_shape"] = (
        [] if args.skip_shapes else per_shape(results["model"]["matrix_shapes"], args.reps)
    )
    # 4. targets
    big = results["op_counts"][f"d{args.count_d_model}x{args.count_layers}"]
    targets = {
        "root / own Muon mode (fp32) <= 1.05": (results["ratios"]["root / root_muon_mode_fp32"], 1.05),
        "bf16 root / torch.optim.Muon <= 1.00": (results["ratios"]["root_bf16 / torch_muon"], 1.0),
        "root kernels / torch.optim.Muon's <= 1": (big["root"]["kernels"] / big["torch_muon"]["kernels"], 1.0),
        "bf16 root kernels / torch.optim.Muon's <= 1": (
            big["root_bf16"]["kernels"] / big["torch_muon"]["kernels"], 1.0,
        ),
    }  # fmt: skip
    results["targets"] = {
        # NaN (not measured, --skip-bf16) is neither met nor missed
        k: {"value": v, "limit": lim, "met": None if math.isnan(v) else v <= lim}
        for k, (v, lim) in targets.items()
    }

    print(f"\nmachine: {results['machine']}")
    print(f"model: {results['model']}")
    print("\noperations per step (meta tensors: what an accelerator gets; kernels = not views)")
    for model, rows in results["op_counts"].items():
        print(f"  decoder {model}:")
        for k, v in rows.items():
            print(f"    {k:<18} ops {v['ops']:5d}  kernels {v['kernels']:5d}  syncs {v['syncs']}")
    print(f"\n{'optimizer':<22} {'cpu ms':>8} {'wall ms':>8}   (medians over interleaved rounds)")
    for k in makers:
        print(
            f"{k:<22} {results['step_cpu_ms_median'][k]:8.1f}"
            f" {results['step_wall_ms_median'][k]:8.1f}"
        )
    print("\nratios (process CPU time, median of per-round ratios; wall clock beside two):")
    for k, v in results["ratios"].items():
        w = results["ratios_wall"].get(k)
        if not math.isnan(v):  # both contenders were timed
            print(f"  {k:<36} {v:.3f}" + (f"   wall {w:.3f}" if w is not None else ""))
    if results["per_shape"]:
        print(
            "\nNewton–Schulz per shape: ms, GFLOP per CPU-second and share of the measured "
            "X Xᵀ matmul peak at that shape; threshold ms"
        )
        for r in results["per_shape"]:
            cells = "  ".join(
                f"{x} {r[x]['ms']:6.1f} ms {r[x]['gflops']:5.0f} ({r[x]['of_peak'] * 100:3.0f}%)"
                for x in ("ns_fp32", "gram_fp32", "ns_bf16", "gram_bf16", "spectral_bf16")
            )
            peak = r["matmul_gflops"]
            print(
                f"  {'x'.join(map(str, r['shape'])):<10} {cells}  | peak fp32 {peak['fp32']:.0f}"
                f" bf16 {peak['bf16']:.0f} | quantile {r['abs_quantile_ms']:.1f} ms"
            )
    print("\ntargets:")
    for k, t in results["targets"].items():
        verdict = {True: "met", False: "MISSED", None: "not measured (--skip-bf16)"}[t["met"]]
        print(f"  {k:<46} {t['value']:.3f}  {verdict}")
    if args.json:
        with open(args.json, "x") as f:  # a new file: never overwrite one
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
