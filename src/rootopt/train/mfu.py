"""Model FLOPs utilisation: the model's training FLOPs per token and the device's peak.

``mfu = flops_per_token × tokens/s ÷ (world size × peak)`` (docs/monitoring.md, "Throughput and MFU").

FLOPs per token follow PaLM (Chowdhery et al. 2022, arXiv 2204.02311, Appendix B):
``6·N + 12·L·d·T``, where ``N`` counts the weights that take part in a matrix multiply per
token (every ``Linear``/``Conv1D`` weight, the output head included, the embedding lookups
not), ``L`` the layers, ``d`` the attention width (heads × head size) and ``T`` the sequence
length; the factor 6 is forward (2) plus backward (4), and the second term is the
attention scores and their weighted sum. Recomputation under activation checkpointing is
not counted: MFU measures the model's work, not the hardware's.

The peak is one device's dense peak in the training dtype: ``run.peak_tflops`` when set,
else a table of data-centre GPUs from their vendor datasheets (dense, i.e. without the
2:4 sparsity factor the datasheets also quote), else, on a CPU, the best rate of a short
float matmul measured once at start in the run's dtype and thread count. A GPU missing
from the table has no peak (``mfu`` is then not recorded; set ``run.peak_tflops``).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# NVIDIA datasheets, dense TFLOP/s: (pattern on torch.cuda.get_device_name(), {dtype: peak}).
# "tf32" is float32 matmul on tensor cores (torch.backends.cuda.matmul.allow_tf32). The first
# matching pattern wins, so specific names come before their families.
GPU_PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"H100.*PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    (r"H100|H200|GH200", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    (r"A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    (r"L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05}),
    (r"\bL4\b", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
    (r"\bA10\b", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    (r"V100.*PCIE", {"fp32": 14.0, "fp16": 112.0}),
    (r"V100", {"fp32": 15.7, "fp16": 125.0}),
    (r"\bT4\b", {"fp32": 8.1, "fp16": 65.0}),
)


@dataclass(frozen=True)
class Peak:
    """One device's peak FLOP/s in the training dtype, and where the number comes from."""

    flops: float  # 0 when unknown
    source: str  # "run.peak_tflops" | "table: <pattern>" | "measured" | "unknown: ..."
    dtype: str
    device: str = "cpu"  # torch device type

    def record(self) -> dict[str, Any]:
        return {
            "tflops": self.flops / 1e12,
            "source": self.source,
            "dtype": self.dtype,
            "device": self.device,
        }


def matmul_params(model: nn.Module) -> int:
    """Weights used in a matrix multiply per token: every ``nn.Linear`` and transformers
    ``Conv1D`` weight, once each (a head tied to the embedding counts as the head)."""
    from rootopt.optim.routing import is_transposed_linear

    seen: set[int] = set()
    n = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if not isinstance(w, torch.Tensor) or not (
            isinstance(m, nn.Linear) or is_transposed_linear(m)
        ):
            continue
        if id(w) not in seen:
            seen.add(id(w))
            n += w.numel()
    return n


def attention_shape(model: nn.Module) -> tuple[int, int]:
    """``(layers, heads × head size)`` of a transformer, ``(0, 0)`` for other models."""
    from rootopt.train.hf import HFCausalLM
    from rootopt.train.model import LlamaLM

    if isinstance(model, LlamaLM):
        return model.cfg.n_layers, model.cfg.d_model
    if isinstance(model, HFCausalLM):
        c = model.config
        c = c.get_text_config() if hasattr(c, "get_text_config") else c
        layers, heads = c.num_hidden_layers, c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        return int(layers), int(heads * head_dim)
    return 0, 0


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token, ``6·N + 12·L·d·T`` (see the module docstring). For a
    model without attention (a classifier) a "token" is a sample and the term is 0."""
    layers, width = attention_shape(model)
    return float(6 * matmul_params(model) + 12 * layers * width * seq_len)


def _cuda_dtype_key(dtype: str) -> str:
    if dtype == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return dtype


def gpu_peak(name: str, dtype: str) -> Peak:
    """The table's peak for device ``name`` in ``dtype`` (fp32 | bf16 | fp16)."""
    key = _cuda_dtype_key(dtype)
    for pattern, peaks in GPU_PEAK_TFLOPS:
        if re.search(pattern, name):
            if key in peaks:
                return Peak(peaks[key] * 1e12, f"table: {pattern}", key, "cuda")
            return Peak(0.0, f"unknown: no {key} peak for {name} in the table", key, "cuda")
    return Peak(0.0, f"unknown: {name} is not in the table; set run.peak_tflops", key, "cuda")


def measure_cpu_peak(dtype: torch.dtype, *, size: int = 512, repeats: int = 5) -> float:
    """The best FLOP/s of a ``size``² matmul in ``dtype`` over ``repeats`` timings, with
    the threads torch uses now (a short, one-off measurement: about 0.1-0.5 s)."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)  # warm-up: first-call allocation and kernel choice
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * size**3 / max(best, 1e-9)


def device_peak(device: torch.device, dtype: str, *, configured_tflops: float = 0.0) -> Peak:
    """One device's peak for the run (see the module docstring for the order)."""
    key = _cuda_dtype_key(dtype) if device.type == "cuda" else dtype
    if configured_tflops > 0:
        return Peak(configured_tflops * 1e12, "run.peak_tflops", key, device.type)
    if device.type == "cuda":
        p = gpu_peak(torch.cuda.get_device_name(device), dtype)
        return Peak(p.flops, p.source, p.dtype, "cuda")
    if device.type == "cpu":
        tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
        return Peak(measure_cpu_peak(tdt), "measured", key, "cpu")
    return Peak(0.0, f"unknown: no peak for device type {device.type}", key, device.type)


def mfu(
    flops_token: float, tokens_per_s: float | None, world_size: int, peak: Peak
) -> float | None:
    """Model FLOPs utilisation of a logging window; None when a term is unknown."""
    if tokens_per_s is None or peak.flops <= 0 or flops_token <= 0:
        return None
    return flops_token * tokens_per_s / (world_size * peak.flops)
