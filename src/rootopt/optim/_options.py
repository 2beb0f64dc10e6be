"""Validation of ROOT's options, in one place; the iteration dtype and bucket budget per device."""

from __future__ import annotations

import functools
import math
import os
import platform
import warnings
from typing import Any, Literal, cast

import torch
from torch import Tensor

from rootopt.coeffs import validate_spec
from rootopt.optim.functional import RootOptions
from rootopt.ortho import METHODS, GramMode

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
# ``ns_dtype``: the default, "auto", is bfloat16 where the hardware multiplies it natively
# (CUDA devices with bf16 tensor cores; x86 CPUs with AVX-512 BF16 or AMX) and float32
# elsewhere. The defaults study found the two dtypes equivalent in loss (docs/benchmarks.md)
# and a tie goes to the setting that is cheaper on the hardware at hand: where bf16 is
# native, its iterations take 0.5-0.9x float32's time; where it is emulated, 1.3-18x
# (docs/performance.md, "Iteration dtype"). TF32: ROOT never changes torch's float32 matmul
# precision; a float32 iteration on CUDA uses whatever the process set (torch's default
# "highest": no TF32).
# oneDNN's ISA cap (ONEDNN_MAX_CPU_ISA, or its older name DNNL_MAX_CPU_ISA): below these
# levels it does not use the bf16 instructions even where the CPU has them, and bfloat16
# matmuls are emulated (measured: AVX512_CORE or AVX2 make a bf16 product 2.5-60x slower
# than float32's; docs/performance.md).
_BF16_ISA_CAPS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10")
# Most bytes of float32 matrices stacked at once (docs/performance.md, "Memory"). "auto"
# (the default): 32 MiB on the CPU, where stacking saves no time and bounds memory; on an
# accelerator, where every stack saves launches (docs/performance.md, "Launches"), 1 GiB or
# 1/32 of the device's memory, whichever is less.
CPU_BUCKET_BYTES = 32 << 20
ACCELERATOR_BUCKET_BYTES = 1 << 30
GRAM_MODES = ("auto", "on", "off", "spectral")
# ns_gram as rootopt.ortho.direction takes it.
_GRAM_ARG: dict[str, GramMode] = {"auto": None, "on": True, "off": False, "spectral": "spectral"}
Algorithm = Literal["root", "adamw"]
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


# "auto" as it resolved until 2026-12-05: bfloat16 on CUDA, float32 on every other device. A
# param group ROOT builds now carries ``ns_auto="native"``; one saved before has no such key
# and keeps the earlier rule when loaded, so its checkpoint resumes with the dtype it trained
# in (CHANGELOG.md).
NS_AUTO_KEY = "ns_auto"
EARLIER_AUTO = {"cuda": "bfloat16"}


def group_ns_dtype(group: dict[str, Any], device: torch.device) -> str:
    """The iteration dtype's name for ``group``'s parameters on ``device``."""
    if group["ns_dtype"] == "auto" and group.get(NS_AUTO_KEY) != "native":
        return EARLIER_AUTO.get(device.type, "float32")
    return ns_dtype_name(group["ns_dtype"], device)


def ns_dtype_name(value: str, device: torch.device) -> str:
    """The iteration dtype's name for parameters on ``device`` (``"auto"`` resolved:
    bfloat16 where :func:`native_bf16` holds, float32 elsewhere)."""
    if value != "auto":
        return value
    return "bfloat16" if native_bf16(device) else "float32"


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 matrices in hardware: a CUDA device with bf16
    support (not emulated), or an x86 CPU with AVX-512 BF16 or AMX that oneDNN may use."""
    if device.type == "cuda":
        return _cuda_native_bf16(device.index)
    if device.type == "cpu":
        return not cpu_emulates_bf16() and _x86()
    return False


@functools.cache
def _cuda_native_bf16(index: int | None) -> bool:
    if not torch.cuda.is_available():
        return True  # named without a device (a run's identity): every GPU since Ampere
    with torch.cuda.device(index if index is not None else torch.cuda.current_device()):
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def cpu_emulates_bf16() -> bool:
    """Whether this x86 CPU multiplies bfloat16 matrices without bf16 units: it lacks
    AVX-512 BF16 and AMX, or oneDNN's ISA cap keeps them unused (docs/performance.md,
    "Iteration dtype"). False on other CPUs: not measured, nothing said."""
    if not _x86():
        return False
    cpu = torch.cpu
    units = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    if not any(bool(getattr(cpu, name, lambda: True)()) for name in units):
        return True
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""
    cap = cap.strip().upper()
    return cap not in ("", "ALL", "DEFAULT") and not cap.startswith(_BF16_ISA_CAPS)


@functools.cache
def _warn_emulated_bf16() -> None:
    warnings.warn(
        "ROOT: this CPU has no bfloat16 matrix units, so bfloat16 Newton-Schulz iterations "
        "are emulated and several times slower than float32; ns_dtype='auto' (the default) "
        "picks float32 here",
        RuntimeWarning,
        stacklevel=4,
    )


def check_iteration_speed(dtype: str, device: torch.device) -> None:
    """Warn once per process where an explicitly chosen iteration dtype is emulated on
    this device (``"auto"`` never picks one)."""
    if dtype == "bfloat16" and device.type == "cpu" and cpu_emulates_bf16():
        _warn_emulated_bf16()


def bucket_budget(value: int | str, device: torch.device) -> int:
    """Bytes per stack for parameters on ``device`` (0: no limit)."""
    if value != "auto":
        return int(value)
    if device.type == "cpu":
        return CPU_BUCKET_BYTES
    return min(ACCELERATOR_BUCKET_BYTES, _device_memory(device) // 32)


@functools.lru_cache(maxsize=16)
def _device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return 1 << 62  # unknown (e.g. the meta device of the launch counter): no cap


def dtype_name(value: object) -> str:
    if isinstance(value, torch.dtype):
        for name, dt in DTYPES.items():
            if dt == value:
                return name
    if isinstance(value, str) and (value in DTYPES or value == "auto"):
        return value
    raise ValueError(f"Invalid ns_dtype: {value!r} (choose 'auto' or one of {sorted(DTYPES)})")


def check_options(g: dict[str, Any]) -> None:
    """Validate one group's (or the defaults') hyperparameters; raise naming the bad one.
    Normalises ``ns_dtype`` to its name in place."""

    def bad(key: str, rule: str) -> ValueError:
        return ValueError(f"Invalid {key}: {g[key]!r} ({rule})")

    def number(key: str) -> float:
        v = g[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise bad(key, "must be a finite number")
        return float(v)

    def flag(key: str) -> None:
        if not isinstance(g.get(key, False), bool):
            raise bad(key, "must be True or False")

    lr = g["lr"]
    if isinstance(lr, Tensor):
        # As torch.optim.Adam: a 1-element tensor lr is accepted (schedulers fill it in place).
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not lr.is_floating_point() or not math.isfinite(float(lr)) or float(lr) < 0:
            raise bad("lr", "must be a finite number >= 0")
    elif number("lr") < 0:
        raise bad("lr", "must be >= 0")
    if not 0.0 <= number("momentum") < 1.0:
        raise bad("momentum", "must be in [0, 1)")
    if number("weight_decay") < 0:
        raise bad("weight_decay", "must be >= 0")
    for key in ("nesterov", "robust_scaling", "batched", "ns_fit"):
        flag(key)
    steps = g["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 100:
        raise bad("ns_steps", "must be an integer in [1, 100]")
    validate_spec(g["ns_coefficients"])
    g["ns_dtype"] = dtype_name(g["ns_dtype"])
    if g["ortho_method"] not in METHODS:
        raise bad("ortho_method", f"choose one of {METHODS}")
    q = g["outlier_quantile"]
    if q is not None and (
        isinstance(q, bool) or not isinstance(q, (int, float)) or not 0.0 < q <= 1.0
    ):
        raise bad("outlier_quantile", "must be in (0, 1], or None to disable")
    if g["lr_scale"] not in ("moonlight", "muon", "none"):
        raise bad("lr_scale", "choose 'moonlight', 'muon' or 'none'")
    if g["nd_view"] not in ("auto", "flatten", "batch"):
        raise bad("nd_view", "choose 'auto', 'flatten' or 'batch'")
    if number("robust_window") < 1:
        raise bad("robust_window", "must be >= 1")
    if number("robust_lambda") < 0:
        raise bad("robust_lambda", "must be >= 0")
    betas = g["adamw_betas"]
    if (
        not isinstance(betas, (tuple, list))
        or len(betas) != 2
        or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)
    ):
        raise bad("adamw_betas", "must be two numbers in [0, 1)")
    if number("adamw_eps") < 0:
        raise bad("adamw_eps", "must be >= 0")
    if g.get("ns_gram", "auto") not in GRAM_MODES:
        raise bad("ns_gram", f"choose one of {GRAM_MODES}")
    b = g.get("bucket_bytes", "auto")
    if b != "auto" and (isinstance(b, bool) or not isinstance(b, int) or b < 0):
        raise bad("bucket_bytes", "must be 'auto' or an integer >= 0 (0: no limit)")
    if g.get("algorithm") not in (None, "auto", "root", "adamw"):
        raise bad("algorithm", "choose 'root', 'adamw' or 'auto'")


def root_options(group: dict[str, Any], device: torch.device, lr: float | Tensor) -> RootOptions:
    """A group's options as the update needs them, for its parameters on ``device``."""
    gram = group.get("ns_gram", "auto")
    return RootOptions(
        lr=lr, momentum=group["momentum"], nesterov=group["nesterov"],
        weight_decay=group["weight_decay"], quantile=group["outlier_quantile"],
        method=group["ortho_method"], ns_dtype=DTYPES[group_ns_dtype(group, device)],
        gram=_GRAM_ARG[gram], lr_scale=group["lr_scale"],
        transposed=bool(group.get("transposed", False)), nd_view=group["nd_view"],
        robust_window=group["robust_window"], robust_lambda=group["robust_lambda"],
        bucket_bytes=bucket_budget(group.get("bucket_bytes", "auto"), device),
    )  # fmt: skip


def state_dtype(p: Tensor) -> torch.dtype:
    """dtype of a parameter's optimizer state: the higher of float32 and the parameter's
    (bfloat16/float16 parameters keep float32 state, float64 parameters float64)."""
    return torch.promote_types(p.dtype, torch.float32) if p.is_floating_point() else torch.float32


def algorithm_of(group: dict[str, Any], p: Tensor) -> Algorithm:
    """The update a parameter of ``group`` gets: the group's ``algorithm`` when it names
    one, else (``"auto"``, a user group) ROOT for tensors with ``ndim >= 2``, AdamW for
    the rest."""
    algo = group.get("algorithm")
    if algo in ("root", "adamw"):
        return cast(Algorithm, algo)
    return "root" if p.ndim >= 2 else "adamw"


def _lr(group: dict[str, Any]) -> float | Tensor:
    """The group's lr: a number, or a tensor lr kept as a tensor in a traced step (reading
    it would be a guard; schedulers fill it in place)."""
    lr = group["lr"]
    return lr if isinstance(lr, Tensor) and torch.compiler.is_compiling() else float(lr)
