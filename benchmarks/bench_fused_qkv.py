"""Fused-QKV measurement (docs/integrations.md, "Fused projections"): a tiny GPT-2
(Conv1D ``c_attn``) on byte-level text from docs/ and src/, ROOT with and without
``ns_split``.

Usage: ``python benchmarks/bench_fused_qkv.py split|no SEED STEPS`` (one JSON line).
"""

from __future__ import annotations

import glob
import json
import sys
import time
from pathlib import Path

import torch
import transformers

import rootopt
from rootopt.optim.root import fused_splits


def main() -> None:
    split, seed, steps = sys.argv[1] == "split", int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    files = sorted(glob.glob("docs/*.md")) + sorted(
        glob.glob("src/rootopt/**/*.py", recursive=True)
    )
    text = b"".join(Path(f).read_bytes() for f in files)
    data = torch.tensor(list(text), dtype=torch.long)
    n = int(0.9 * len(data))
    train, val = data[:n], data[n:]
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        vocab_size=256,
        n_positions=64,
        n_embd=96,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(cfg)
    groups, report = rootopt.param_groups(model, lr=0.02, weight_decay=0.01)
    if split:
        groups = fused_splits(groups, report)
    opt = rootopt.ROOT(groups)
    g = torch.Generator().manual_seed(1000 + seed)

    def batch(src: torch.Tensor, bs: int = 16, T: int = 64) -> torch.Tensor:
        ix = torch.randint(0, len(src) - T - 1, (bs,), generator=g)
        return torch.stack([src[i : i + T] for i in ix])

    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / steps)
    )
    t = time.time()
    loss = torch.zeros(())
    for _ in range(steps):
        x = batch(train)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    model.eval()
    vg = torch.Generator().manual_seed(7)
    losses = []
    with torch.no_grad():
        for _ in range(20):
            ix = torch.randint(0, len(val) - 65, (16,), generator=vg)
            x = torch.stack([val[i : i + 64] for i in ix])
            losses.append(model(input_ids=x, labels=x).loss.item())
    print(
        json.dumps(
            {
                "split": split,
                "seed": seed,
                "steps": steps,
                "train_loss": loss.item(),
                "val_loss": sum(losses) / len(losses),
                "s": time.time() - t,
            }
        )
    )


if __name__ == "__main__":
    main()
