"""Quickstart: train a small byte-level transformer on real text with ROOT.

The text is CPython's own standard-library source (present on every Python install), so
this runs offline. Prints the routing table, then the loss falling.

    python examples/quickstart.py [--steps 150] [--optimizer root|adamw|muon]
"""

from __future__ import annotations

import argparse
import sysconfig
import time
from pathlib import Path

import torch
from torch import nn

import rootopt


def stdlib_bytes(limit: int = 2_000_000) -> torch.Tensor:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


class ByteLM(nn.Module):
    def __init__(self, d: int = 128, layers: int = 2, heads: int = 4, ctx: int = 128) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, d)
        self.pos = nn.Embedding(ctx, d)
        layer = nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, 256, bias=False)
        self.lm_head.weight = self.tok.weight  # tied: routed to AdamW with the embedding
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.lm_head(self.norm(h))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--optimizer", default="root", choices=rootopt.optim.OPTIMIZER_NAMES)
    args = ap.parse_args()
    torch.manual_seed(0)
    data = stdlib_bytes()
    split = int(0.95 * len(data))
    train, val = data[:split], data[split:]
    model = ByteLM(ctx=args.ctx)
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
