"""The ROOT optimizer against oracles: official code, its own reference path, Muon, AdamW."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import nn

from oracle import official_root_step
from rootopt import ROOT
from rootopt.ortho import orthogonalize

SHAPES = [(16, 16), (24, 40), (40, 24), (17, 5), (5, 17), (1, 8), (8, 1)]


def _grads(shape: tuple[int, ...], n: int, scale: float = 1.0) -> list[torch.Tensor]:
    out = []
    for _ in range(n):
        g = torch.randn(*shape) * scale
        # a few heavy outliers, as in real gradients
        idx = torch.randint(0, g.numel(), (max(1, g.numel() // 50),))
        g.view(-1)[idx] *= 30
        out.append(g)
    return out


def _run(opt_factory: Any, p0: torch.Tensor, grads: list[torch.Tensor]) -> tuple[nn.Parameter, Any]:
    p = nn.Parameter(p0.clone())
    opt = opt_factory([p])
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p, opt


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("nesterov", [True, False])
def test_official_mode_matches_official_code(shape: tuple[int, int], nesterov: bool) -> None:
    p0 = torch.randn(*shape)
    grads = _grads(shape, 4)
    p, _ = _run(
        lambda ps: ROOT(
            ps, ns_coefficients="official", ns_dtype="float32", nesterov=nesterov, lr=0.02
        ),
        p0,
        grads,
    )  # the official code iterates in float32
    ref = p0.clone()
    buf = torch.zeros_like(ref)
    for g in grads:
        official_root_step(ref, g, buf, lr=0.02, nesterov=nesterov)
    torch.testing.assert_close(p.detach(), ref, atol=2e-6, rtol=1e-5)


@pytest.mark.slow
def test_official_mode_paper_shape() -> None:
    shape = (3072, 2048)  # a paper-table shape, tall
    p0 = torch.randn(*shape) * 0.02
    g = _grads(shape, 1)[0]
    p, _ = _run(lambda ps: ROOT(ps, ns_coefficients="official", ns_dtype="float32"), p0, [g])
    ref, buf = p0.clone(), torch.zeros(shape)
    official_root_step(ref, g, buf)
    torch.testing.assert_close(p.detach(), ref, atol=2e-6, rtol=1e-5)


def _multi_model() -> nn.Module:
    m = nn.Module()
    m.a = nn.Parameter(torch.randn(12, 20))
    m.b = nn.Parameter(torch.randn(12, 20))  # same shape as a: shares a batched bucket
    m.c = nn.Parameter(torch.randn(20, 12))
    m.experts = nn.Parameter(torch.randn(3, 12, 20))  # 3-D stack joins the 12x20 bucket
    m.conv = nn.Parameter(torch.randn(6, 3, 3, 3))  # 4-D: flattened to 6x27
    m.bf16 = nn.Parameter(torch.randn(9, 14).bfloat16())
    m.bias = nn.Parameter(torch.randn(20))
    return m


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"nesterov": False, "ns_coefficients": "polar_express", "lr_scale": "muon"},
        {"robust_scaling": True},
        {"ortho_method": "svd"},
        {"ortho_method": "qr", "outlier_quantile": None},
        {"ns_dtype": "bfloat16"},
    ],
    ids=["default", "pe-muonscale", "robust", "svd", "qr-noclip", "bf16"],
)
def test_batched_path_equals_reference(options: dict[str, Any]) -> None:
    m1 = _multi_model()
    m2 = copy.deepcopy(m1)
    o1 = ROOT(m1.named_parameters(), batched=False, telemetry=True, **options)
    o2 = ROOT(m2.named_parameters(), batched=True, telemetry=True, **options)
    tol = (
        {"atol": 3e-2, "rtol": 3e-2}
        if options.get("ns_dtype") == "bfloat16"
        else {"atol": 2e-5, "rtol": 1e-4}
    )
    for _ in range(3):
        for p1, p2 in zip(m1.parameters(), m2.parameters()):
            g = torch.randn_like(p1, dtype=torch.float32).to(p1.dtype)
            p1.grad, p2.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    for (n1, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(p1, p2, **tol, msg=n1)
        s1, s2 = o1.state[p1], o2.state[p2]
        assert s1.keys() == s2.keys()
        for k in s1:
            if isinstance(s1[k], torch.Tensor):
                torch.testing.assert_close(s1[k], s2[k], msg=f"{n1}:{k}")
                assert s1[k].dtype == torch.float32
            else:
                assert s1[k] == s2[k]
    assert o1.telemetry.keys() == o2.telemetry.keys()
    for k, t in o1.telemetry.items():
        assert t["clip_fraction"] == pytest.approx(o2.telemetry[k]["clip_fraction"], abs=1e-6)


@pytest.mark.parametrize("shape", [(16, 32), (48, 24), (64, 64)])
def test_muon_mode_equals_torch_muon(shape: tuple[int, int]) -> None:
    """outlier_quantile=None + Muon's tuple is Muon (sum vs EMA momentum only rescales v,
    which the Frobenius normalisation removes)."""
    p0 = torch.randn(*shape)
    grads = _grads(shape, 5)
    ours, _ = _run(
        lambda ps: ROOT(
            ps, lr=0.02, outlier_quantile=None, ns_coefficients="muon", ns_dtype="bfloat16"
        ),
        p0,
        grads,
    )
    theirs, _ = _run(
        lambda ps: torch.optim.Muon(ps, lr=0.02, adjust_lr_fn="match_rms_adamw"), p0, grads
    )
    delta_ours, delta_theirs = ours.detach() - p0, theirs.detach() - p0
    rel = (delta_ours - delta_theirs).norm() / delta_theirs.norm()
    assert rel < 0.03, rel  # bf16 iterations on both sides, rounded in different places


def test_muon_mode_float32_equals_muon_math() -> None:
    """Same comparison in float32 against a transcription of torch's Muon update."""
    shape = (20, 36)
    p0, grads = torch.randn(*shape), _grads(shape, 4)
    ours, _ = _run(
        lambda ps: ROOT(
            ps, lr=0.02, outlier_quantile=None, ns_coefficients="muon", ns_dtype="float32"
        ),
        p0,
        grads,
    )
    ref, buf = p0.clone(), torch.zeros(shape)
    for g in grads:
        buf.lerp_(g, 0.05)
        v = g.lerp(buf, 0.95)
        U = orthogonalize(v, coefficients="muon", dtype=torch.float32)
        ref.mul_(1 - 0.02 * 0.1).sub_(0.02 * 0.2 * math.sqrt(max(shape)) * U)
    torch.testing.assert_close(ours.detach(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batched", [True, False])
def test_adamw_part_equals_torch_adamw(batched: bool) -> None:
    shapes = [(7,), (3, 5), ()]
    params0 = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(5)]
    ps1 = [nn.Parameter(t.clone()) for t in params0]
    ps2 = [nn.Parameter(t.clone()) for t in params0]
    o1 = ROOT([{"params": ps1, "algorithm": "adamw"}], lr=3e-3, weight_decay=0.1, batched=batched)
    o2 = torch.optim.AdamW(
        ps2, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False
    )
    for gs in grads:
        for p1, p2, g in zip(ps1, ps2, gs):
            p1.grad, p2.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    for p1, p2 in zip(ps1, ps2):
        torch.testing.assert_close(p1, p2, atol=1e-7, rtol=1e-6)


def test_bare_iterable_routes_by_ndim() -> None:
    w, b = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.randn(6))
    opt = ROOT([w, b])
    # One user group stays one group (torch's contract); routing is per parameter inside it.
    assert len(opt.param_groups) == 1
    assert opt.param_groups[0]["algorithm"] == "auto" and opt.param_groups[0]["params"] == [w, b]
    w.grad, b.grad = torch.randn_like(w), torch.randn_like(b)
    opt.step()
    assert set(opt.state[w]) == {"step", "momentum_buffer"}
    assert set(opt.state[b]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("method", ["newton_schulz", "svd"])
@pytest.mark.parametrize("shape", SHAPES)
def test_update_orthogonality(shape: tuple[int, int], method: str) -> None:
    p = nn.Parameter(torch.zeros(*shape))
    opt = ROOT([p], lr=1.0, weight_decay=0.0, lr_scale="none", ortho_method=method)  # type: ignore[arg-type]
    p.grad = torch.randn(*shape)
    opt.step()
    s = torch.linalg.svdvals(-p.detach().double())
    if method == "svd":
        torch.testing.assert_close(s, torch.ones_like(s), atol=1e-5, rtol=1e-5)
    else:
        assert s.min() > 0.3 and s.max() < 1.3


@pytest.mark.parametrize("form", ["sum", "scaled"])
def test_scale_invariance(form: str) -> None:
    """The quantile threshold and Frobenius normalisation make U independent of the
    gradient's scale (so of the momentum convention too)."""
    shape = (12, 30)
    p0, grads = torch.randn(*shape), _grads(shape, 3)
    # a power of two: the iterations (bfloat16 or float32, as "auto" picks on this CPU) round
    # the scaled input exactly as the unscaled one
    c = 1.0 if form == "sum" else 1024.0
    a, _ = _run(lambda ps: ROOT(ps, lr=0.01), p0, grads)
    b, _ = _run(lambda ps: ROOT(ps, lr=0.01), p0, [g * c for g in grads])
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_lr_scales() -> None:
    for mode, expected in [("moonlight", 0.2 * math.sqrt(40)), ("muon", 1.0), ("none", 1.0)]:
        p = nn.Parameter(torch.zeros(10, 40))
        opt = ROOT([p], lr=1.0, weight_decay=0.0, lr_scale=mode, ortho_method="svd")  # type: ignore[arg-type]
        p.grad = torch.randn(10, 40)
        opt.step()
        assert torch.linalg.svdvals(p.detach()).max().item() == pytest.approx(expected, rel=1e-4)
    p = nn.Parameter(torch.zeros(40, 10))
    opt = ROOT([p], lr=1.0, weight_decay=0.0, lr_scale="muon", ortho_method="svd")
    p.grad = torch.randn(40, 10)
    opt.step()
    assert torch.linalg.svdvals(p.detach()).max().item() == pytest.approx(2.0, rel=1e-4)


def test_weight_decay_uses_unscaled_lr() -> None:
    p = nn.Parameter(torch.ones(4, 4))
    opt = ROOT([p], lr=0.1, weight_decay=0.5)
    p.grad = torch.zeros(4, 4)  # zero gradient: only the decay acts
    opt.step()
    torch.testing.assert_close(p.detach(), torch.full((4, 4), 1 - 0.1 * 0.5))


def test_determinism() -> None:
    def once() -> torch.Tensor:
        torch.manual_seed(3)
        m = _multi_model()
        opt = ROOT(m.parameters())
        for _ in range(2):
            for p in m.parameters():
                p.grad = torch.randn_like(p)
            opt.step()
        return torch.cat([p.detach().float().flatten() for p in m.parameters()])

    assert torch.equal(once(), once())
