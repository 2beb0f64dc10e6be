"""Hugging Face Trainer with ROOT: a tiny GPT-2 trained from scratch on real text, offline.

The text is CPython's standard-library source read as bytes (vocabulary 256, no tokenizer
to download); the model is built from a ``GPT2Config``. The one line that matters::

    Trainer(..., optimizer_cls_and_kwargs=rootopt.hf.optimizer_cls_and_kwargs(lr=args.lr))

    python examples/hf_trainer.py                         # ROOT with rootopt's routing
    python examples/hf_trainer.py --optimizer root-bare   # optimizer_cls_and_kwargs=(ROOT, {...})
    python examples/hf_trainer.py --optimizer adamw       # the Trainer's default AdamW
    python examples/hf_trainer.py --steps 40 --resume-at 20   # checkpoint at 20, resume, compare

``root-bare`` shows what goes wrong without the factory: the Trainer builds its own
decay/no-decay groups, so the embeddings and the tied output head are orthogonalized like
hidden matrices. Needs ``pip install rootopt[integrations]``.
"""

from __future__ import annotations

import argparse
import sysconfig
import tempfile
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import rootopt


def stdlib_bytes(limit: int) -> torch.Tensor:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        chunks.append(path.read_bytes())
        total += len(chunks[-1])
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


class ByteWindows(Dataset[dict[str, torch.Tensor]]):
    """``n`` windows of ``ctx`` bytes at fixed random offsets (labels = inputs; the model
    shifts them)."""

    def __init__(self, data: torch.Tensor, ctx: int, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(data) - ctx, (n,), generator=g).tolist()
        self.data, self.ctx = data, ctx

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.data[self.starts[i] : self.starts[i] + self.ctx]
        return {"input_ids": x, "labels": x}


def tiny_gpt2(ctx: int, d: int, layers: int) -> GPT2LMHeadModel:
    cfg = GPT2Config(
        vocab_size=256,
        n_positions=ctx,
        n_embd=d,
        n_layer=layers,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)  # lm_head tied to wte (GPT-2's default)


def optimizer_arg(name: str, lr: float) -> dict[str, object]:
    """Trainer keyword arguments selecting the optimizer."""
    if name == "root":
        return {"optimizer_cls_and_kwargs": rootopt.hf.optimizer_cls_and_kwargs(lr=lr)}
    if name == "root-bare":  # the pitfall, kept to measure it
        return {"optimizer_cls_and_kwargs": (rootopt.ROOT, {"lr": lr})}
    return {}  # transformers' default AdamW at TrainingArguments.learning_rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--optimizer", default="root", choices=("root", "root-bare", "adamw"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume-at", type=int, default=0, help="also run: stop here, resume")
    ap.add_argument("--output-dir", default="", help="checkpoints (default: a temp dir)")
    args = ap.parse_args()

    data = stdlib_bytes(1_000_000)
    split = int(0.95 * len(data))
    train = ByteWindows(data[:split], args.ctx, args.steps * args.batch, args.seed)
    val = ByteWindows(data[split:], args.ctx, 256, args.seed + 1)

    def run(out: str, max_steps: int, resume: str | None = None) -> tuple[Trainer, float]:
        torch.manual_seed(args.seed)
        model = tiny_gpt2(args.ctx, args.d_model, args.layers)
        targs = TrainingArguments(
            output_dir=out,
            max_steps=max_steps,
            per_device_train_batch_size=args.batch,
            per_device_eval_batch_size=64,
            learning_rate=args.lr,
            lr_scheduler_type="linear",
            warmup_steps=max(1, max_steps // 10),
            logging_steps=5,
            save_strategy="steps" if args.resume_at else "no",
            save_steps=args.resume_at or 500,
            report_to=[],
            use_cpu=True,
            seed=args.seed,
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=model,
            args=targs,
            train_dataset=train,
            eval_dataset=val,
            **optimizer_arg(args.optimizer, args.lr),  # type: ignore[arg-type]
        )
        result = trainer.train(resume_from_checkpoint=resume)
        return trainer, float(result.training_loss)

    with tempfile.TemporaryDirectory() as tmp:
        out = args.output_dir or tmp
        trainer, _ = run(out, args.steps)
        logs = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        ev = trainer.evaluate()["eval_loss"]
        print(f"optimizer={args.optimizer} steps={args.steps} lr={args.lr:g}")
        print(f"train loss every 5 steps: {' '.join(f'{x:.3f}' for x in logs)}")
        print(f"final train loss (last 5 steps) {logs[-1]:.3f}  eval loss {ev:.3f}")
        if args.resume_at:
            assert trainer.model is not None
            full = {k: v.clone() for k, v in trainer.model.state_dict().items()}
            ckpt = str(Path(out) / f"checkpoint-{args.resume_at}")
            resumed, _ = run(out, args.steps, resume=ckpt)
            assert resumed.model is not None
            diff = max(
                (full[k] - v).abs().max().item() for k, v in resumed.model.state_dict().items()
            )
            print(f"resumed from {Path(ckpt).name}: max |param difference| = {diff:.3g}")


if __name__ == "__main__":
    main()
