"""The per-matrix reference ``_single_tensor_root`` against the class on coefficient sets
and speed options beyond ``tests/test_paths.py``'s (Polar Express, Muon mode, Gram-space
iteration forced on and off, a bfloat16 iteration): the class's reference path calls it
bit for bit, and the batched path — stacked buckets, byte budget, one quantile selection
per bucket — matches it on parameters and state."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from rootopt import ROOT
from rootopt.coeffs import resolve
from rootopt.optim import functional
from rootopt.optim._options import ns_dtype_name
from rootopt.optim.functional import RootOptions, _single_tensor_root

# tall, wide, square, odd, conv 4-D, 3-D stack sharing a bucket with two 2-D params,
# and a shape the Gram-space iteration takes by default (64 x 160, aspect 2.5).
SHAPES: list[tuple[int, ...]] = [
    (40, 24),
    (24, 40),
    (16, 16),
    (7, 13),
    (6, 3, 3, 3),
    (3, 24, 40),
    (24, 40),
    (64, 160),
]

_DT = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# The dtype ROOT's default ns_dtype ("auto") iterates in on this CPU: bfloat16 with bf16
# units, float32 without (rootopt.optim._options). The reference is handed it explicitly.
DEFAULT_NS_DTYPE = ns_dtype_name("auto", torch.device("cpu"))


def _params(param_dtype: torch.dtype, seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(*s, generator=g).to(param_dtype)) for s in SHAPES]


def _grads(params: list[nn.Parameter], steps: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        gs = []
        for p in params:
            t = torch.randn(p.shape, generator=g)
            t.view(-1)[:: max(1, p.numel() // 7)] *= 25  # a few outliers
            gs.append(t.to(p.dtype))
        out.append(gs)
    return out


def _by_reference(
    params: list[nn.Parameter], grads: list[list[torch.Tensor]], options: dict[str, Any]
) -> list[dict[str, Any]]:
    """Drive _single_tensor_root directly, keeping state the way torch optimizers do."""
    states: list[dict[str, Any]] = [
        {"step": torch.tensor(0.0), "momentum_buffer": torch.zeros_like(p, dtype=torch.float32)}
        for p in params
    ]
    spec = options.get("ns_coefficients", "polar_express")
    o = RootOptions(
        lr=0.02,
        nesterov=options.get("nesterov", True),
        quantile=options.get("outlier_quantile", 0.9),
        ns_dtype=_DT[options.get("ns_dtype", DEFAULT_NS_DTYPE)],
        gram={"auto": None, "on": True, "off": False}[options.get("ns_gram", "auto")],
    )
    for gs in grads:
        for p, g, st in zip(params, gs, states, strict=True):
            st["step"] += 1
            with torch.no_grad():
                _single_tensor_root(
                    p, g, st["momentum_buffer"], st["step"], o,
                    lambda r, c: resolve(spec, r, c, 5),
                )  # fmt: skip
    return states


def _by_class(params: list[nn.Parameter], grads: list[list[torch.Tensor]], **options: Any) -> ROOT:
    opt = ROOT(params, lr=0.02, **{"ns_coefficients": "polar_express", **options})
    for gs in grads:
        for p, g in zip(params, gs, strict=True):
            p.grad = g.clone()
        opt.step()
    return opt


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"nesterov": False, "ns_coefficients": "muon", "ns_dtype": "float32"},
        {"ns_dtype": "float32"},
    ],
    ids=["default", "plain-momentum-muon", "fp32-ns"],
)
def test_class_reference_path_is_the_function(options: dict[str, Any]) -> None:
    ref_params, cls_params = _params(torch.float32), _params(torch.float32)
    grads = _grads(ref_params, 3)
    states = _by_reference(ref_params, grads, options)
    opt = _by_class(cls_params, grads, batched=False, **options)
    assert len(states) == len(cls_params)
    for p_ref, p_cls, st in zip(ref_params, cls_params, states, strict=True):
        assert torch.equal(p_ref, p_cls)
        assert opt.state[p_cls]["step"] == st["step"] == 3
        assert torch.equal(opt.state[p_cls]["momentum_buffer"], st["momentum_buffer"])


@pytest.mark.parametrize(
    ("param_dtype", "options"),
    [
        (torch.float32, {}),
        # 2 matrices: splits and chunks
        (torch.float32, {"bucket_bytes": 24 * 40 * 4 * 2, "ns_dtype": "float32"}),
        (torch.float32, {"ns_gram": "off", "ns_dtype": "float32"}),
        (torch.float32, {"ns_gram": "on", "nesterov": False, "ns_dtype": "float32"}),
        (torch.float32, {"ns_dtype": "float32"}),
        (
            torch.float32,
            {"outlier_quantile": None, "ns_coefficients": "muon", "ns_dtype": "float32"},
        ),
        (torch.bfloat16, {}),
        (torch.bfloat16, {"ns_dtype": "bfloat16", "bucket_bytes": 24 * 40 * 4 * 2}),
    ],
    ids=[
        "default",
        "tiny-budget",
        "no-gram",
        "gram-all",
        "fp32-ns",
        "muon-mode",
        "pbf16",
        "pbf16-all",
    ],
)
def test_batched_path_matches_reference_function(
    param_dtype: torch.dtype, options: dict[str, Any]
) -> None:
    ref_params, cls_params = _params(param_dtype), _params(param_dtype)
    grads = _grads(ref_params, 3)
    states = _by_reference(ref_params, grads, options)
    opt = _by_class(cls_params, grads, batched=True, **options)
    bf16 = options.get("ns_dtype", DEFAULT_NS_DTYPE) == "bfloat16" or param_dtype == torch.bfloat16
    tol = {"atol": 2e-2, "rtol": 2e-2} if bf16 else {"atol": 2e-5, "rtol": 1e-4}
    assert len(states) == len(cls_params)
    for i, (p_ref, p_cls, st) in enumerate(zip(ref_params, cls_params, states, strict=True)):
        assert p_cls.dtype == param_dtype
        torch.testing.assert_close(p_cls, p_ref, **tol, msg=f"param {SHAPES[i]}")
        s = opt.state[p_cls]
        assert s["step"] == st["step"] == 3
        assert s["momentum_buffer"].dtype == torch.float32
        # momentum never passes through the iteration: equal up to one rounding (the
        # batched path forms g + mu buf in one fused operation on the CPU)
        torch.testing.assert_close(
            s["momentum_buffer"], st["momentum_buffer"], atol=1e-6, rtol=1e-6
        )


def test_byte_budget_bounds_every_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    """No orthogonalization call sees more than the budget (a single larger matrix goes
    alone), and the result equals the unbounded path."""
    budget = 24 * 40 * 4 * 2
    sizes: list[int] = []
    real = functional.direction

    def spy(B: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        sizes.append(B.numel() * 4 if B.size(0) > 1 else 0)
        return real(B, *args, **kw)

    monkeypatch.setattr(functional, "direction", spy)
    bounded, unbounded = _params(torch.float32), _params(torch.float32)
    grads = _grads(bounded, 2)
    _by_class(bounded, grads, bucket_bytes=budget)
    calls_bounded = len(sizes)
    assert sizes and max(sizes) <= budget
    sizes.clear()
    _by_class(unbounded, grads, bucket_bytes=0)
    # The 24x40 matrices (a matrix, a stack of 3, a matrix) are one call unbounded;
    # bounded, three per step: [1], [2 of the stack], [the stack's last, 1].
    assert calls_bounded == len(sizes) + 2 * 2
    for a, b in zip(bounded, unbounded, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("key", "value"), [("bucket_bytes", -1), ("bucket_bytes", 1.5), ("ns_gram", "yes")]
)
def test_bad_speed_options(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"Invalid {key}"):
        ROOT([nn.Parameter(torch.randn(4, 4))], **{key: value})
