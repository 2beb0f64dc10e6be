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
    groups, _ = param_groups(model, ns_steps=7, lora_lr_multiplier=2.0, head_names=("nothing",))
    assert all(g["ns_steps"] == 7 for g in groups)
    head = next(g for g in groups if "lm_head.weight" in g["param_names"])
    assert head["algorithm"] == "root"  # no longer recognised as a head


def test_unmatched_parameter_is_an_error() -> None:
    with pytest.raises(ValueError, match="no routing rule matches parameter experts"):
        param_groups(Model(tied=False), rules=[Rule("none", lambda i: False, "root")])
