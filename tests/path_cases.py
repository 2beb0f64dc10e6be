"""The model, gradients and option sets of ``tests/test_paths.py`` (shared with its
distributed worker, ``tests/dist_scripts/paths.py``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

STEPS = 3
LR = 0.02
# Q, K, V output sizes of the fused projections (fewer K/V heads, as in GQA)
SPLIT = (8, 4, 4)

# name -> shape: tall, wide, square, odd, a conv kernel (flattened), a 3-D stack sharing a
# shape with two matrices, a shape the Gram iteration takes, one the bfloat16 iteration
# evaluates spectrally on the CPU (rootopt.ortho.prefer_spectral), two fused QKV weights (one
# stored (out, in), one (in, out) like transformers' Conv1D), a bias and a gain (AdamW).
SHAPES: dict[str, tuple[int, ...]] = {
    "tall": (40, 24),
    "wide": (24, 40),
    "square": (16, 16),
    "odd": (7, 13),
    "conv": (6, 3, 3, 3),
    "stack": (3, 24, 40),
    "wide2": (24, 40),
    "gram": (64, 160),
    "spectral": (128, 384),
    "qkv": (16, 12),
    "qkv_t": (12, 16),
    "bias": (24,),
    "gain": (16,),
}

# name -> (ROOT options, parameter dtype). Default coefficients everywhere (the default path
# is what is compared), and AdaNewton's per-shape schedules once.
OPTION_SETS: dict[str, tuple[dict[str, Any], torch.dtype]] = {
    # ns_dtype "auto": bfloat16 iterations on a CPU with bf16 units, float32 on others
    "default": ({}, torch.float32),
    "bf16_params": ({}, torch.bfloat16),
    # float32 iterations from here on, so that the paths are compared to float32 rounding
    "fp32_iteration": ({"ns_dtype": "float32"}, torch.float32),
    "float64": ({"ns_dtype": "float32"}, torch.float64),
    "nesterov_off": ({"nesterov": False, "ns_dtype": "float32"}, torch.float32),
    "robust": ({"robust_scaling": True, "robust_window": 10, "ns_dtype": "float32"}, torch.float32),
    "adanewton": ({"ns_coefficients": "adanewton", "ns_dtype": "float32"}, torch.float32),
}


def iteration_dtype(options: dict[str, Any]) -> str:
    """The Newton–Schulz iteration dtype an option set runs with on the CPU (ROOT's default
    written out: bfloat16)."""
    from rootopt.optim._options import ns_dtype_name

    return ns_dtype_name(options.get("ns_dtype", "bfloat16"), torch.device("cpu"))


def make_params(dtype: torch.dtype) -> dict[str, nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return {n: nn.Parameter((torch.randn(s, generator=g) / 4).to(dtype)) for n, s in SHAPES.items()}


def groups(params: dict[str, Any], options: dict[str, Any]) -> list[dict[str, Any]]:
    """Matrices in one group routed by shape (the biases with them), the fused weights in
    groups of their own with ``ns_split`` (not with robust scaling, which excludes it)."""
    split = not options.get("robust_scaling", False)
    fused = [n for n in ("qkv", "qkv_t")]
    plain = [n for n in params if n not in fused]
    out: list[dict[str, Any]] = [{"params": [params[n] for n in plain], "param_names": plain}]
    for n in fused:
        g: dict[str, Any] = {"params": [params[n]], "param_names": [n], "algorithm": "root"}
        if split:
            g["ns_split"] = [SPLIT]
        if n == "qkv_t":
            g["transposed"] = True
        out.append(g)
    return out


def gradients(dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """``STEPS`` gradients per parameter, with a few outliers."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        step = {}
        for n, s in SHAPES.items():
            t = torch.randn(s, generator=g)
            t.view(-1)[:: max(1, t.numel() // 7)] *= 25
            step[n] = t.to(dtype)
        out.append(step)
    return out
