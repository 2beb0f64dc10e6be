"""PEFT LoRA/DoRA fine-tuning with ROOT, offline: the one idiom is ``rootopt.param_groups``.

    groups, report = rootopt.param_groups(peft_model, lr=args.lr)
    opt = rootopt.ROOT(groups, lr=args.lr)

``param_groups`` leaves the frozen base weights out, puts LoRA ``A``/``B`` (and
``lora_embedding_A``/``B``, DoRA magnitudes) on AdamW at ``lr * lora_lr_multiplier``, and
routes ``modules_to_save`` copies like their originals (the ``lm_head`` copy on AdamW, a
hidden-layer copy on ROOT). Do not write ``ROOT(p for p in model.parameters() if
p.requires_grad)``: that sends the low-rank LoRA factors to ROOT's orthogonalization.

A tiny Llama (built from a ``LlamaConfig``) is first trained briefly on bytes of CPython's
standard library, then adapted with LoRA to a different slice of it::

    python examples/peft_lora.py [--dora] [--steps 40]

Needs ``pip install rootopt[integrations]``.
"""

from __future__ import annotations

import argparse
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import rootopt


def stdlib_bytes(pattern: str, limit: int) -> torch.Tensor:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob(pattern)):
        chunks.append(path.read_bytes())
        total += len(chunks[-1])
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def batches(data: torch.Tensor, ctx: int, batch: int, seed: int) -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    while True:
        i = torch.randint(0, len(data) - ctx, (batch,), generator=g)
        yield torch.stack([data[j : j + ctx] for j in i.tolist()])


def train(
    model: torch.nn.Module, opt: torch.optim.Optimizer, data: torch.Tensor, steps: int
) -> None:
    it = batches(data, 64, 16, seed=1)
    for step in range(1, steps + 1):
        x = next(it)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step == 1 or step % 10 == 0:
            print(f"  step {step:3d}  loss {loss.item():.3f}", flush=True)


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: torch.Tensor) -> float:
    """Mean loss over 8 fixed batches."""
    it = batches(data, 64, 16, seed=123)
    return sum(model(input_ids=(x := next(it)), labels=x).loss.item() for _ in range(8)) / 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--adapter-lr", type=float, default=5e-4, help="LoRA factors get 5x this")
    ap.add_argument("--dora", action="store_true", help="DoRA instead of plain LoRA")
    ap.add_argument(
        "--bare",
        action="store_true",
        help="the pitfall, for comparison: ROOT(trainable parameters) without param_groups",
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    base = LlamaForCausalLM(cfg)
    print("base model (full training, ROOT):")
    groups, _ = rootopt.param_groups(base, lr=args.lr)
    train(base, rootopt.ROOT(groups, lr=args.lr), stdlib_bytes("[a-m]*.py", 500_000), args.steps)

    lora = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        modules_to_save=["lm_head"],
        use_dora=args.dora,
    )
    model = get_peft_model(base, lora)
    lr = args.adapter_lr
    if args.bare:
        opt = rootopt.ROOT([p for p in model.parameters() if p.requires_grad], lr=lr)
        print("\nadapter fine-tuning, bare parameter list (LoRA factors on ROOT):")
    else:
        groups, report = rootopt.param_groups(model, lr=lr)  # the one idiom
        print(f"\n{'DoRA' if args.dora else 'LoRA'} routing:\n{report}\n")
        print("adapter fine-tuning (rootopt.param_groups):")
        opt = rootopt.ROOT(groups, lr=lr)
    data = stdlib_bytes("[n-z]*.py", 600_000)
    train_part, held_out = data[:500_000], data[500_000:]
    before = evaluate(model, held_out)
    train(model, opt, train_part, args.steps)
    print(f"held-out loss: {before:.3f} before, {evaluate(model, held_out):.3f} after")


if __name__ == "__main__":
    main()
