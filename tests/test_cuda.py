"""GPU paths: run where CUDA is present, skipped cleanly elsewhere."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rootopt import ROOT, orthogonalize

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("batched", [True, False])
def test_cuda_step_matches_cpu(batched: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    m = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32))
    mc = copy.deepcopy(m).cuda()
    # float32 on both: "auto" iterates in bfloat16 on CUDA (the defaults study), which is not
    # the CPU's float32 math; the bf16 path is tested below
    kw = dict(batched=batched, ns_dtype="float32")
    o, oc = ROOT(m.parameters(), **kw), ROOT(mc.parameters(), **kw)  # type: ignore[arg-type]
    for _ in range(3):
        for p, pc in zip(m.parameters(), mc.parameters()):
            g = torch.randn_like(p)
            p.grad, pc.grad = g, g.cuda()
        o.step()
        oc.step()
    for p, pc in zip(m.parameters(), mc.parameters()):
        torch.testing.assert_close(pc.cpu(), p, atol=1e-4, rtol=1e-4)


def test_cuda_bf16_iteration_and_bf16_params() -> None:
    G = torch.randn(4, 256, 512, device="cuda")
    U32 = orthogonalize(G, coefficients="muon")
    U16 = orthogonalize(G, coefficients="muon", dtype=torch.bfloat16)
    assert ((U16.float() - U32).norm() / U32.norm()).item() < 0.05
    p = nn.Parameter(torch.randn(128, 256, device="cuda", dtype=torch.bfloat16))
    opt = ROOT([p], ns_dtype="bfloat16")
    p.grad = torch.randn_like(p)
    opt.step()
    assert opt.state[p]["momentum_buffer"].dtype == torch.float32
    assert torch.isfinite(p).all()


def test_cuda_fp16_grad_scaler() -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
    opt = ROOT(model.parameters(), lr=0.02)
    scaler = torch.amp.GradScaler("cuda", init_scale=65536.0, growth_interval=2000)
    x, y = torch.randn(16, 32, device="cuda"), torch.randn(16, 8, device="cuda")
    first = None
    for _ in range(20):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        first = first if first is not None else loss.item()
    assert loss.item() < first


def test_cuda_adanewton_direction_matches_cpu() -> None:
    """AdaNewton's schedule on CUDA reaches the polar error it reaches on the CPU, on
    low-rank signals over noise floors and an exactly rank-4 matrix."""
    from rootopt.coeffs.adanewton import lookup
    from rootopt.ortho import direction

    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(0)
    rows, cols = 200, 700
    U = torch.linalg.qr(torch.randn(rows, 4, generator=g))[0]
    V = torch.linalg.qr(torch.randn(cols, 4, generator=g))[0]
    S = (U * torch.linspace(1, 0.3, 4)) @ V.T
    floors = (0.01, 0.002, 0.0)
    G = torch.stack([S + f * torch.randn(rows, cols, generator=g) / cols**0.5 for f in floors])
    schedule = lookup(rows, cols, 5).schedule
    out_cpu = direction(G, schedule, method="newton_schulz", dtype=torch.float32)
    out_gpu = direction(G.cuda(), schedule, method="newton_schulz", dtype=torch.float32)
    # The directions of the noise floor's tiny singular values are ill-conditioned, so
    # CPU and GPU rounding part there; what must agree is the polar error each reaches.
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    polar = U @ Vh
    for i in range(len(floors)):
        e_cpu = float((out_cpu[i].double() - polar[i]).norm() / polar[i].norm())
        e_gpu = float((out_gpu[i].cpu().double() - polar[i]).norm() / polar[i].norm())
        assert e_gpu == pytest.approx(e_cpu, rel=0.05, abs=1e-4), (i, e_cpu, e_gpu)


@pytest.mark.parametrize("q", [0.5, 0.9, 0.999])
def test_cuda_quantile_equals_cpu_bit_for_bit(q: float) -> None:
    """abs_quantile on CUDA (bisection above 2**16 entries, kthvalue below) equals the
    CPU's (sampled bracket / selection) exactly, including ties."""
    from rootopt import abs_quantile

    g = torch.Generator().manual_seed(2)
    for shape in [(3, 300, 700), (2, 64, 64)]:
        M = torch.randn(*shape, generator=g)
        M[0] = (M[0] * 8).round()
        assert torch.equal(abs_quantile(M.cuda(), q).cpu(), abs_quantile(M, q))
