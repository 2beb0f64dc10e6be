"""The non-finite check: NaN, +Inf and -Inf anywhere in any gradient refuse the step before
anything changes; a huge but finite gradient is not refused (the check reads the entries,
not a norm that overflows)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rootopt import ROOT, NonFiniteGradientError


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["matrix", "bias"])
def test_any_non_finite_entry_refuses_the_step(bad: float, where: str) -> None:
    w, b = nn.Parameter(torch.randn(8, 12)), nn.Parameter(torch.randn(12))
    opt = ROOT([("matrix", w), ("bias", b)], lr=0.1)
    w.grad, b.grad = torch.randn(8, 12), torch.randn(12)
    (w.grad if where == "matrix" else b.grad).view(-1)[5] = bad
    before = (w.detach().clone(), b.detach().clone())
    with pytest.raises(NonFiniteGradientError, match=f"in parameter {where};"):
        opt.step()
    assert torch.equal(w, before[0]) and torch.equal(b, before[1]) and not opt.state


def test_huge_finite_gradient_is_a_step() -> None:
    b = nn.Parameter(torch.zeros(12))
    opt = ROOT([b], lr=0.1, weight_decay=0.0)
    b.grad = torch.full((12,), 1e19)  # its 2-norm overflows float32; every entry is finite
    b.grad[0] = -1e19
    opt.step()
    assert torch.isfinite(b).all() and b.abs().max() > 0


def test_finite_flags_per_gradient_empty_ones_finite() -> None:
    """The check every step shares (ROOT's and DistributedROOT's, optim/_finite.py): one
    flag per gradient, NaN/±Inf anywhere false, an empty gradient (an FSDP2 shard of no
    rows) true, bfloat16 included."""
    from rootopt.optim._finite import finite_flags

    grads = [torch.randn(3, 4), torch.empty(0, 4), torch.randn(5), torch.randn(2, 2)]
    grads[2][4] = float("-inf")
    grads[3][1, 0] = float("nan")
    bf = [g.to(torch.bfloat16) for g in grads]
    for gs in (grads, bf, grads[:2]):
        want = [True, True, False, False][: len(gs)]
        assert finite_flags(gs).tolist() == want
