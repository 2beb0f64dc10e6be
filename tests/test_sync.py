"""The gradient-sync object of the training step (rootopt.train.sync): one mode per run,
what each mode finishes, clips and counts, and the one clip coefficient that the training
loop's GradClipper and DistributedROOT.clip_grad_norm_ share with torch's clipping."""

from __future__ import annotations

import torch
from torch import nn

from rootopt.config import Config, load_config
from rootopt.distributed import DistributedROOT
from rootopt.train.build import Precision
from rootopt.train.schedule import GradClipper, global_grad_norm
from rootopt.train.sync import DDPSync, FSDPSync, OwnerSync, grad_sync


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _backward(model: nn.Module, scale: float = 1.0) -> None:
    torch.manual_seed(1)
    (model(torch.randn(4, 6)).pow(2).sum() * scale).backward()


def test_one_mode_per_run() -> None:
    model = _model()
    cfg, fsdp = load_config(None, []), load_config(None, ["distributed.parallel=fsdp"])
    owner_opt = DistributedROOT(model.parameters(), lr=0.01, average_grads=True)
    plain_opt = torch.optim.AdamW(model.parameters())
    modes = {
        "owner at 2": grad_sync(cfg, model, owner_opt, 2),
        "fsdp at 2": grad_sync(fsdp, model, plain_opt, 2),
        "ddp at 2": grad_sync(cfg, model, plain_opt, 2),
        "one process": grad_sync(fsdp, model, owner_opt, 1),
    }
    kinds = {k: type(v) for k, v in modes.items()}
    assert kinds == {
        "owner at 2": OwnerSync,
        "fsdp at 2": FSDPSync,
        "ddp at 2": DDPSync,
        "one process": DDPSync,
    }
    # statistics reduced over ranks where each holds a part; the loss scale told the
    # agreed outcome where the optimizer unscales and checks
    assert [(m.partial, m.agreed) for m in modes.values()] == [
        (True, True),
        (True, False),
        (False, False),
        (False, False),
    ]


def _static_fp16_1024() -> Config:
    """fp16 autocast with a static loss scale of 1024 (a power of two: unscaling is exact)."""
    return load_config(
        None,
        [
            "mixed_precision.enabled=true",
            "mixed_precision.dtype=fp16",
            "mixed_precision.loss_scale=1024",
        ],
    )


def test_one_process_finishes_unscaled_and_clips_p_grad() -> None:
    """Static loss scale 1024: finish unscales p.grad and returns the norm of the unscaled
    gradients; clip_targets are the p.grad tensors themselves; nothing is counted."""
    cfg = _static_fp16_1024()
    model, ref = _model(), _model()
    sync = grad_sync(cfg, model, torch.optim.SGD(model.parameters(), lr=0.1), 1)
    _backward(model, 1024.0)
    _backward(ref)
    norm = sync.finish(Precision(cfg, torch.device("cpu")))
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)  # 1024 is a power of two: exact
    assert float(norm) == float(global_grad_norm(list(ref.parameters())))
    targets = sync.clip_targets()
    assert len(targets) == 4
    assert all(t is p.grad for t, p in zip(targets, model.parameters()))
    assert sync.comm_bytes() is None


def test_the_optimizer_finishes_its_own_gradients() -> None:
    """DistributedROOT(average_grads=True): finish is sync_grads(inv_scale=1/scale), the
    clip targets are the gradients it answers for (one process: every one), unscaled."""
    cfg = _static_fp16_1024()
    model, ref = _model(), _model()
    opt = DistributedROOT(model.parameters(), lr=0.01, average_grads=True)
    sync = OwnerSync(model, opt)
    _backward(model, 1024.0)
    _backward(ref)
    norm = sync.finish(Precision(cfg, torch.device("cpu")))
    assert float(norm) == float(global_grad_norm(list(ref.parameters())))
    got = sorted((tuple(t.shape), t.sum().item()) for t in sync.clip_targets())
    want = sorted((tuple(p.grad.shape), p.grad.sum().item()) for p in ref.parameters())
    assert got == want
    assert sync.comm_bytes() == 0.0  # one process: nothing sent


def test_one_clip_coefficient() -> None:
    """GradClipper on the gradient tensors, DistributedROOT.clip_grad_norm_ and torch's
    clip_grads_with_norm_ scale the gradients bit for bit alike (float32 and bfloat16)."""
    models = [_model() for _ in range(3)]
    for m in models:
        m[2].to(torch.bfloat16)
        torch.manual_seed(1)
        x = torch.randn(4, 6)
        (m[2](m[1](m[0](x)).to(torch.bfloat16)).float().pow(2).sum()).backward()
    ours, theirs, opt_model = models
    norm = global_grad_norm(list(ours.parameters()))
    assert float(norm) > 0.5  # every one of them clips
    scale = GradClipper("norm", max_norm=0.5, value=0.0, beta=0.9, factor=2.0)(
        [p.grad for p in ours.parameters()], norm
    )
    assert scale == 0.5 / (float(norm) + 1e-6)
    torch.nn.utils.clip_grads_with_norm_(list(theirs.parameters()), 0.5, norm)
    opt = DistributedROOT(opt_model.parameters(), lr=0.01)
    assert torch.equal(opt.clip_grad_norm_(0.5), norm)
    for a, b, c in zip(ours.parameters(), theirs.parameters(), opt_model.parameters()):
        assert a.grad.dtype == b.grad.dtype == c.grad.dtype
        assert torch.equal(a.grad, b.grad) and torch.equal(a.grad, c.grad)


def test_value_clipping_clamps_the_targets() -> None:
    model, ref = _model(), _model()
    _backward(model)
    _backward(ref)
    clip = GradClipper("value", max_norm=1.0, value=0.05, beta=0.9, factor=2.0)
    assert clip([p.grad for p in model.parameters()], torch.tensor(1.0)) == 1.0
    torch.nn.utils.clip_grad_value_(list(ref.parameters()), 0.05)
    limit = float(torch.tensor(0.05))  # in float32
    assert any(float(p.grad.abs().max()) == limit for p in model.parameters())  # it clamps
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)
