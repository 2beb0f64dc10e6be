"""Quickstart: train a small byte-level transformer on real text with ROOT.

The text is CPython's own standard-library source (present on every Python install), so
this runs offline. The model is the same Llama-style LM that ``rootopt train`` and
``rootopt bench`` use. Prints the routing table, then the loss falling.

    python examples/quickstart.py [--steps 150] [--optimizer root|adamw|muon|...]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import rootopt
from rootopt.config import ModelConfig
from rootopt.data.corpora import text_bytes
from rootopt.optim.registry import REGISTRY
from rootopt.train.models import LlamaLM


def stdlib_bytes(limit: int = 2_000_000) -> torch.Tensor:
    return torch.frombuffer(
        bytearray(text_bytes("stdlib", max_bytes=limit)), dtype=torch.uint8
    ).long()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--optimizer", default="root", choices=list(REGISTRY))
    args = ap.parse_args()
    torch.manual_seed(0)
    data = stdlib_bytes()
    split = int(0.95 * len(data))
    train, val = data[:split], data[split:]
    model = LlamaLM(ModelConfig(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2), args.ctx)
    opt, report = rootopt.make_optimizer(args.optimizer, model, lr=args.lr, weight_decay=0.1)
    if report is not None:
        print(report, "\n")
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=[g["lr"] for g in opt.param_groups], total_steps=args.steps, pct_start=0.1
    )

    def batch(src: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.randint(0, len(src) - args.ctx - 1, (args.batch,), generator=g)
        x = torch.stack([src[j : j + args.ctx + 1] for j in i.tolist()])
        return x[:, :-1], x[:, 1:]

    def loss_on(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())

    gen, vgen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    vx, vy = batch(val, vgen)
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = batch(train, gen)
        loss = loss_on(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step == 1 or step % 25 == 0:
            with torch.no_grad():
                vloss = loss_on(vx, vy).item()
            print(
                f"step {step:4d}  train loss {loss.item():.3f}  val loss {vloss:.3f}  "
                f"({(time.perf_counter() - t0) / step:.2f} s/step)",
                flush=True,
            )


if __name__ == "__main__":
    main()
