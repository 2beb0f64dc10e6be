"""PEFT (LoRA, DoRA, modules_to_save) with ROOT: routing of the real wrappers and a few
training steps on a tiny Llama built from a config."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from rootopt import ROOT, param_groups  # noqa: E402
from rootopt.hf import ROOTFactory  # noqa: E402

VOCAB = 96


def peft_llama(use_dora: bool) -> Any:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    base = transformers.LlamaForCausalLM(cfg)
    lora = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "embed_tokens"],
        modules_to_save=["lm_head", "down_proj"],
        use_dora=use_dora,
    )
    return peft.get_peft_model(base, lora)


@pytest.mark.parametrize("use_dora", [False, True])
def test_peft_routing(use_dora: bool) -> None:
    model = peft_llama(use_dora)
    groups, report = param_groups(model, lr=1e-3, lora_lr_multiplier=4.0)
    r = report.by_name()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(r) == trainable  # frozen base weights left out by default
    assert {n for n, _ in report.frozen} == {
        n for n, p in model.named_parameters() if not p.requires_grad
    }
    assert sum(report.counts().values()) == sum(
        p.numel() for p in model.parameters() if p.requires_grad
    )
    lora = [n for n in r if ".lora_A." in n or ".lora_B." in n or ".lora_embedding_" in n]
    assert len(lora) == 2 * 2 * 2 + 2  # q, v in 2 layers (A, B) + the embedding's A, B
    for n in lora:
        assert (r[n].algorithm, r[n].rule, r[n].lr_mult) == ("adamw", "lora", 4.0), n
    mags = [n for n in r if "lora_magnitude_vector" in n]
    assert len(mags) == (5 if use_dora else 0)  # q, v in 2 layers + the embedding
    for n in mags:
        assert (r[n].algorithm, r[n].rule, r[n].lr_mult) == ("adamw", "dora_magnitude", 4.0)
    head = r["base_model.model.lm_head.modules_to_save.default.weight"]
    assert (head.algorithm, head.rule, head.head) == ("adamw", "output_head", "output embeddings")
    copies = [n for n in r if n.endswith("down_proj.modules_to_save.default.weight")]
    assert len(copies) == 2 and all(r[n].algorithm == "root" for n in copies)  # like originals
    assert [n for g in groups if g["algorithm"] == "root" for n in g["param_names"]] == copies
    lr_of = {n: g["lr"] for g in groups for n in g["param_names"]}
    assert lr_of[lora[0]] == pytest.approx(4e-3) and lr_of[copies[0]] == pytest.approx(1e-3)
    assert "left out (include_frozen=True keeps them)" in str(report)

    # include_frozen keeps them, still routed by structure; shares count trained elements
    _, kept = param_groups(model, include_frozen=True)
    k = kept.by_name()
    assert len(k) == len(list(model.parameters()))
    assert k["base_model.model.lm_head.original_module.weight"].rule == "output_head"
    assert kept.counts() == report.counts()


def test_peft_training_with_root_and_via_trainer_factory() -> None:
    model = peft_llama(use_dora=True)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    groups, _ = param_groups(model, lr=2e-3)
    opt = ROOT(groups, lr=2e-3)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (4, 24), generator=g)
    losses = []
    for _ in range(8):
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n  # base weights untouched

    # what the Trainer's factory builds for a PEFT model: the same groups
    built = ROOTFactory()(model, lr=2e-3)
    assert [sorted(g["param_names"]) for g in built.param_groups] == [
        sorted(g["param_names"]) for g in groups
    ]
