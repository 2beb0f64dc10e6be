"""Lightning with ROOT: ``configure_optimizers`` returns ROOT on ``rootopt.param_groups``
and a per-step warm-up/cosine schedule; ``bf16-mixed`` precision; checkpoint and resume.

The data is scikit-learn's bundled 8x8 digits (no download); the model is rootopt's own
MLP classifier, whose last layer the routing sends to AdamW.

    python examples/lightning_module.py [--steps 300] [--precision bf16-mixed]
    python examples/lightning_module.py --steps 300 --resume-at 150   # stop, resume, compare

Lightning's automatic optimization calls ``optimizer.step(closure)``; ROOT runs the closure
(forward + backward) itself, like any torch optimizer. Needs ``pip install
rootopt[integrations]`` (and ``rootopt[train]`` for scikit-learn).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import rootopt
from rootopt.train.models import MLPClassifier


class DigitsModule(L.LightningModule):
    def __init__(self, lr: float = 3e-3, warmup: int = 20, total: int = 300) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr, self.warmup, self.total = lr, warmup, total
        self.net = MLPClassifier(64, 128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).float(), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], idx: int) -> None:
        x, y = batch
        logits = self(x).float()
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        groups, report = rootopt.param_groups(self, lr=self.lr, weight_decay=0.01)
        print(report)
        opt = rootopt.ROOT(groups, lr=self.lr)
        warmup, total = self.warmup, self.total

        def warmup_cosine(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            t = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.5 * (1 + math.cos(math.pi * t))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loaders(batch: int) -> tuple[DataLoader[Any], DataLoader[Any]]:
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(x), generator=g)
    tr, va = perm[:1500], perm[1500:]
    # shuffle=False keeps every epoch's order fixed, so a resumed run sees the same data
    return (
        DataLoader(TensorDataset(x[tr], y[tr]), batch_size=batch, shuffle=False),
        DataLoader(TensorDataset(x[va], y[va]), batch_size=512),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=50)  # 1500 / 50 = 30 steps per epoch
    ap.add_argument("--precision", default="bf16-mixed", choices=("32-true", "bf16-mixed"))
    ap.add_argument("--resume-at", type=int, default=0, help="a multiple of 30 (epoch end)")
    args = ap.parse_args()
    train_dl, val_dl = loaders(args.batch)

    def fit(max_steps: int, root_dir: str, ckpt: str | None = None) -> tuple[L.Trainer, Any]:
        L.seed_everything(0)
        module = DigitsModule(args.lr, total=args.steps)
        trainer = L.Trainer(
            max_steps=max_steps,
            accelerator="cpu",
            precision=args.precision,
            default_root_dir=root_dir,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            val_check_interval=1.0,
        )
        trainer.fit(module, train_dl, val_dl, ckpt_path=ckpt)
        return trainer, module

    with tempfile.TemporaryDirectory() as tmp:
        trainer, module = fit(args.steps, tmp)
        m = trainer.callback_metrics
        print(
            f"steps {trainer.global_step}: val loss {m['val_loss']:.4f}  val acc {m['val_acc']:.4f}"
        )
        if args.resume_at:
            first, _ = fit(args.resume_at, tmp)
            ckpt = str(Path(tmp) / "half.ckpt")
            first.save_checkpoint(ckpt)
            _, resumed = fit(args.steps, tmp, ckpt)
            diff = max(
                (a - b).abs().max().item()
                for a, b in zip(module.state_dict().values(), resumed.state_dict().values())
            )
            print(f"resumed at step {args.resume_at}: max |param difference| = {diff:.3g}")


if __name__ == "__main__":
    main()
