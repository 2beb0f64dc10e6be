"""Hugging Face transformers: routing of real model classes, and ROOT inside ``Trainer``.

Tiny models built from configs (no downloads), a few steps each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import rootopt  # noqa: E402
from rootopt import ROOT, param_groups  # noqa: E402
from rootopt.hf import ROOTFactory, optimizer_cls_and_kwargs  # noqa: E402
from rootopt.optim.root import algorithm_of  # noqa: E402

CTX = 32


def gpt2(tied: bool = True) -> Any:
    cfg = transformers.GPT2Config(
        vocab_size=96,
        n_positions=CTX,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=tied,
    )
    return transformers.GPT2LMHeadModel(cfg)


def test_gpt2_routing_tied_and_untied() -> None:
    model = gpt2(tied=True)
    groups, report = param_groups(model, lr_scale="muon")
    r = report.by_name()
    for n in ("transformer.wte.weight", "transformer.wpe.weight"):
        assert (r[n].algorithm, r[n].rule) == ("adamw", "embedding")
    assert "lm_head.weight" not in r  # the tied head is the embedding tensor, routed once
    qkv = r["transformer.h.0.attn.c_attn.weight"]  # Conv1D, stored (in=64, out=192)
    assert (qkv.algorithm, qkv.transposed, qkv.layout) == ("root", True, "in,out")
    assert (qkv.fused, qkv.split) == ("qkv", (64, 64, 64))
    # Muon's factor sqrt(max(1, fan_out / fan_in)) with fan_out = dim 1 for Conv1D
    assert qkv.lr_scale == pytest.approx(3**0.5)
    assert r["transformer.h.0.mlp.c_proj.weight"].lr_scale == pytest.approx(1.0)  # 256 -> 64
    assert r["transformer.h.0.mlp.c_fc.weight"].lr_scale == pytest.approx(2.0)  # 64 -> 256
    for n, route in r.items():
        if route.algorithm == "root":
            assert route.transposed and n.endswith("weight"), n
    flagged = [n for g in groups if g.get("transposed") for n in g["param_names"]]
    assert sorted(flagged) == sorted(n for n, x in r.items() if x.algorithm == "root")
    assert all(g["algorithm"] == "root" for g in groups if g.get("transposed"))
    assert "stored (in,out)" in str(report) and "fused qkv [64+64+64]" in str(report)
    # today's ROOT accepts the flag (and steps); the optimizer-side use of it is separate
    opt = ROOT(groups)
    model(torch.randint(0, 96, (2, CTX)), labels=torch.randint(0, 96, (2, CTX))).loss.backward()
    opt.step()

    r = param_groups(gpt2(tied=False))[1].by_name()
    head = r["lm_head.weight"]
    assert (head.algorithm, head.rule, head.head) == ("adamw", "output_head", "output embeddings")


def test_llama_and_classifier_heads() -> None:
    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=3,
        pad_token_id=0,
    )
    r = param_groups(transformers.LlamaForCausalLM(cfg))[1].by_name()
    assert r["lm_head.weight"].algorithm == "adamw" and r["lm_head.weight"].head
    assert r["model.embed_tokens.weight"].rule == "embedding"
    assert r["model.layers.0.self_attn.k_proj.weight"].algorithm == "root"
    assert not any(x.transposed for x in r.values())
    r = param_groups(transformers.LlamaForSequenceClassification(cfg))[1].by_name()
    assert (r["score.weight"].algorithm, r["score.weight"].head) == ("adamw", "last layer")
    assert r["model.layers.0.mlp.down_proj.weight"].algorithm == "root"


def test_factory_arguments_checked_early_and_old_trainers_refused() -> None:
    with pytest.raises(ValueError, match="Invalid momentum: 1.5"):
        optimizer_cls_and_kwargs(lr=1e-3, momentum=1.5)
    cls, kwargs = optimizer_cls_and_kwargs(lr=2e-3, ns_steps=6, lora_lr_multiplier=3.0)
    assert cls is ROOTFactory and kwargs["ns_steps"] == 6
    opt = cls()(gpt2(), **kwargs)
    assert isinstance(opt, ROOT) and opt.defaults["ns_steps"] == 6
    # a Trainer without factory support would call cls(its_groups, lr=...)
    with pytest.raises(TypeError, match=r"optimizer factories need transformers>=5\.5"):
        ROOTFactory([{"params": list(gpt2().parameters())}], **kwargs)


class Windows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Fixed windows of a repetitive byte stream (learnable in a few steps)."""

    def __init__(self, n: int) -> None:
        text = b"def f(x):\n    return x * 2 + 1\n\nclass A:\n    pass\n" * 200
        data = torch.tensor(list(text)) % 96
        g = torch.Generator().manual_seed(0)
        self.starts = torch.randint(0, len(data) - CTX, (n,), generator=g).tolist()
        self.data = data

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.data[self.starts[i] : self.starts[i] + CTX]
        return {"input_ids": x, "labels": x}


def make_trainer(out: Path, steps: int, opt_arg: dict[str, Any], save_steps: int = 0) -> Any:
    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        warmup_steps=2,
        logging_steps=1,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    return transformers.Trainer(
        model=gpt2(), args=args, train_dataset=Windows(steps * 8), **opt_arg
    )


def test_trainer_one_liner_routes_and_trains(tmp_path: Path) -> None:
    steps = 10
    opt_arg = {"optimizer_cls_and_kwargs": rootopt.hf.optimizer_cls_and_kwargs(lr=3e-3)}
    trainer = make_trainer(tmp_path / "a", steps, opt_arg)
    trainer.train()
    opt = trainer.optimizer
    opt = getattr(opt, "optimizer", opt)  # the Trainer may wrap it (accelerate)
    assert isinstance(opt, ROOT)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    root = {names[id(p)] for g in opt.param_groups if g["algorithm"] == "root" for p in g["params"]}
    adamw = {
        names[id(p)] for g in opt.param_groups if g["algorithm"] == "adamw" for p in g["params"]
    }
    assert {"transformer.wte.weight", "transformer.wpe.weight"} <= adamw
    assert root and all(n.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")) for n in root)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == steps and losses[-1] < 0.8 * losses[0]

    # the same tuple works for a second Trainer (nothing in it is consumed)
    again = make_trainer(tmp_path / "b", 1, opt_arg)
    again.create_optimizer()
    assert isinstance(again.optimizer, ROOT) and len(again.optimizer.param_groups) == len(
        opt.param_groups
    )

    # the pitfall the one-liner avoids: a bare class gets the Trainer's own groups
    bare = make_trainer(tmp_path / "c", steps, {"optimizer_cls_and_kwargs": (ROOT, {"lr": 3e-3})})
    bare.train()
    names = {id(p): n for n, p in bare.model.named_parameters()}
    root_bare = {
        names[id(p)]
        for g in bare.optimizer.param_groups
        for p in g["params"]
        if algorithm_of(g, p) == "root"
    }
    assert "transformer.wte.weight" in root_bare and "transformer.wpe.weight" in root_bare
    bare_losses = [h["loss"] for h in bare.state.log_history if "loss" in h]
    assert losses[-1] < bare_losses[-1]


def test_trainer_resume_from_checkpoint_is_exact(tmp_path: Path) -> None:
    opt_arg = {"optimizer_cls_and_kwargs": rootopt.hf.optimizer_cls_and_kwargs(lr=3e-3)}
    full = make_trainer(tmp_path, 6, opt_arg, save_steps=3)
    full.train()
    ckpt = tmp_path / "checkpoint-3"
    assert (ckpt / "optimizer.pt").is_file() and (ckpt / "scheduler.pt").is_file()
    resumed = make_trainer(tmp_path, 6, opt_arg, save_steps=3)
    resumed.train(resume_from_checkpoint=str(ckpt))
    a, b = full.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sa, sb = full.optimizer.state_dict(), resumed.optimizer.state_dict()
    assert len(sa["state"]) == len(sb["state"]) > 0
    for pid, st in sa["state"].items():
        for key, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(sb["state"][pid][key])), key


def test_import_rootopt_and_hf_do_not_import_transformers() -> None:
    import subprocess
    import sys

    code = (
        "import sys, rootopt; assert 'rootopt.hf' not in sys.modules; "
        "rootopt.hf.optimizer_cls_and_kwargs(lr=1e-3); "
        "print(sorted(m for m in ('transformers', 'lightning', 'peft') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"


def test_prebuilt_optimizer_path(tmp_path: Path) -> None:
    """The documented alternative for transformers without factories."""
    model = gpt2()
    opt = rootopt.hf.create_optimizer(model, lr=1e-3, weight_decay=0.0, ns_steps=6)
    routed = {n for g in opt.param_groups if g["algorithm"] == "adamw" for n in g["param_names"]}
    assert {"transformer.wte.weight", "transformer.wpe.weight"} <= routed
    assert all(g["weight_decay"] == 0.0 for g in opt.param_groups)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = transformers.Trainer(model=model, args=args, optimizers=(opt, None))
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    assert trainer.optimizer is opt and trainer.lr_scheduler is not None
