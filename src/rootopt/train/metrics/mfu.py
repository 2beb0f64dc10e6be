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
2:4 sparsity factor the datasheets also quote), else, on a CPU, an estimate: the run's
threads times the best rate one thread reaches on square matmuls in the training dtype
(:func:`measure_cpu_peak`). A CPU has no datasheet peak torch can look up, and a timing
with all threads is at the mercy of the machine's load (one late thread holds the others
at the barrier: a loaded 2-core machine timed a bf16 512² matmul 13× below its one-thread
rate); one thread's best of repeated timings is not, and a core's peak times the cores is
how a CPU's peak is defined. A GPU missing from the table has no peak (``mfu`` is then not
recorded; set ``run.peak_tflops``). A window above the peak (possible only when the peak is
wrong) records no ``mfu``, never more than 100 %.
"""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass, field
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
    # how a measured peak was obtained (machine, threads, method): it is an estimate
    measured: dict[str, Any] = field(default_factory=dict)

    @property
    def estimate(self) -> bool:
        """Measured on this machine, not a datasheet's or the user's number."""
        return self.source == "measured"

    def record(self) -> dict[str, Any]:
        return {
            "tflops": self.flops / 1e12,
            "source": self.source,
            "dtype": self.dtype,
            "device": self.device,
            "estimate": self.estimate,
            **self.measured,
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
    from rootopt.train.models import LlamaLM
    from rootopt.train.models.transformers_lm import HFCausalLM

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


# One-thread matmuls timed for the CPU estimate: sizes at which one core's kernel reaches its
# best rate (fp32 and bf16 alike within a few % of 2048² here), each timed ROUNDS × REPEATS
# times, the rounds interleaved so that a burst of load spoils one of them, not all.
CPU_SIZES = (256, 512)
ROUNDS, REPEATS = 3, 3


def measure_one_thread(dtype: torch.dtype, *, sizes: tuple[int, ...] = CPU_SIZES) -> float:
    """The best FLOP/s one thread reaches on a square matmul in ``dtype`` (about 30 ms in
    float32, more where the dtype is emulated)."""
    from rootopt._threads import one_thread

    with one_thread():
        pairs = {n: (torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)) for n in sizes}
        for a, b in pairs.values():
            torch.mm(a, b)  # warm-up: first-call allocation and kernel choice
        best = 0.0
        for _ in range(ROUNDS):
            for n, (a, b) in pairs.items():
                for _ in range(REPEATS):
                    t0 = time.perf_counter()
                    torch.mm(a, b)
                    best = max(best, 2.0 * n**3 / max(time.perf_counter() - t0, 1e-9))
    return best


@functools.lru_cache(maxsize=8)
def _one_thread_rate(dtype: torch.dtype) -> float:
    # a property of the machine: measured once per process and dtype
    return measure_one_thread(dtype)


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's processor string elsewhere)."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_peak(dtype: str, threads: int) -> Peak:
    """The CPU estimate (see the module docstring): ``threads`` × one thread's best rate."""
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    one = _one_thread_rate(tdt)
    sizes = " and ".join(f"{n}²" for n in CPU_SIZES)
    how = {
        "machine": cpu_name(),
        "threads": threads,
        "method": f"{threads} threads × the best one-thread {dtype} matmul "
        f"({one / 1e9:.1f} GFLOP/s; {sizes}, best of {ROUNDS * REPEATS} each)",
    }
    return Peak(threads * one, "measured", dtype, "cpu", how)


def device_peak(device: torch.device, dtype: str, *, configured_tflops: float = 0.0) -> Peak:
    """One device's peak for the run (see the module docstring for the order)."""
    key = _cuda_dtype_key(dtype) if device.type == "cuda" else dtype
    if configured_tflops > 0:
        return Peak(configured_tflops * 1e12, "run.peak_tflops", key, device.type)
    if device.type == "cuda":
        p = gpu_peak(torch.cuda.get_device_name(device), dtype)
        return Peak(p.flops, p.source, p.dtype, "cuda")
    if device.type == "cpu":
        return cpu_peak(key, torch.get_num_threads())
    return Peak(0.0, f"unknown: no peak for device type {device.type}", key, device.type)


def achieved(flops_token: float, tokens_per_s: float | None, world_size: int) -> float | None:
    """The model FLOP/s one device reached in a logging window (None when unknown)."""
    if tokens_per_s is None or flops_token <= 0:
        return None
    return flops_token * tokens_per_s / world_size


def mfu(
    flops_token: float, tokens_per_s: float | None, world_size: int, peak: Peak
) -> float | None:
    """Model FLOPs utilisation of a logging window; None when a term is unknown, and None
    above 1: a device does not run above its peak, so the peak (or the FLOPs count) is
    wrong there, and the record says nothing rather than something impossible."""
    rate = achieved(flops_token, tokens_per_s, world_size)
    if rate is None or peak.flops <= 0:
        return None
    value = rate / peak.flops
    return value if value <= 1.0 else None


@dataclass
class MFUMeter:
    """The run's mfu metric: the model's training FLOPs per token and one device's peak
    (rank 0 measures or looks it up; None on the other ranks, which record no mfu)."""

    flops_per_token: float
    peak: Peak | None = None
    above_peak: bool = False  # a window ran above the peak (said once per session)

    def env(self) -> dict[str, Any]:
        """What ``env.json`` records of it: what the mfu metric divides by."""
        if self.peak is None:
            return {}
        return {"peak": self.peak.record(), "flops_per_token": self.flops_per_token}

    def window(self, tokens_per_s: float | None, world_size: int) -> tuple[float | None, float]:
        """A logging window's mfu, and the FLOP/s it achieved when it is the session's
        first window above the peak (0.0 otherwise): the peak is wrong there."""
        if self.peak is None:
            return None, 0.0
        value = mfu(self.flops_per_token, tokens_per_s, world_size, self.peak)
        rate = achieved(self.flops_per_token, tokens_per_s, world_size)
        if value is None and rate is not None and self.peak.flops > 0 and not self.above_peak:
            self.above_peak = True
            return None, rate
        return value, 0.0
