from __future__ import annotations

import pytest
import torch
from torch import nn

from rootopt import ROOT, param_groups
from rootopt.optim import Rule


class LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, r: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.lora_A = nn.Linear(d_in, r, bias=False)
        self.lora_B = nn.Linear(r, d_out, bias=False)


class Model(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.tok = nn.Embedding(50, 16)
        self.attn = LoRALinear(16, 16)
        self.experts = nn.Parameter(torch.randn(4, 16, 32))
        self.conv = nn.Conv2d(3, 8, 3)
        self.conv1d = nn.Conv1d(16, 16, 3)
        self.norm = nn.RMSNorm(16)
        self.scale = nn.Parameter(torch.tensor(1.0))
        self.lm_head = nn.Linear(16, 50, bias=False)
        if tied:
            self.lm_head.weight = self.tok.weight


@pytest.mark.parametrize("tied", [True, False])
def test_default_routing(tied: bool) -> None:
    model = Model(tied)
    groups, report = param_groups(model, lr=1e-3, weight_decay=0.05)
    by_name = {r.name: r for r in report.routes}
    assert by_name["tok.weight"].algorithm == "adamw" and by_name["tok.weight"].rule == "embedding"
    if tied:
        assert "lm_head.weight" not in by_name  # one tensor, routed once
    else:
        assert by_name["lm_head.weight"].rule == "output_head"
    assert by_name["attn.base.weight"].algorithm == "root"
    assert by_name["attn.lora_A.weight"].rule == "lora"
    assert by_name["attn.lora_B.weight"].lr_mult == 5.0
    assert by_name["experts"].algorithm == "root" and by_name["experts"].matrix == "4x(16x32)"
    assert by_name["conv.weight"].matrix == "8x27"  # flattened (out, in*kh*kw)
    assert by_name["conv1d.weight"].matrix == "16x48"  # conv 3-D: flattened, not a stack
    for n in ("attn.base.bias", "norm.weight", "scale", "conv.bias"):
        assert by_name[n].algorithm == "adamw" and by_name[n].rule == "non_matrix"
    assert by_name["attn.base.weight"].lr_scale == pytest.approx(0.2 * 4)

    # every parameter is in exactly one group, with the right lr
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    assert len(ids) == len(set(ids))
    lora = next(g for g in groups if "attn.lora_A.weight" in g["param_names"])
    assert lora["lr"] == pytest.approx(5e-3) and lora["algorithm"] == "adamw"
    assert all(g["weight_decay"] == 0.05 for g in groups)

    text = str(report)
    assert "attn.lora_B.weight" in text and "elements by algorithm" in text
    opt = ROOT(groups)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()


def test_custom_rules_and_options() -> None:
    model = Model(tied=False)
    rules = [Rule("everything_adamw", lambda i: True, "adamw")]
    groups, report = param_groups(model, rules=rules)
    assert {r.algorithm for r in report.routes} == {"adamw"}
    groups, _ = param_groups(
        model, ns_steps=7, lora_lr_multiplier=2.0, head_names=("nothing",), detect_heads=False
    )
    assert all(g["ns_steps"] == 7 for g in groups)
    head = next(g for g in groups if "lm_head.weight" in g["param_names"])
    assert head["algorithm"] == "root"  # neither by name nor by structure
    # by structure alone (it projects to the vocabulary and is the last layer)
    _, report = param_groups(model, head_names=("nothing",))
    assert report.by_name()["lm_head.weight"].algorithm == "adamw"


def test_unmatched_parameter_is_an_error() -> None:
    with pytest.raises(ValueError, match="no routing rule matches parameter experts"):
        param_groups(Model(tied=False), rules=[Rule("none", lambda i: False, "root")])


def test_frozen_parameters_left_out_by_default() -> None:
    model = Model(tied=False)
    for p in (*model.tok.parameters(), *model.attn.base.parameters()):
        p.requires_grad_(False)
    groups, report = param_groups(model)
    in_groups = {n for g in groups for n in g["param_names"]}
    assert in_groups.isdisjoint({"tok.weight", "attn.base.weight", "attn.base.bias"})
    assert [n for n, _ in report.frozen] == ["tok.weight", "attn.base.weight", "attn.base.bias"]
    assert sum(k for _, k in report.frozen) == 50 * 16 + 16 * 16 + 16
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(report.counts().values()) == trainable
    assert "3 frozen tensors (1,072 elements) left out" in str(report)

    groups, report = param_groups(model, include_frozen=True)
    ids = sorted(id(p) for g in groups for p in g["params"])
    assert ids == sorted(id(p) for p in model.parameters())
    base = report.by_name()["attn.base.weight"]
    assert base.algorithm == "root" and not base.trainable and "frozen" in base.notes()
    assert sum(report.counts().values()) == trainable  # shares count trained elements only

    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match=r"no trainable parameters \(13 frozen; pass include"):
        param_groups(model)


def test_package_mlp_classifier_head_found_by_structure() -> None:
    from rootopt.train.models import MLPClassifier

    model = MLPClassifier(20, 32, 4)
    groups, report = param_groups(model)
    r = report.by_name()
    assert r["net.4.weight"].algorithm == "adamw" and r["net.4.weight"].rule == "output_head"
    assert r["net.4.weight"].head == "last layer"
    assert r["net.0.weight"].algorithm == r["net.2.weight"].algorithm == "root"
    assert [n for g in groups if g["algorithm"] == "root" for n in g["param_names"]] == [
        "net.0.weight",
        "net.2.weight",
    ]


class OutLast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.hidden = nn.Linear(32, 32)
        self.out = nn.Linear(32, 3)


class OutFirst(nn.Module):
    """The head is registered before the body and is not the last layer."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(32, 3)
        self.inp = nn.Linear(8, 32)
        self.hidden = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)


def test_head_called_out() -> None:
    r = param_groups(OutLast())[1].by_name()
    assert (r["out.weight"].algorithm, r["out.weight"].head) == ("adamw", "last layer")
    assert r["hidden.weight"].algorithm == "root" and r["inp.weight"].algorithm == "root"
    r = param_groups(OutFirst())[1].by_name()
    assert (r["out.weight"].algorithm, r["out.weight"].head) == ("adamw", "name 'out'")
    assert r["hidden.weight"].algorithm == "root"  # the last Linear is not a head here


class VocabFirst(nn.Module):
    """Untied output projection registered first, under an unrecognised name."""

    def __init__(self) -> None:
        super().__init__()
        self.to_logits = nn.Linear(16, 40, bias=False)
        self.tok = nn.Embedding(40, 16)
        self.pos = nn.Embedding(16, 16)  # positions: a table, not the vocabulary
        self.mix = nn.Linear(16, 16)  # projects to 16 = the position table's size
        self.norm = nn.LayerNorm(16)


def test_output_layer_found_by_vocabulary_size() -> None:
    r = param_groups(VocabFirst())[1].by_name()
    assert r["to_logits.weight"].algorithm == "adamw"
    assert r["to_logits.weight"].head == "projects to vocabulary (40)"
    assert r["mix.weight"].algorithm == "root"
    r = param_groups(VocabFirst(), detect_heads=False)[1].by_name()
    assert r["to_logits.weight"].algorithm == "root"


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 4, batch_first=True)
        self.norm = nn.LayerNorm(16)


def test_fused_qkv_reported() -> None:
    groups, report = param_groups(Attn())
    r = report.by_name()
    qkv = r["mha.in_proj_weight"]
    assert (qkv.algorithm, qkv.fused, qkv.split, qkv.matrix) == (
        "root",
        "qkv",
        (16, 16, 16),
        "48x16",
    )
    assert r["mha.out_proj.weight"].fused == "" and r["mha.out_proj.weight"].algorithm == "root"
    assert "fused qkv [16+16+16]" in str(report)
    assert report.as_dict()[0]["layout"] == "out,in"
    assert not any("transposed" in g for g in groups)  # only Conv1D weights get the flag


class PeftLike(nn.Module):
    """PEFT's parameter naming without PEFT: embedding LoRA, DoRA magnitude, a
    modules_to_save copy of the head (the real library is tested in
    tests/test_integrations_peft.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Module()
        self.emb.base_layer = nn.Embedding(30, 8)
        self.emb.lora_embedding_A = nn.ParameterDict({"default": nn.Parameter(torch.zeros(2, 30))})
        self.emb.lora_embedding_B = nn.ParameterDict({"default": nn.Parameter(torch.zeros(8, 2))})
        self.proj = nn.Linear(8, 8)
        self.proj.lora_magnitude_vector = nn.ModuleDict({"default": nn.Linear(1, 8, bias=False)})
        self.lm_head = nn.Module()
        self.lm_head.original_module = nn.Linear(8, 30, bias=False)
        self.lm_head.modules_to_save = nn.ModuleDict({"default": nn.Linear(8, 30, bias=False)})
        self.lm_head.original_module.requires_grad_(False)


def test_peft_naming_routes() -> None:
    groups, report = param_groups(PeftLike(), lr=1e-3, lora_lr_multiplier=4.0)
    r = report.by_name()
    for n in ("emb.lora_embedding_A.default", "emb.lora_embedding_B.default"):
        assert (r[n].algorithm, r[n].rule, r[n].lr_mult) == ("adamw", "lora", 4.0)
    mag = r["proj.lora_magnitude_vector.default.weight"]
    assert (mag.algorithm, mag.rule, mag.lr_mult) == ("adamw", "dora_magnitude", 4.0)
    copy = r["lm_head.modules_to_save.default.weight"]
    assert (copy.algorithm, copy.rule) == ("adamw", "output_head")
    assert "lm_head.original_module.weight" not in r
    assert [n for n, _ in report.frozen] == ["lm_head.original_module.weight"]
    assert r["proj.weight"].algorithm == "root"
    lora = next(g for g in groups if "emb.lora_embedding_A.default" in g["param_names"])
    assert lora["lr"] == pytest.approx(4e-3)


def test_interleaved_fused_qkv_is_described_and_never_split_by_blocks() -> None:
    """GPT-NeoX's ``query_key_value`` holds each head's q, k, v rows in turn
    (``view(..., heads, 3 * head_size)`` in its attention): three blocks of 64 rows would mix
    heads, so the report describes the layout and gives no split that ``fused_splits`` would
    apply. Falcon's new decoder architecture groups each key/value head's queries with it;
    Falcon's multi-query layout is three blocks and keeps its split."""
    transformers = pytest.importorskip("transformers")
    from rootopt.optim.root import fused_splits

    neox = transformers.GPTNeoXForCausalLM(
        transformers.GPTNeoXConfig(
            hidden_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=128,
        )
    )
    groups, report = param_groups(neox)
    qkv = report.by_name()["gpt_neox.layers.0.attention.query_key_value.weight"]
    assert (qkv.fused, qkv.split) == ("qkv", ())
    assert "fused qkv, interleaved per head: 4×[16+16+16] (q, k, v)" in str(report)
    assert not any("ns_split" in g for g in fused_splits(groups, report))

    def falcon(**kw: object) -> object:
        cfg = transformers.FalconConfig(
            hidden_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=128, **kw
        )
        _, rep = param_groups(transformers.FalconForCausalLM(cfg))
        return rep.by_name()["transformer.h.0.self_attention.query_key_value.weight"]

    grouped = falcon(new_decoder_architecture=True, num_kv_heads=2)
    assert grouped.split == () and grouped.notes() == (
        "fused qkv, grouped per key/value head: 2×[32+16+16] (its queries, k, v)"
    )
    mqa = falcon(multi_query=True)
    assert mqa.split == (64, 16, 16) and mqa.notes() == "fused qkv [64+16+16]"
