"""Newton–Schulz throughput and a whole optimizer step against torch.optim.Muon, on this
machine's device (CUDA when present, else CPU).

Part 1, per shape and iteration dtype, for a bucket of ``--batch`` matrices: the
Newton–Schulz iteration with the shape's AdaNewton schedule, its GFLOP/s and their share
of the matmul peak measured at that shape and dtype (``X Xᵀ``).

Part 2, optimizer steps on the matrices of a GPT-style decoder (``--d-model``,
``--layers``): operations dispatched per step (``rootopt_analysis.opcount``, meta tensors),
then ROOT (default fp32 iteration and bf16 iteration), ROOT's Muon mode (threshold off,
Muon's tuple) in both dtypes and ``torch.optim.Muon``; with ``--capture``, also ROOT
with ``compile_step="reduce-overhead"`` (CUDA graphs on a GPU). Every contender owns its
copy of the weights and the same gradients. Times are medians of ``--reps`` after a
warm-up (CUDA events on a GPU). Prints tables and ratios (ROOT / its own Muon mode, ROOT
/ torch.optim.Muon at the same dtype); ``--json`` writes them to a new file.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from torch import nn

import rootopt
from _timing import median_ms, shape_list
from rootopt.coeffs.adanewton import lookup
from rootopt.ortho import direction, prefer_gram
from rootopt_analysis.opcount import optimizer_counts, standard_makers


def ns_costs(
    shapes: list[tuple[int, int]], batch: int, device: torch.device, reps: int
) -> list[dict[str, Any]]:
    rows = []
    for r, c in shapes:
        G = torch.randn(batch, r, c, device=device)
        for dt in (torch.float32, torch.bfloat16):
            name = str(dt).removeprefix("torch.")
            sched = lookup(r, c, 5, dtype=name).schedule
            m = min(r, c)
            X = G.to(dt)
            X = X.mT if r > c else X
            t_ns = median_ms(
                lambda G=G, s=sched, dt=dt: direction(G, s, method="newton_schulz", dtype=dt),
                device,
                reps,
            )[0]
            gram = prefer_gram(r, c, dt)
            n = max(r, c)
            flops = batch * (
                4 * m * m * n + 17 * 2 * m**3 if gram else 5 * (4 * m * m * n + 2 * m**3)
            )
            t_mm = median_ms(lambda X=X: X @ X.mT, device, reps)[0]
            peak = batch * 2 * m * m * n / t_mm / 1e6  # GFLOP/s
            rows.append(
                {
                    "shape": [r, c],
                    "dtype": name,
                    "batch": batch,
                    "ns_ms": t_ns,
                    "short_side": m,
                    "gram": gram,
                    "ns_gflops": flops / t_ns / 1e6,
                    "matmul_peak_gflops": peak,
                    "ns_of_peak": flops / t_ns / 1e6 / peak,
                }
            )
    return rows


class Decoder(nn.Module):
    """The weight matrices of a GPT-style decoder (no forward pass is needed here)."""

    def __init__(self, d: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            blk = nn.ModuleDict(
                {
                    "qkv": nn.Linear(d, 3 * d, bias=False),
                    "proj": nn.Linear(d, d, bias=False),
                    "fc": nn.Linear(d, 4 * d, bias=False),
                    "out": nn.Linear(4 * d, d, bias=False),
                }
            )
            self.blocks.append(blk)


def step_costs(
    d: int, layers: int, device: torch.device, reps: int, profile: str = "", capture: bool = False
) -> dict[str, float]:
    torch.manual_seed(0)
    base = Decoder(d, layers).to(device)
    grads = [torch.randn_like(p) for p in base.parameters()]

    def make(kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = Decoder(d, layers).to(device)
        model.load_state_dict(base.state_dict())
        params = list(model.parameters())
        if kind == "root":
            return model, rootopt.ROOT(params, lr=0.02)
        if kind == "root_bf16":
            return model, rootopt.ROOT(params, lr=0.02, ns_dtype="bfloat16")
        if kind == "root_bf16_captured":
            return model, rootopt.ROOT(
                params, lr=0.02, ns_dtype="bfloat16", compile_step="reduce-overhead"
            )
        if kind == "root_muon_mode_fp32":
            return model, rootopt.ROOT(
                params, lr=0.02, outlier_quantile=None, ns_coefficients="muon"
            )
        if kind == "root_muon_mode_bf16":
            return model, rootopt.ROOT(
                params, lr=0.02, outlier_quantile=None, ns_coefficients="muon", ns_dtype="bfloat16"
            )
        return model, torch.optim.Muon(params, lr=0.02)  # type: ignore[attr-defined]

    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        model, opt = make(profile)
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g.clone()
        opt.step()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with prof(activities=acts) as pr:
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(f"\nprofile of one {profile} step (top ops by {key}):")
        print(pr.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=40))
    kinds = ["root", "root_bf16", "root_muon_mode_fp32", "root_muon_mode_bf16"]
    if capture:
        kinds.append("root_bf16_captured")
    if hasattr(torch.optim, "Muon"):
        kinds.append("torch_muon")
    out: dict[str, float] = {}
    for kind in kinds:
        model, opt = make(kind)
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g.clone()
        out[kind] = median_ms(opt.step, device, reps)[0]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="auto", help="cuda, cpu or auto")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--d-model", type=int, default=0, help="decoder width (0: 2048 on CUDA, 768 on CPU)"
    )
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: 8 on CUDA, 2 on CPU)")
    ap.add_argument(
        "--shapes",
        type=shape_list(2),
        default=None,
        help="e.g. 1024x1024,1024x4096 (default by device)",
    )
    ap.add_argument("--json", default="")
    ap.add_argument(
        "--profile", default="", help="profile one step of this contender, e.g. root_bf16"
    )
    ap.add_argument(
        "--capture", action="store_true", help="also ROOT bf16 with compile_step='reduce-overhead'"
    )
    a = ap.parse_args()
    if a.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(a.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here
    if a.shapes:
        shapes = a.shapes
    elif cuda:
        shapes = [
            (1024, 1024),
            (1024, 4096),
            (4096, 1024),
            (2048, 2048),
            (4096, 4096),
            (4096, 14336),
        ]
    else:
        shapes = [(256, 256), (512, 512), (768, 768), (768, 3072)]
    d = a.d_model or (2048 if cuda else 768)
    layers = a.layers or (8 if cuda else 2)
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"device: {name}; torch {torch.__version__}; batch {a.batch}; reps {a.reps}")
    rows = ns_costs([(int(r), int(c)) for r, c in shapes], a.batch, device, a.reps)
    print("\nshape        dtype     NS ms   NS GFLOP/s (of the X Xt matmul at this shape)")
    for r in rows:
        print(
            f"{r['shape'][0]}x{r['shape'][1]:<7} {r['dtype']:<9} {r['ns_ms']:7.2f}   "
            f"{r['ns_gflops']:8.0f} ({r['ns_of_peak'] * 100:3.0f}% of "
            f"{r['matmul_peak_gflops']:.0f}{', Gram' if r['gram'] else ''})"
        )
    counts = optimizer_counts(standard_makers(), d_model=d, layers=layers)
    print(f"\noperations per step, decoder d={d}, {layers} layers (meta tensors):")
    for k, v in counts.items():
        print(f"  {k:<22} ops {v['ops']:5d}  kernels {v['kernels']:5d}  syncs {v['syncs']}")
    steps = step_costs(d, layers, device, a.reps, a.profile, a.capture)
    print(f"\noptimizer step, decoder d={d}, {layers} layers (ms, median of {a.reps}):")
    for k, v in steps.items():
        print(f"  {k:<22} {v:9.2f}")
    ratios = {
        "root / root_muon_mode_fp32": steps["root"] / steps["root_muon_mode_fp32"],
        "root_bf16 / root_muon_mode_bf16": steps["root_bf16"] / steps["root_muon_mode_bf16"],
        "root kernels / torch_muon kernels": counts["root"]["kernels"]
        / counts["torch_muon"]["kernels"],
    }
    if "root_bf16_captured" in steps and "torch_muon" in steps:
        ratios["root_bf16_captured / torch_muon"] = (
            steps["root_bf16_captured"] / steps["torch_muon"]
        )
    if "torch_muon" in steps:
        ratios["root_bf16 / torch_muon"] = steps["root_bf16"] / steps["torch_muon"]
        ratios["root (fp32) / torch_muon"] = steps["root"] / steps["torch_muon"]
    for k, v in ratios.items():
        print(f"  {k:<34} {v:.3f}")
    if a.json:
        with open(a.json, "x") as fh:  # a new file: never overwrite one
            json.dump({"device": name, "torch": torch.__version__, "newton_schulz": rows, "steps": steps,
                       "ratios": ratios, "op_counts": counts, "d_model": d, "layers": layers},
                      fh, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
