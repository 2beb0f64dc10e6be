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
    o, oc = ROOT(m.parameters(), batched=batched), ROOT(mc.parameters(), batched=batched)
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
