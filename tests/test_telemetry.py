"""ROOT's telemetry reports what the step did: the threshold is the one the clip used."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from rootopt import ROOT
from rootopt.optim import functional

# distinct matrix shapes, so that each orthogonalization belongs to one parameter
SHAPES = {"a": (24, 40), "b": (16, 12), "stack": (3, 8, 20)}


CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ],
)


def _params(device: str = "cpu") -> list[tuple[str, nn.Parameter]]:
    g = torch.Generator().manual_seed(0)
    return [(n, nn.Parameter(torch.randn(*s, generator=g).to(device))) for n, s in SHAPES.items()]


def _grads(params: list[tuple[str, nn.Parameter]], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _, p in params:
        grad = torch.randn(p.shape, generator=g)
        grad.view(-1)[:: max(1, p.numel() // 9)] *= 40  # outliers: some entry is always clipped
        p.grad = grad.to(p.device)


def _clipped_at(monkeypatch: pytest.MonkeyPatch) -> dict[tuple[int, int], list[Tensor]]:
    """The step's thresholds as it applied them: the matrices it hands to the
    orthogonalization are clipped, and ``clamp`` returns the bound itself for every entry
    beyond it, so ``max |B|`` of a matrix with an entry clipped is its threshold, bit for bit.
    Per matrix shape, one tensor of per-matrix maxima per call."""
    seen: dict[tuple[int, int], list[Tensor]] = {}
    real = functional.direction

    def spy(B: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        stack = B if B.ndim == 3 else B[None]
        seen.setdefault(tuple(stack.shape[-2:]), []).append(stack.abs().amax(dim=(-2, -1)))
        return real(B, *args, **kwargs)

    monkeypatch.setattr(functional, "direction", spy)
    return seen


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("offset", [None, 1.0], ids=["as-shipped", "offset-1"])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "reference"])
def test_telemetry_reports_the_threshold_the_step_used(
    monkeypatch: pytest.MonkeyPatch, batched: bool, offset: float | None, device: str
) -> None:
    """The reported ``eps`` is the threshold the step clipped at, bit for bit, on the batched
    and the reference path (on the CPU the batched clip takes Python bounds, on CUDA tensor
    bounds); with the threshold's constant changed (``offset``), telemetry follows the step:
    there is one definition, not a recomputation beside it."""
    if offset is not None:
        monkeypatch.setattr(functional, "THRESHOLD_EPS", offset)
    seen = _clipped_at(monkeypatch)
    params = _params(device)
    opt = ROOT(params, lr=0.02, batched=batched, telemetry=True)
    for step in range(2):
        seen.clear()
        _grads(params, step)
        opt.step()
        for name, shape in SHAPES.items():
            used = torch.cat(seen[shape[-2:]])  # the per-matrix thresholds of this parameter
            assert used.numel() == (shape[0] if len(shape) == 3 else 1)
            reported = opt.telemetry[name]["eps"]
            assert reported == float(used.mean()), (name, step)
            if offset is not None:  # the offset dominates: the clip is not at the quantile
                assert reported > offset
    # the threshold the step used clips what the telemetry says it clipped
    t = opt.telemetry["a"]
    assert 0 < t["clip_fraction"] <= 0.11 and 0 < t["outlier_energy"] < 1


def test_telemetry_without_a_clip_reports_none() -> None:
    params = _params()
    opt = ROOT(params, lr=0.02, outlier_quantile=None, telemetry=True)
    _grads(params, 0)
    opt.step()
    t = opt.telemetry["a"]
    assert t["eps"] != t["eps"]  # NaN: no threshold
    assert (t["clip_fraction"], t["outlier_energy"]) == (0.0, 0.0)
