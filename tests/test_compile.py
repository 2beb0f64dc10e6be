"""``torch.compile`` over ROOT's step: no graph break in the step, at most two compiles
over 20 steps, equal to eager, and a compile-friendly non-finite check
(docs/integrations.md, "torch.compile")."""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch
from torch import nn

from rootopt import ROOT

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="inductor on CPU needs a C++ compiler",
)


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # three matrix shapes (16x32, 32x32, 8x32) and three biases
    return nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8)
    )


def _counter() -> Any:
    from torch._dynamo.testing import CompileCounterWithBackend

    return CompileCounterWithBackend("inductor")


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    pa, pb = list(a.parameters()), list(b.parameters())
    assert len(pa) == len(pb)
    return max((x - y).abs().max().item() for x, y in zip(pa, pb))


def _compiled_vs_eager(options: dict[str, Any], steps: int = 20) -> tuple[Any, Any, Any]:
    import torch._dynamo as dynamo

    dynamo.reset()
    dynamo.utils.counters.clear()
    a, b = mlp(), mlp()
    oa = ROOT(a.parameters(), lr=0.01, **options)
    ob = ROOT(b.parameters(), lr=0.01, **options)
    cnt = _counter()
    step = torch.compile(ob.step, backend=cnt)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        for m, f in ((a, oa.step), (b, step)):
            m.zero_grad()
            m(x).square().mean().backward()
            f()
    return (a, oa, b, ob, step), cnt, dict(dynamo.utils.counters["graph_break"])


def test_compiled_step_equals_eager_compiles_twice_and_checks_nonfinite() -> None:
    # float32 iterations: compiled and eager are compared to float32 rounding (bfloat16
    # iterations, the default, round at the places the compiled graph fuses differently)
    (a, oa, b, ob, step), cnt, breaks = _compiled_vs_eager({"ns_dtype": "float32"})
    # one compile with empty state, one with the state it created; then none
    assert cnt.frame_count <= 2, cnt.frame_count
    assert breaks == {}  # the non-finite check no longer calls .tolist() when compiled
    assert _max_diff(a, b) < 1e-5
    for p in b.parameters():
        step_t = ob.state[p]["step"]
        assert torch.is_tensor(step_t) and float(step_t) == 20.0
    # eager steps after compiled ones keep counting (the tensor count is read back)
    for p, q in zip(a.parameters(), b.parameters()):
        q.grad = p.grad = torch.ones_like(p)
    oa.step()
    ob.step()
    assert _max_diff(a, b) < 1e-5 and all(ob.state[p]["step"] == 21 for p in b.parameters())

    # a NaN gradient under the compiled step: an error, and nothing changed
    before = [p.detach().clone() for p in b.parameters()]
    state = [
        {k: v.clone() for k, v in ob.state[p].items() if torch.is_tensor(v)} for p in b.parameters()
    ]
    for p in b.parameters():
        p.grad = torch.ones_like(p)
    next(b.parameters()).grad[0, 0] = float("nan")  # type: ignore[index]
    with pytest.raises(RuntimeError, match="non-finite gradient"):
        step()
    params = list(b.parameters())
    assert len(params) == len(before) == len(state)
    assert all(torch.equal(x, y) for x, y in zip(before, params))
    for saved, p in zip(state, params):
        assert all(torch.equal(v, ob.state[p][k]) for k, v in saved.items())


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        {"batched": False},
        {"robust_scaling": True, "ns_coefficients": "official", "nesterov": False},
        {"ns_coefficients": "polar_express", "outlier_quantile": None, "lr_scale": "muon"},
    ],
)
def test_compiled_step_option_sets(options: dict[str, Any]) -> None:
    (a, _, b, _, _), cnt, breaks = _compiled_vs_eager(options)
    assert cnt.frame_count <= 2 and breaks == {}
    assert _max_diff(a, b) < 1e-4  # robust scaling divides by small statistics


@pytest.mark.slow
def test_compiled_train_step_containing_the_step() -> None:
    import torch._dynamo as dynamo

    dynamo.reset()
    a, b = mlp(), mlp()
    oa, ob = ROOT(a.parameters(), lr=0.01), ROOT(b.parameters(), lr=0.01)
    x, y = torch.randn(4, 16), torch.randn(4, 8)

    def train_step(m: nn.Module, opt: ROOT) -> torch.Tensor:
        loss = nn.functional.mse_loss(m(x), y)
        loss.backward()  # Dynamo breaks the graph here (no compiled autograd by default)
        opt.step()
        opt.zero_grad()
        return loss

    cnt = _counter()
    compiled = torch.compile(train_step, backend=cnt)
    counts = []
    for _ in range(20):
        la, lb = train_step(a, oa), compiled(b, ob)
        counts.append(cnt.frame_count)
    torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-5)
    assert _max_diff(a, b) < 1e-5
    # compiles happen in the first two calls only
    assert counts[2:] == [counts[1]] * 18, counts


@pytest.mark.slow
def test_compiled_step_with_tensor_lr_and_scheduler_does_not_recompile() -> None:
    import torch._dynamo as dynamo

    dynamo.reset()
    a, b = mlp(), mlp()
    oa, ob = ROOT(a.parameters(), lr=0.02), ROOT(b.parameters(), lr=torch.tensor(0.02))
    sa = torch.optim.lr_scheduler.LambdaLR(oa, lambda s: 1 / (1 + s))
    sb = torch.optim.lr_scheduler.LambdaLR(ob, lambda s: 1 / (1 + s))
    cnt = _counter()
    step = torch.compile(ob.step, backend=cnt)
    x = torch.randn(4, 16)
    for _ in range(12):
        for m, f, sched in ((a, oa.step, sa), (b, step, sb)):
            m.zero_grad()
            m(x).square().mean().backward()
            f()
            sched.step()
    assert cnt.frame_count <= 2, cnt.frame_count
    assert _max_diff(a, b) < 1e-5
