"""Lightning 2.x with ROOT: configure_optimizers returning ROOT + a per-step scheduler,
the closure run by ROOT.step, bf16-mixed autocast, checkpoint and exact resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("lightning")

from rootopt import ROOT, param_groups  # noqa: E402
from rootopt.train.models import MLPClassifier  # noqa: E402

STEPS_PER_EPOCH = 4


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 3)


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = MLPClassifier(16, 32, 4)
        self.calls: list[tuple[bool, bool, torch.dtype]] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        # (grad enabled inside ROOT.step's no_grad, autocast on, logits dtype)
        self.calls.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), logits.dtype))
        return F.cross_entropy(logits.float(), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x).float(), y))

    def configure_optimizers(self) -> dict[str, Any]:
        groups, _ = param_groups(self, lr=1e-2)
        opt = ROOT(groups, lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data() -> torch.utils.data.DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(4, 16, generator=g) * 2
    y = torch.arange(4).repeat(STEPS_PER_EPOCH * 4)
    x = centers[y] + 0.5 * torch.randn(len(y), 16, generator=g)
    ds = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(ds, batch_size=16, shuffle=False)


def fit(steps: int, root: Path, precision: str, ckpt: str | None = None) -> tuple[Any, Module]:
    """Train to ``steps``, saving a checkpoint after every epoch's validation
    (``epoch=N.ckpt``). With Lightning 2.6 a checkpoint written at the end of a training
    epoch *without* a validation loop resumes by replaying one batch (not exact, whatever
    the optimizer); after validation it is exact."""
    L.seed_everything(0, verbose=False)
    module = Module()
    every_epoch = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=root / "ckpt", filename="{epoch}", every_n_epochs=1, save_top_k=-1
    )
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        precision=precision,
        default_root_dir=str(root),
        logger=False,
        callbacks=[every_epoch],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data(), data(), ckpt_path=ckpt)
    return trainer, module


def test_lightning_bf16_closure_scheduler_and_exact_resume(tmp_path: Path) -> None:
    steps = 2 * STEPS_PER_EPOCH
    trainer, module = fit(steps, tmp_path, "bf16-mixed")
    assert trainer.global_step == steps
    # the closure (forward + backward) ran once per step, inside ROOT.step, under autocast
    assert module.calls == [(True, True, torch.bfloat16)] * steps
    opt = trainer.optimizers[0]
    assert isinstance(opt, ROOT)
    assert all(p.dtype == torch.float32 for p in module.parameters())
    # the scheduler stepped every optimizer step (interval="step")
    for g in opt.param_groups:
        assert g["lr"] == pytest.approx(g["initial_lr"] * warmup(steps))
    head = next(g for g in opt.param_groups if "net.net.4.weight" in g["param_names"])
    assert head["algorithm"] == "adamw"  # the classifier's last layer, found by structure

    # resume from the checkpoint written at the end of the first epoch: same weights
    ckpt = tmp_path / "ckpt" / "epoch=0.ckpt"
    assert ckpt.is_file()
    resumed_trainer, resumed = fit(steps, tmp_path / "resumed", "bf16-mixed", str(ckpt))
    assert resumed_trainer.global_step == steps
    a, b = module.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sa, sb = opt.state_dict(), resumed_trainer.optimizers[0].state_dict()
    assert len(sa["state"]) == len(sb["state"]) == len(list(module.parameters()))
    for pid, st in sa["state"].items():
        for key, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(sb["state"][pid][key])), key


def test_lightning_fp32_loss_falls(tmp_path: Path) -> None:
    losses: list[float] = []

    class Logged(Module):
        def training_step(self, batch: Any, idx: int) -> torch.Tensor:
            loss = super().training_step(batch, idx)
            losses.append(loss.item())
            return loss

    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        max_steps=3 * STEPS_PER_EPOCH,
        accelerator="cpu",
        precision="32-true",
        default_root_dir=str(tmp_path),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Logged()
    trainer.fit(module, data())
    assert module.calls[0][1:] == (False, torch.float32)
    assert len(losses) == 3 * STEPS_PER_EPOCH and losses[-1] < 0.7 * losses[0]
