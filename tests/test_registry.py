"""The optimizer registry: every entry builds and trains; config, factory and CLI read it."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from rootopt.config import OPTIMIZERS, ConfigError, load_config
from rootopt.optim import OPTIMIZER_NAMES, make_optimizer
from rootopt.optim.registry import REGISTRY, SGLD, OptimizerChain, get, help_text
from rootopt.train.build import build_optimizer

EXPECTED = {
    "sgd", "momentum", "adagrad", "adam", "adamw", "lamb", "adafactor", "shampoo", "muon",
    "sgld", "root", "root-no-suppression", "root-official", "root-muon-coeffs", "root-svd",
    "root-robust-scaling",
}  # fmt: skip


class Mixed(nn.Module):
    """Embedding, conv kernel (4-D), matrices, vectors and a head: every routing case."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(8 + 4 * 4 * 4, 16)
        self.head = nn.Linear(16, 11)

    def forward(self, tok: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.embed(tok), torch.relu(self.conv(img)).flatten(1)], dim=1)
        return self.head(torch.tanh(self.fc(h)))


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randint(0, 11, (32,), generator=g),
        torch.randn(32, 1, 4, 4, generator=g),
        torch.randint(0, 11, (32,), generator=g),
    )


def test_registry_holds_the_issue_names_and_every_reader_uses_it() -> None:
    assert set(REGISTRY) == EXPECTED
    assert tuple(REGISTRY) == OPTIMIZERS == OPTIMIZER_NAMES
    text = help_text()
    assert all(name in text for name in EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_optimizer_trains_a_mixed_model(name: str) -> None:
    torch.manual_seed(0)
    model = Mixed()
    tok, img, y = _data()
    spec = get(name)
    opt, _ = make_optimizer(name, model, lr=spec.lr / 3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    before = [p.detach().clone() for p in model.parameters()]
    losses = []
    for _ in range(25):
        loss = nn.functional.cross_entropy(model(tok, img), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0], (name, losses[0], losses[-1])
    changed = [not torch.equal(a, b) for a, b in zip(before, model.parameters())]
    assert len(changed) == 7 and all(changed), (name, changed)


def test_unknown_name_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match=r"Invalid optimizer: 'adamx' \(choose one of root, adamw"):
        make_optimizer("adamx", Mixed(), lr=1e-3)
    with pytest.raises(ConfigError, match="optimization.optimizer: expected one of root, adamw"):
        load_config(None, ["optimization.optimizer=adamx"])


def test_config_accepts_every_registered_name_case_insensitively() -> None:
    for name in REGISTRY:
        assert load_config(None, [f"optimization.optimizer={name.upper()}"])


def test_ablation_fixed_options_win_over_config() -> None:
    cfg = load_config(
        None, ["optimization.optimizer=root-svd", "optimization.ortho_method=newton_schulz"]
    )
    opt, _ = build_optimizer(cfg, Mixed())
    root_groups = [g for g in opt.param_groups if g.get("algorithm") == "root"]
    assert root_groups and all(g["ortho_method"] == "svd" for g in root_groups)
    cfg = load_config(None, ["optimization.optimizer=root-no-suppression"])
    opt, _ = build_optimizer(cfg, Mixed())
    assert all(g["outlier_quantile"] is None for g in opt.param_groups)
    cfg = load_config(None, ["optimization.optimizer=momentum", "optimization.momentum=0.8"])
    opt, _ = build_optimizer(cfg, Mixed())
    assert isinstance(opt, torch.optim.SGD)
    assert opt.param_groups[0]["momentum"] == 0.8 and opt.param_groups[0]["nesterov"]


def test_distributed_root_synchronises_gradients_under_ddp_not_fsdp() -> None:
    """At world size > 1 ROOT and Muon are DistributedROOT; under ``parallel: ddp`` it
    synchronises the gradients itself (no DDP wrapper, ``average_grads``), under fsdp FSDP2
    does (built here without a process group, where the step is the plain one)."""
    from rootopt.distributed import DistributedROOT
    from rootopt.train.build import optimizer_syncs_grads

    for parallel, synced in (("ddp", True), ("fsdp", False)):
        for name in ("ROOT", "Muon"):
            cfg = load_config(
                None, [f"distributed.parallel={parallel}", f"optimization.optimizer={name}"]
            )
            opt, _ = build_optimizer(cfg, Mixed(), world_size=2)
            assert isinstance(opt, DistributedROOT) and opt.average_grads is synced
            assert optimizer_syncs_grads(cfg, 2) is synced
            assert not optimizer_syncs_grads(cfg, 1)
    adamw = load_config(None, ["optimization.optimizer=AdamW"])
    assert not optimizer_syncs_grads(adamw, 2)  # other optimizers keep DDP


def test_removed_distributed_keys_say_what_replaced_them() -> None:
    """``distributed.ddp_design`` and ``distributed.fsdp_design`` were removed: a config (or
    an override) naming one gets one line saying what replaced it, whatever the value."""
    for key, why in (
        ("distributed.ddp_design", "ROOT and Muon use the owner design"),
        ("distributed.fsdp_design", "orthogonalized whole on its owner"),
    ):
        for value in ("owner", "gather", "whole", "gram", "nonsense"):
            with pytest.raises(ConfigError) as err:
                load_config(None, [f"{key}={value}"])
            assert err.value.problems == [f"{key}: {err.value.problems[0].split(': ', 1)[1]}"]
            line = err.value.problems[0]
            assert line.startswith(f"{key}: removed;") and why in line, line


def test_muon_routes_like_root_and_schedules_reach_children() -> None:
    model = Mixed()
    opt, report = make_optimizer("muon", model, lr=1e-2)
    assert isinstance(opt, OptimizerChain) and report is not None
    kinds = [type(c).__name__ for c in opt.children]
    assert kinds == ["Muon", "ROOT", "AdamW"]
    muon_params = {id(p) for g in opt.children[0].param_groups for p in g["params"]}
    nd_params = {id(p) for g in opt.children[1].param_groups for p in g["params"]}
    adamw_params = {id(p) for g in opt.children[2].param_groups for p in g["params"]}
    assert muon_params == {id(model.fc.weight)}
    assert nd_params == {id(model.conv.weight)}
    assert id(model.embed.weight) in adamw_params and id(model.head.weight) in adamw_params
    assert id(model.fc.bias) in adamw_params
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    assert sched is not None
    assert all(g["lr"] == pytest.approx(5e-3) for c in opt.children for g in c.param_groups)


def test_muon_chain_state_dict_round_trip_continues_identically() -> None:
    tok, img, y = _data()

    def step(m: Mixed, o: torch.optim.Optimizer) -> None:
        loss = nn.functional.cross_entropy(m(tok, img), y)
        o.zero_grad()
        loss.backward()
        o.step()

    torch.manual_seed(0)
    a = Mixed()
    oa, _ = make_optimizer("muon", a, lr=1e-2)
    for _ in range(3):
        step(a, oa)
    b = Mixed()
    b.load_state_dict(a.state_dict())
    ob, _ = make_optimizer("muon", b, lr=1e-2)
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))  # as if saved to disk
    step(a, oa)
    step(b, ob)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
    with pytest.raises(ValueError, match="child optimizers"):
        ob.load_state_dict({"children": []})


def test_sgld_without_temperature_is_sgd_and_noise_has_the_langevin_variance() -> None:
    torch.manual_seed(0)
    p1 = nn.Parameter(torch.randn(50, 40))
    p2 = nn.Parameter(p1.detach().clone())
    g = torch.randn(50, 40)
    p1.grad, p2.grad = g.clone(), g.clone()
    SGLD([p1], lr=0.1, temperature=0.0, weight_decay=0.01).step()
    torch.optim.SGD([p2], lr=0.1, weight_decay=0.01).step()
    torch.testing.assert_close(p1, p2, rtol=0, atol=0)
    # Zero gradient: the update is pure noise with std sqrt(2·lr·T).
    p = nn.Parameter(torch.zeros(400, 500))
    p.grad = torch.zeros_like(p)
    SGLD([p], lr=0.05, temperature=0.01).step()
    assert p.detach().std().item() == pytest.approx(math.sqrt(2 * 0.05 * 0.01), rel=0.02)
    with pytest.raises(ValueError, match="temperature"):
        SGLD([p], lr=0.1, temperature=-1.0)
