"""ROOT against torch.optim's optimizer contract (our own versions of the invariants that
PyTorch checks for its optimizers): copies, pickling, whole-object save, dtypes, load
hooks, add_param_group, tensor lr, group identity, old state-dict layout, Conv1D layout,
LoRA warning. docs/integrations.md, "The torch.optim contract"."""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from rootopt import ROOT
from rootopt.optim.root import algorithm_of

# ROOT's main option sets (small shapes: each test runs in well under a second per set).
OPTION_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "reference": {"batched": False},
    "official_nesterov_off": {"ns_coefficients": "official", "nesterov": False},
    "svd_no_clip": {"ortho_method": "svd", "outlier_quantile": None},
    "robust": {"robust_scaling": True, "robust_window": 10},
    "muon_scale_bf16_ns": {"lr_scale": "muon", "ns_dtype": "bfloat16"},
}


def model(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def feed(m: nn.Module, seed: int) -> None:
    """Deterministic gradients (the same for two copies of a model)."""
    g = torch.Generator().manual_seed(seed)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def run(m: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for s in steps:
        feed(m, s)
        opt.step()


def assert_same(a: nn.Module, b: nn.Module) -> None:
    pa, pb = list(a.parameters()), list(b.parameters())
    assert len(pa) == len(pb)
    for x, y in zip(pa, pb):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------
# copies of the whole object
# ------------------------------------------------------------------------------------------
def _deepcopy(m: nn.Module, opt: ROOT) -> tuple[nn.Module, ROOT]:
    m2, o2 = copy.deepcopy((m, opt))
    return m2, o2


def _pickle(m: nn.Module, opt: ROOT) -> tuple[nn.Module, ROOT]:
    m2, o2 = pickle.loads(pickle.dumps((m, opt)))
    return m2, o2


def _torch_save(m: nn.Module, opt: ROOT) -> tuple[nn.Module, ROOT]:
    buf = io.BytesIO()
    torch.save((m, opt), buf)
    buf.seek(0)
    m2, o2 = torch.load(buf, weights_only=False)
    return m2, o2


COPIES: dict[str, Callable[[nn.Module, ROOT], tuple[nn.Module, ROOT]]] = {
    "deepcopy": _deepcopy,
    "pickle": _pickle,
    "torch_save": _torch_save,
}


@pytest.mark.parametrize("how", sorted(COPIES))
@pytest.mark.parametrize("options", sorted(OPTION_SETS))
def test_copy_gives_a_working_identical_optimizer(options: str, how: str) -> None:
    m = model()
    opt = ROOT(m.parameters(), lr=0.02, nonfinite="skip", **OPTION_SETS[options])
    run(m, opt, range(2))
    m2, o2 = COPIES[how](m, opt)
    assert o2.nonfinite == "skip"
    # torch's __setstate__ adds "differentiable": False to the defaults
    assert {k: v for k, v in o2.defaults.items() if k != "differentiable"} == opt.defaults
    run(m, opt, range(2, 5))
    run(m2, o2, range(2, 5))
    assert len(o2.coefficient_resolutions()) == len(opt.coefficient_resolutions())
    assert_same(m, m2)
    # the copy's state is its own
    s1, s2 = list(opt.state.values()), list(o2.state.values())
    assert len(s1) == len(s2) and all(a["step"] == b["step"] == 5 for a, b in zip(s1, s2))
    p2 = next(m2.parameters())
    assert o2.state[p2] is not opt.state[next(m.parameters())]


def test_copy_keeps_a_distributed_subclass_working() -> None:
    from rootopt.distributed.root import DistributedROOT

    m = model()
    opt = DistributedROOT(m.parameters(), lr=0.02, average_grads=True)
    run(m, opt, range(2))
    m2, o2 = copy.deepcopy((m, opt))
    assert o2.average_grads is True
    run(m, opt, range(2, 4))
    run(m2, o2, range(2, 4))
    assert_same(m, m2)


# ------------------------------------------------------------------------------------------
# dtypes
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", ["default", "reference", "robust"])
def test_float64_params_and_state_stay_float64(options: str) -> None:
    m = model(torch.float64)
    opt = ROOT(m.parameters(), lr=0.02, **OPTION_SETS[options])
    run(m, opt, range(3))
    for p in m.parameters():
        assert p.dtype == torch.float64
        floats = [v for k, v in opt.state[p].items() if torch.is_tensor(v) and k != "step"]
        assert floats and all(v.dtype == torch.float64 for v in floats)
        # not rounded through float32 on the way (both the ROOT and the AdamW path)
        assert (p.detach() - p.detach().float().double()).abs().max() > 0
    assert {algorithm_of(opt.param_groups[0], p) for p in m.parameters()} == {"root", "adamw"}


def test_float64_matches_float32_closely() -> None:
    a, b = model(torch.float32), model(torch.float64)
    oa, ob = ROOT(a.parameters(), lr=0.02), ROOT(b.parameters(), lr=0.02)
    for s in range(3):
        feed(a, s)
        for pa, pb in zip(a.parameters(), b.parameters()):
            pb.grad = pa.grad.double()  # type: ignore[union-attr]
        oa.step()
        ob.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pb.float(), pa, atol=1e-5, rtol=1e-4)


def test_bf16_params_keep_float32_state() -> None:
    m = model(torch.bfloat16)
    opt = ROOT(m.parameters(), lr=0.02)
    run(m, opt, range(2))
    for p in m.parameters():
        assert p.dtype == torch.bfloat16
        assert all(
            v.dtype == torch.float32
            for k, v in opt.state[p].items()
            if torch.is_tensor(v) and k != "step"
        )


# ------------------------------------------------------------------------------------------
# load hooks
# ------------------------------------------------------------------------------------------
def test_load_pre_hook_result_is_loaded_and_post_hook_runs_last() -> None:
    m = model(torch.bfloat16)
    opt = ROOT(m.parameters(), lr=0.02)
    run(m, opt, range(2))
    sd = opt.state_dict()
    fresh = ROOT(m.parameters(), lr=0.02)

    def pre(o: torch.optim.Optimizer, d: dict[str, Any]) -> dict[str, Any]:
        d = copy.deepcopy(d)
        d["param_groups"][0]["lr"] = 0.125
        d["state"][0]["momentum_buffer"].fill_(3.0)
        return d

    seen: list[torch.dtype] = []

    def post(o: torch.optim.Optimizer) -> None:
        p0 = o.param_groups[0]["params"][0]
        seen.append(o.state[p0]["momentum_buffer"].dtype)

    fresh.register_load_state_dict_pre_hook(pre)
    fresh.register_load_state_dict_post_hook(post)
    fresh.load_state_dict(sd)
    assert fresh.param_groups[0]["lr"] == 0.125
    p0 = fresh.param_groups[0]["params"][0]
    assert torch.equal(fresh.state[p0]["momentum_buffer"], torch.full_like(p0, 3.0).float())
    assert seen == [torch.float32]  # the post hook saw the final (float32) state
    assert sd["param_groups"][0]["lr"] == 0.02  # the caller's dict is untouched


# ------------------------------------------------------------------------------------------
# add_param_group
# ------------------------------------------------------------------------------------------
def test_add_param_group_is_atomic_with_torchs_errors() -> None:
    m = model()
    first, second = list(m[0].parameters()), list(m[2].parameters())
    opt = ROOT(first, lr=0.02)
    before = (len(opt.param_groups), [list(g["params"]) for g in opt.param_groups])
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        opt.add_param_group({"params": [second[0], first[0]]})
    with pytest.raises(TypeError, match="ordered collections"):
        opt.add_param_group({"params": set(second)})
    with pytest.raises(ValueError, match="Invalid momentum"):
        opt.add_param_group({"params": second, "momentum": 2.0})
    assert (len(opt.param_groups), [list(g["params"]) for g in opt.param_groups]) == before
    opt.add_param_group({"params": second, "lr": 0.01})
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["params"] == second


# ------------------------------------------------------------------------------------------
# tensor lr
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", ["default", "reference"])
def test_tensor_lr_equals_float_lr_and_follows_schedulers(options: str) -> None:
    a, b = model(), model()
    oa = ROOT(a.parameters(), lr=0.02, **OPTION_SETS[options])
    ob = ROOT(b.parameters(), lr=torch.tensor(0.02), **OPTION_SETS[options])
    sa = torch.optim.lr_scheduler.LambdaLR(oa, lambda s: 1.0 / (1 + s))
    sb = torch.optim.lr_scheduler.LambdaLR(ob, lambda s: 1.0 / (1 + s))
    for s in range(3):
        feed(a, s)
        feed(b, s)
        oa.step()
        ob.step()
        sa.step()
        sb.step()
    assert torch.is_tensor(ob.param_groups[0]["lr"])
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb)
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        ROOT(a.parameters(), lr=torch.tensor([0.1, 0.2]))


# ------------------------------------------------------------------------------------------
# user groups keep their identity
# ------------------------------------------------------------------------------------------
def test_user_groups_stay_whole_for_per_group_schedulers() -> None:
    m = model()
    groups = [
        {"params": list(m[0].parameters()), "lr": 0.02},
        {"params": list(m[2].parameters()), "lr": 0.01},
    ]
    opt = ROOT(groups)
    assert len(opt.param_groups) == 2
    assert [g["params"] for g in opt.param_groups] == [g["params"] for g in groups]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 0.5**s, lambda s: 1.0 + s])
    run(m, opt, range(1))
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.02]
    # each group's weight matrix got ROOT state, its bias AdamW state
    for g in opt.param_groups:
        w, b = g["params"]
        assert "momentum_buffer" in opt.state[w] and "exp_avg" in opt.state[b]


def test_explicit_algorithm_is_kept() -> None:
    m = model()
    opt = ROOT([{"params": list(m.parameters()), "algorithm": "adamw"}], lr=0.01)
    run(m, opt, range(1))
    assert all("exp_avg" in opt.state[p] for p in m.parameters())


def test_state_dict_of_the_older_split_layout_loads_into_its_own_groups() -> None:
    """Versions before 0.1 saved one user group as a ROOT group plus an AdamW group. Such a
    state dict loads into an optimizer built with those two groups written explicitly
    (the layout it describes) and continues the same run; into one auto group it is
    refused by torch's own group-count check, before anything is loaded."""
    a, b = model(), model()
    split = lambda m: [  # noqa: E731
        {"params": [p for p in m.parameters() if p.ndim >= 2], "algorithm": "root"},
        {"params": [p for p in m.parameters() if p.ndim < 2], "algorithm": "adamw"},
    ]
    old = ROOT(split(a), lr=0.02)
    run(a, old, range(2))
    new = ROOT(split(b), lr=0.02)
    b.load_state_dict(a.state_dict())
    new.load_state_dict(copy.deepcopy(old.state_dict()))  # a copy: loading aliases tensors
    run(a, old, range(2, 4))
    run(b, new, range(2, 4))
    assert_same(a, b)
    one = ROOT(b.parameters(), lr=0.02)
    before = copy.deepcopy(one.state_dict())
    with pytest.raises(ValueError, match="different number of parameter groups"):
        one.load_state_dict(old.state_dict())
    assert one.state_dict() == before


# ------------------------------------------------------------------------------------------
# transposed (Conv1D) layout
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("lr_scale", ["muon", "moonlight"])
def test_transposed_group_equals_the_untransposed_update(batched: bool, lr_scale: str) -> None:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8, 24))  # (out, in)
    wt = nn.Parameter(w.detach().t().clone())  # the same weight stored (in, out)
    o1 = ROOT([w], lr=0.05, lr_scale=lr_scale, batched=batched)  # type: ignore[arg-type]
    o2 = ROOT([{"params": [wt], "transposed": True}], lr=0.05, lr_scale=lr_scale, batched=batched)  # type: ignore[arg-type]
    for _ in range(3):
        g = torch.randn(8, 24)
        w.grad, wt.grad = g.clone(), g.t().clone()
        o1.step()
        o2.step()
    torch.testing.assert_close(wt.detach().t(), w.detach(), atol=1e-5, rtol=1e-5)


def test_gpt2_conv1d_muon_scale_uses_fan_out() -> None:
    transformers = pytest.importorskip("transformers")
    import rootopt

    cfg = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.0
    )
    net = transformers.GPT2LMHeadModel(cfg)
    groups, _ = rootopt.param_groups(
        net, lr=0.01, weight_decay=0.0, lr_scale="muon", ortho_method="svd", outlier_quantile=None
    )
    opt = ROOT(groups)
    c_fc = net.transformer.h[0].mlp.c_fc.weight  # Conv1D, stored (in=32, out=128)
    before = c_fc.detach().clone()
    ids = torch.randint(0, 64, (2, 16))
    net(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    # svd: the step is lr * s * U with all singular values of U equal to 1;
    # muon's s = sqrt(max(1, fan_out / fan_in)) = sqrt(128 / 32) = 2
    sv = torch.linalg.svdvals((before - c_fc.detach()).double())
    # (the gradient's rank is below 32: LayerNorm outputs have zero mean, so a few
    # singular values of U are 0; the others are 1)
    top = sv[sv > 1e-3]
    assert len(top) >= 24
    torch.testing.assert_close(top, torch.full_like(top, 0.01 * 2.0), atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------------
# LoRA tensors in a group routed by shape
# ------------------------------------------------------------------------------------------
class _LoraLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base_layer = nn.Linear(16, 16)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(16, 4, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(4, 16, bias=False)})


def test_named_lora_factors_in_a_bare_list_warn_once_per_call() -> None:
    net = _LoraLinear()
    with pytest.warns(UserWarning, match=r"rootopt\.param_groups") as rec:
        ROOT((n, p) for n, p in net.named_parameters() if p.requires_grad)
    assert sum("LoRA" in str(w.message) for w in rec) == 1
    assert "lora_A.default.weight" in str(rec[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ROOT([p for n, p in net.named_parameters() if "lora" not in n])  # nothing to warn
        ROOT([{"params": [net.lora_A["default"].weight], "algorithm": "adamw"}])


# ------------------------------------------------------------------------------------------
# fused projections orthogonalized per block
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("transposed", [False, True])
def test_ns_split_equals_separate_blocks(transposed: bool) -> None:
    torch.manual_seed(0)
    sizes = (8, 4, 4)  # q, k, v with fewer kv heads
    blocks = [nn.Parameter(torch.randn(n, 12)) for n in sizes]  # (out_i, in)
    fused_w = torch.cat([b.detach() for b in blocks], 0)
    fused = nn.Parameter(fused_w.t().clone() if transposed else fused_w.clone())
    common: dict[str, Any] = {"lr": 0.05, "lr_scale": "muon"}
    o1 = ROOT(blocks, **common)
    group: dict[str, Any] = {"params": [fused], "ns_split": [sizes], "algorithm": "root"}
    if transposed:
        group["transposed"] = True
    o2 = ROOT([group], **common)
    for _ in range(3):
        gs = [torch.randn(n, 12) for n in sizes]
        for b, g in zip(blocks, gs):
            b.grad = g
        g = torch.cat(gs, 0)
        fused.grad = g.t().clone() if transposed else g
        o1.step()
        o2.step()
    got = fused.detach().t() if transposed else fused.detach()
    torch.testing.assert_close(got, torch.cat([b.detach() for b in blocks], 0))
    with pytest.raises(ValueError, match="Invalid ns_split"):
        ROOT([{"params": [fused], "ns_split": [(8, 5, 4)]}])
    with pytest.raises(ValueError, match="Invalid ns_split"):
        ROOT([{"params": [fused], "ns_split": [sizes, sizes]}])


def test_fused_splits_reads_the_gpt2_routing() -> None:
    transformers = pytest.importorskip("transformers")
    import rootopt
    from rootopt.optim.root import fused_splits

    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    net = transformers.GPT2LMHeadModel(cfg)
    groups, report = rootopt.param_groups(net, lr=0.01)
    split = fused_splits(groups, report)
    assert len(split) == len(groups) and all("ns_split" not in g for g in groups)
    root = [g for g in split if "ns_split" in g]
    assert len(root) == 1 and root[0]["transposed"] is True
    named = dict(zip(root[0]["param_names"], root[0]["ns_split"]))
    assert named["transformer.h.0.attn.c_attn.weight"] == (32, 32, 32)
    assert named["transformer.h.0.mlp.c_fc.weight"] is None
    opt = ROOT(split)
    ids = torch.randint(0, 64, (2, 16))
    net(input_ids=ids, labels=ids).loss.backward()
    before = net.transformer.h[0].attn.c_attn.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, net.transformer.h[0].attn.c_attn.weight)
