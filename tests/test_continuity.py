"""No hard switches that flip on rounding (docs/benchmarks.md, the selector's rule).

A step of the optimizer must be a continuous function of the momentum it orthogonalizes: a
decision that flips between two schedules when the input moves by a rounding error turns a
1e-7 difference in summation order (another world size, another reduction tree) into an
O(1) difference in the update, and runs stop being reproducible across process counts.

Newton–Schulz with a fixed schedule maps each singular value of the Frobenius-normalised
input through p = p_K ∘ … ∘ p_1, p_k(x) = a_k x + b_k x³ + c_k x⁵, so its derivative
(Fréchet, in the Frobenius norm) is bounded by sup |p'| over [0, 1]: the divided differences
of p and p(x)/x are means of p'. Along a path of inputs, the output may therefore move at
most that fast; a switch between schedules shows as a jump far above it.
"""

from __future__ import annotations

import pytest
import torch

import rootopt
from rootopt.coeffs import resolve
from rootopt.optim import ROOT

ROWS, COLS, STEPS = 32, 64, 5


def _max_slope(schedule: list[tuple[float, float, float]]) -> float:
    x = torch.linspace(0, 1, 20001, dtype=torch.float64, requires_grad=True)
    y = x
    for a, b, c in schedule:
        y = a * y + b * y**3 + c * y**5
    (g,) = torch.autograd.grad(y.sum(), x)
    return float(g.abs().max())


def _default_coefficients() -> str:
    import inspect

    value = inspect.signature(ROOT.__init__).parameters["ns_coefficients"].default
    assert isinstance(value, str)
    return value


@pytest.mark.parametrize("coefficients", ["default", "adanewton", "muon", "polar_express"])
@pytest.mark.parametrize("small", [4, 16])
def test_orthogonalization_moves_no_faster_than_its_schedule_allows(
    coefficients: str, small: int
) -> None:
    """``small`` singular values swept from 1e-4 to 0.3 (the rest at 1): the output's change
    per change of the normalised input never exceeds the schedule's sup |p'| (+25 % for
    float32 rounding); a per-matrix schedule switch along the path fails this by ~10×."""
    name = _default_coefficients() if coefficients == "default" else coefficients
    schedule = [tuple(map(float, c)) for c in resolve(name, ROWS, COLS, STEPS)]
    assert len(schedule) == STEPS
    bound = _max_slope(schedule)  # type: ignore[arg-type]
    assert bound > 1.0  # a real iteration amplifies small singular values

    g = torch.Generator().manual_seed(0)
    U, _ = torch.linalg.qr(torch.randn(ROWS, ROWS, dtype=torch.float64, generator=g))
    V, _ = torch.linalg.qr(torch.randn(COLS, ROWS, dtype=torch.float64, generator=g))
    prev: tuple[torch.Tensor, torch.Tensor] | None = None
    worst, where = 0.0, 0.0
    for eps in torch.logspace(-4, -0.5, 200, dtype=torch.float64).tolist():
        s = torch.ones(ROWS, dtype=torch.float64)
        s[-small:] = eps
        G = (U * s) @ V.T
        X = G / G.norm()
        out = rootopt.orthogonalize(G.float(), steps=STEPS, coefficients=name).double()
        assert out.shape == (ROWS, COLS) and torch.isfinite(out).all()
        if prev is not None:
            ratio = float((out - prev[1]).norm() / (X - prev[0]).norm())
            if ratio > worst:
                worst, where = ratio, eps
        prev = (X, out)
    assert worst <= 1.25 * bound, (
        f"{name}: the output moved {worst:.3g}× as fast as its input near eps={where:.3g}, "
        f"above the schedule's bound {bound:.3g}: a discontinuity (a switch)"
    )
