"""ROOT behaves like any torch.optim optimizer, and refuses bad input cleanly."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from rootopt import ROOT, NonFiniteGradientError, param_groups


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.fc1 = nn.Linear(16, 24)
        self.fc2 = nn.Linear(24, 16)
        self.norm = nn.LayerNorm(16)
        self.lm_head = nn.Linear(16, 32, bias=False)
        self.lm_head.weight = self.emb.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = self.norm(h + self.fc2(torch.relu(self.fc1(h))))
        return self.lm_head(h)


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 32, (4, 8), generator=g)
    y = torch.randint(0, 32, (4, 8), generator=g)
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _train(model: nn.Module, opt: torch.optim.Optimizer, seeds: range) -> list[float]:
    losses = []
    for s in seeds:
        opt.zero_grad()
        loss = _loss(model, s)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _make(model: nn.Module, **kw: Any) -> ROOT:
    groups, _ = param_groups(model, lr=0.02)
    return ROOT(groups, lr=0.02, **kw)


def test_loss_decreases() -> None:
    model = Tiny()
    losses = _train(model, _make(model), range(1))
    opt = _make(model)
    for _ in range(30):
        losses += _train(model, opt, range(0, 1))
    assert losses[-1] < 0.5 * losses[0]


def test_save_load_continue_equals_uninterrupted(tmp_path: Path) -> None:
    a = Tiny()
    b = copy.deepcopy(a)
    oa = _make(a, robust_scaling=True)
    _train(a, oa, range(6))

    ob = _make(b, robust_scaling=True)
    _train(b, ob, range(3))
    torch.save({"model": b.state_dict(), "opt": ob.state_dict()}, tmp_path / "ck.pt")
    c = Tiny()
    oc = _make(c, robust_scaling=True)
    ck = torch.load(tmp_path / "ck.pt", weights_only=True)
    c.load_state_dict(ck["model"])
    oc.load_state_dict(ck["opt"])
    _train(c, oc, range(3, 6))
    for pa, pc in zip(a.parameters(), c.parameters()):
        assert torch.equal(pa, pc)


def test_resume_in_fresh_process(tmp_path: Path) -> None:
    a = Tiny()
    init = copy.deepcopy(a.state_dict())
    oa = _make(a)
    _train(a, oa, range(4))
    b = Tiny()
    b.load_state_dict(init)
    ob = _make(b)
    _train(b, ob, range(2))
    torch.save({"model": b.state_dict(), "opt": ob.state_dict()}, tmp_path / "ck.pt")
    script = textwrap.dedent(
        f"""
        import sys, torch
        torch.set_num_threads({torch.get_num_threads()})  # same reductions as the parent
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_contract import Tiny, _make, _train
        m = Tiny(); o = _make(m)
        ck = torch.load({str(tmp_path / "ck.pt")!r}, weights_only=True)
        m.load_state_dict(ck["model"]); o.load_state_dict(ck["opt"])
        _train(m, o, range(2, 4))
        torch.save(m.state_dict(), {str(tmp_path / "out.pt")!r})
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True)
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    for k, v in a.state_dict().items():
        assert torch.equal(v, out[k]), k


def test_state_stays_float32_for_bf16_params_after_load() -> None:
    p = nn.Parameter(torch.randn(8, 12).bfloat16())
    opt = ROOT([p])
    p.grad = torch.randn(8, 12).bfloat16()
    opt.step()
    assert opt.state[p]["momentum_buffer"].dtype == torch.float32
    sd = copy.deepcopy(opt.state_dict())
    opt2 = ROOT([p])
    opt2.load_state_dict(sd)
    assert opt2.state[p]["momentum_buffer"].dtype == torch.float32
    assert torch.equal(opt2.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_gradients(dtype: torch.dtype) -> None:
    model = Tiny().to(dtype)
    opt = _make(model)
    loss = _loss(model.float(), 0)  # fp32 forward, cast grads below
    loss.backward()
    for p in model.parameters():
        p.data = p.data.to(dtype)
        p.grad = p.grad.to(dtype)  # type: ignore[union-attr]
    opt.step()
    for p in model.parameters():
        assert p.dtype == dtype and torch.isfinite(p).all()
        for v in opt.state[p].values():
            if isinstance(v, torch.Tensor):
                assert v.dtype == torch.float32


def test_scheduler_closure_zero_grad_add_param_group() -> None:
    model = Tiny()
    opt = _make(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0)  # lr -> 0
    _train(model, opt, range(1))
    sched.step()
    assert all(g["lr"] == 0.0 for g in opt.param_groups)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def closure() -> float:
        opt.zero_grad()
        loss = _loss(model, 1)
        loss.backward()
        return float(loss.detach())

    assert isinstance(opt.step(closure), float)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n  # lr 0 and decay lr*wd = 0: nothing moves
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    # An added group is stepped like a ROOT of its own, at the lr a scheduler gives it.
    extra = nn.Parameter(torch.randn(5, 7))
    twin, start = nn.Parameter(extra.detach().clone()), extra.detach().clone()
    opt.add_param_group({"params": [extra], "param_names": ["extra"], "lr": 0.1})
    halve = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # knows every group
    halve.step()
    assert opt.param_groups[-1]["lr"] == pytest.approx(0.05)
    ref = ROOT([twin], lr=0.05)
    for _ in range(2):  # the second step also reads the momentum the first one left
        grad = torch.randn(5, 7)
        extra.grad, twin.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    assert not torch.equal(extra, start)
    torch.testing.assert_close(extra, twin, rtol=0, atol=0)


def test_grad_scaler_unscale_then_step() -> None:
    model = Tiny()
    opt = _make(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    loss = _loss(model, 0)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    ref = copy.deepcopy(model)
    ref_opt = _make(ref)
    _loss(ref, 0).backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad)
    scaler.step(opt)
    scaler.update()
    ref_opt.step()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r)
    # an overflowing step is skipped by the scaler and never reaches ROOT
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    (_loss(model, 1) * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert scaler.get_scale() < 2.0**10


def _compiled_equals_eager(backend: str, tol: float) -> None:
    """A torch.compile'd module trained by ROOT (the optimizer holds the module's own
    parameters) follows the eager module trained the same way: losses and parameters."""
    eager = Tiny()
    model = copy.deepcopy(eager)
    start = copy.deepcopy(eager.state_dict())
    compiled = torch.compile(model, backend=backend)
    seeds = [0, 1, 2, 0, 1, 2]
    want = _train(eager, _make(eager), seeds)
    got = _train(compiled, _make(model), seeds)  # type: ignore[arg-type]
    assert len(got) == len(want) == len(seeds)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    a, b = model.state_dict(), eager.state_dict()
    assert list(a) == list(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=tol, atol=tol, msg=name)
    assert not torch.equal(b["fc1.weight"], start["fc1.weight"])  # it did train


@pytest.mark.slow
def test_compiled_model_equals_eager() -> None:
    _compiled_equals_eager("inductor", 1e-4)


def test_compiled_model_eager_backend_equals_eager() -> None:
    _compiled_equals_eager("eager", 1e-6)


def test_empty_and_gradless_params() -> None:
    e = nn.Parameter(torch.zeros(0, 5))
    w = nn.Parameter(torch.randn(4, 4))
    n = nn.Parameter(torch.randn(3, 3))
    opt = ROOT([e, w, n])
    e.grad = torch.zeros(0, 5)
    w.grad = torch.randn(4, 4)
    opt.step()
    assert n not in opt.state and e not in opt.state and w in opt.state


def test_zero_gradient_gives_zero_finite_update() -> None:
    p = nn.Parameter(torch.randn(6, 9))
    before = p.detach().clone()
    opt = ROOT([p], weight_decay=0.0, telemetry=True)
    p.grad = torch.zeros(6, 9)
    opt.step()
    assert torch.equal(p.detach(), before)
    assert all(
        torch.isfinite(v).all() for v in opt.state[p].values() if isinstance(v, torch.Tensor)
    )


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"lr": -1.0}, "Invalid lr: -1.0"),
        ({"lr": float("nan")}, "Invalid lr"),
        ({"momentum": 1.0}, "Invalid momentum: 1.0"),
        ({"weight_decay": -0.1}, "Invalid weight_decay"),
        ({"nesterov": "yes"}, "Invalid nesterov"),
        ({"ns_steps": 0}, "Invalid ns_steps: 0"),
        ({"ns_steps": 2.5}, "Invalid ns_steps"),
        ({"ns_coefficients": "magic"}, "ns_coefficients='magic' is unknown"),
        ({"ns_coefficients": (1.0, 2.0)}, r"\(a, b, c\)"),
        ({"ns_dtype": "int8"}, "Invalid ns_dtype: 'int8'"),
        ({"ortho_method": "lu"}, "Invalid ortho_method: 'lu'"),
        ({"outlier_quantile": 0.0}, "Invalid outlier_quantile: 0.0"),
        ({"outlier_quantile": 1.5}, "Invalid outlier_quantile"),
        ({"lr_scale": "big"}, "Invalid lr_scale: 'big'"),
        ({"nd_view": "cube"}, "Invalid nd_view"),
        ({"robust_window": 0}, "Invalid robust_window"),
        ({"robust_lambda": -1}, "Invalid robust_lambda"),
        ({"adamw_betas": (0.9, 1.0)}, "Invalid adamw_betas"),
        ({"adamw_eps": -1e-8}, "Invalid adamw_eps"),
        ({"nonfinite": "ignore"}, "Invalid nonfinite: 'ignore'"),
    ],
)
def test_bad_hyperparameters(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ROOT([nn.Parameter(torch.randn(3, 3))], **kwargs)


def test_bad_group_options() -> None:
    p = nn.Parameter(torch.randn(3, 3))
    with pytest.raises(ValueError, match="Invalid momentum: -0.5"):
        ROOT([{"params": [p], "momentum": -0.5}])
    with pytest.raises(ValueError, match="Invalid algorithm: 'sgd'"):
        ROOT([{"params": [p], "algorithm": "sgd"}])
    with pytest.raises(ValueError, match="route it to algorithm='adamw'"):
        ROOT([{"params": [nn.Parameter(torch.randn(3))], "algorithm": "root"}])


def test_sparse_and_complex_gradients() -> None:
    emb = nn.Embedding(10, 4, sparse=True)
    opt = ROOT(emb.named_parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients \\(weight\\)"):
        opt.step()
    with pytest.raises(RuntimeError, match="complex parameters"):
        ROOT([nn.Parameter(torch.randn(3, 3, dtype=torch.complex64))])


def test_nonfinite_error_leaves_everything_untouched() -> None:
    model = Tiny()
    opt = _make(model)
    _train(model, opt, range(1))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = copy.deepcopy(opt.state_dict())
    _loss(model, 1).backward()
    model.fc1.weight.grad[0, 0] = float("nan")  # type: ignore[index]
    with pytest.raises(NonFiniteGradientError, match="fc1.weight"):
        opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n])
    after = opt.state_dict()
    for k, s in state["state"].items():
        for key, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(after["state"][k][key]))


def test_nonfinite_skip_only_that_parameter() -> None:
    model = Tiny()
    opt = _make(model, nonfinite="skip")
    _train(model, opt, range(1))
    w = model.fc1.weight
    w_before, buf_before = w.detach().clone(), opt.state[w]["momentum_buffer"].clone()
    other_before = model.fc2.weight.detach().clone()
    opt.zero_grad()
    _loss(model, 1).backward()
    w.grad[1, 2] = float("inf")  # type: ignore[index]
    opt.step()
    assert opt.skipped == ["fc1.weight"]
    assert torch.equal(w, w_before)
    assert torch.equal(opt.state[w]["momentum_buffer"], buf_before)
    assert opt.state[w]["step"] == 1
    assert not torch.equal(model.fc2.weight, other_before)
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ------------------------------------------------------------------ telemetry
def test_telemetry_off_by_default_and_values_when_on() -> None:
    model = Tiny()
    opt = _make(model)
    _train(model, opt, range(1))
    assert opt.telemetry == {}
    opt = _make(model, telemetry=True, record_spectra=True)
    _train(model, opt, range(2))
    assert set(opt.telemetry) == {"fc1.weight", "fc2.weight"}
    t = opt.telemetry["fc1.weight"]
    assert 0.05 < t["clip_fraction"] <= 0.11  # q = 0.9 clips about 10% (ties aside)
    assert 0 < t["outlier_energy"] < 1 and t["eps"] > 0
    assert 0 <= t["ortho_residual"] < 0.6
    assert t["update_rms"] > 0 and t["update_param_ratio"] > 0
    sv = t["singular_values"]
    assert isinstance(sv, torch.Tensor) and sv.numel() == 16
    assert sv.pow(2).sum().item() == pytest.approx(1.0, rel=1e-4)
