"""Operations dispatched by one optimizer step, counted on the CPU (no accelerator needed).

On an accelerator a step of small operations is bound by launching kernels, not by the
device (docs/performance.md, "Launches"). A ``TorchDispatchMode`` sees every ATen operation
a step dispatches; run on ``meta`` tensors it sees exactly what the step would dispatch on
a GPU — the code takes the same branches for every non-CPU device (the ``topk`` threshold,
the accelerator bucket budget) — at any model size, with no memory and no arithmetic.
Reads of device values on the host (the step's one synchronisation) get a fabricated
answer (all finite) and are counted as ``syncs``.

Counted per step: ``ops`` (every dispatched ATen operation), ``kernels`` (those that launch
work: not views, reshapes or bare allocations; a ``_foreach`` call is one, as it is one or a
few launches on CUDA) and ``syncs``. Used by ``benchmarks/bench_step.py``,
``benchmarks/bench_step_device.py`` and ``tests/test_opcount.py``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

# Dispatched without launching a kernel: metadata, aliasing and bare allocation.
_NO_KERNEL = frozenset(
    {
        "aten._unsafe_view",
        "aten.detach",
        "aten.alias",
        "aten.lift_fresh",
        "aten.empty",
        "aten.empty_like",
        "aten.empty_strided",
        "aten.new_empty",
        "aten.new_empty_strided",
        "aten._local_scalar_dense",
        "aten.is_nonzero",
        "aten.sym_size",
        "aten.sym_stride",
        "aten.sym_numel",
        "aten.sym_storage_offset",
        "profiler._record_function_enter_new",
        "profiler._record_function_exit",
    }
)


class OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call,misc]
    """Counts dispatched operations by name; fabricates host reads of ``meta`` tensors."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: Counter[str] = Counter()
        self.syncs = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        self.ops[name] += 1
        src = args[0] if args and isinstance(args[0], Tensor) else None
        if src is not None and src.device.type != "cpu":
            to_host = func is torch.ops.aten._to_copy.default and kwargs.get("device") == (
                torch.device("cpu")
            )
            if func is torch.ops.aten._local_scalar_dense.default or to_host:
                self.syncs += 1
                if src.device.type == "meta":  # no data: answer "finite", "true", 1
                    if to_host:
                        return torch.ones(src.shape, dtype=kwargs.get("dtype") or src.dtype)
                    return True if src.dtype == torch.bool else 1
        return func(*args, **kwargs)

    def summary(self) -> dict[str, Any]:
        kernels = 0
        for name, n in self.ops.items():
            packet = _packet(name)
            view = packet is not None and any(
                getattr(packet, o).is_view for o in packet.overloads()
            )
            if not view and name not in _NO_KERNEL:
                kernels += n
        return {
            "ops": sum(self.ops.values()),
            "kernels": kernels,
            "syncs": self.syncs,
            "top": self.ops.most_common(12),
        }


def _packet(name: str) -> Any:
    ns, _, op = name.partition(".")
    try:
        return getattr(getattr(torch.ops, ns), op)
    except (AttributeError, RuntimeError):
        return None


def count_step(step: Callable[[], Any], *, warmup: int = 1) -> dict[str, Any]:
    """Counts of one call of ``step`` after ``warmup`` calls (which create state)."""
    for _ in range(warmup):
        with OpCounter():
            step()
    counter = OpCounter()
    with counter:
        step()
    return counter.summary()


def decoder_matrices(
    d_model: int = 2048, layers: int = 8, *, device: str | torch.device = "meta"
) -> list[nn.Parameter]:
    """The weight matrices of a GPT-style decoder (fused QKV ``(3d, d)``, output ``(d, d)``,
    MLP ``(4d, d)`` and ``(d, 4d)``; 4 per layer), each with a gradient."""
    out = []
    for _ in range(layers):
        for shape in ((3 * d_model, d_model), (d_model, d_model), (4 * d_model, d_model),
                      (d_model, 4 * d_model)):  # fmt: skip
            p = nn.Parameter(torch.empty(shape, device=device))
            p.grad = torch.empty(shape, device=device)
            if p.device.type != "meta":
                with torch.no_grad():
                    p.normal_(0, 0.02)
                    p.grad.normal_(0, 1e-2)
            out.append(p)
    return out


def optimizer_counts(
    makers: dict[str, Callable[[list[nn.Parameter]], Iterable[torch.optim.Optimizer]]],
    *,
    d_model: int = 2048,
    layers: int = 8,
    device: str | torch.device = "meta",
) -> dict[str, dict[str, Any]]:
    """Counts per step for each ``makers[name](params)`` on a fresh decoder's matrices."""
    out = {}
    for name, make in makers.items():
        params = decoder_matrices(d_model, layers, device=device)
        opts = list(make(params))

        def step(opts: list[torch.optim.Optimizer] = opts) -> None:
            for o in opts:
                o.step()

        out[name] = count_step(step)
    return out


def standard_makers() -> dict[str, Callable[[list[nn.Parameter]], list[torch.optim.Optimizer]]]:
    """ROOT default, ROOT with a bf16 iteration, ROOT's Muon mode (threshold off, Muon's
    tuple) and ``torch.optim.Muon``, as the step benchmarks compare them."""
    from rootopt import ROOT

    muon_mode: dict[str, Any] = {"outlier_quantile": None, "ns_coefficients": "muon"}
    return {
        "root": lambda ps: [ROOT(ps, lr=0.02)],
        "root_bf16": lambda ps: [ROOT(ps, lr=0.02, ns_dtype="bfloat16")],
        "root_muon_mode": lambda ps: [ROOT(ps, lr=0.02, **muon_mode)],
        "torch_muon": lambda ps: [
            torch.optim.Muon(ps, lr=0.02, adjust_lr_fn="match_rms_adamw")  # type: ignore[attr-defined]
        ],
    }
