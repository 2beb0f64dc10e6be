from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rootopt import abs_quantile
from rootopt.coeffs import resolve
from rootopt.optim import quantile as fn
from rootopt.optim.functional import outlier_threshold, root_direction


@pytest.mark.parametrize("shape", [(1, 1), (1, 9), (9, 1), (7, 13), (64, 33), (256, 256)])
@pytest.mark.parametrize("q", [0.0, 0.1, 0.5, 0.9, 0.97, 1.0])
def test_matches_torch_quantile_float64(shape: tuple[int, int], q: float) -> None:
    M = torch.randn(*shape, dtype=torch.float64)
    # the library works in float32; compare on float32-representable data
    M = M.float().double()
    expected = torch.quantile(M.abs().flatten(), q)
    got = abs_quantile(M, q)
    assert got.shape == (1, 1)
    torch.testing.assert_close(got.double().squeeze(), expected, rtol=1e-6, atol=0)


def test_ties_and_batches() -> None:
    M = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 2.0, 2.0, 3.0]]).reshape(2, 2, 2)
    got = abs_quantile(M, 0.9).flatten()
    for i in range(2):
        assert got[i].item() == pytest.approx(torch.quantile(M[i].flatten(), 0.9).item())


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 12),
    cols=st.integers(1, 12),
    q=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
    ties=st.booleans(),
)
def test_property_equals_numpy_linear(
    rows: int, cols: int, q: float, seed: int, ties: bool
) -> None:
    g = torch.Generator().manual_seed(seed)
    M = torch.randn(rows, cols, generator=g)
    if ties:
        M = M.round()
    expected = np.quantile(M.abs().double().numpy().ravel(), q, method="linear")
    assert abs_quantile(M, q).item() == pytest.approx(expected, rel=1e-6, abs=1e-7)


def test_beyond_torch_quantile_limit() -> None:
    n = 2**24 + 4097  # torch.quantile refuses more than 2**24 elements
    x = torch.randn(n)
    with pytest.raises(RuntimeError):
        torch.quantile(x.abs(), 0.9)
    got = abs_quantile(x.reshape(1, n), 0.9).item()
    expected = np.quantile(np.abs(x.numpy()).astype(np.float64), 0.9, method="linear")
    assert got == pytest.approx(expected, rel=1e-6)


def test_the_threshold_splits_off_the_outliers() -> None:
    M = torch.randn(30, 40)
    eps = outlier_threshold(M, 0.9)
    assert eps.shape == (1, 1) and eps.dtype == torch.float32
    assert eps.item() == (abs_quantile(M, 0.9) + 1e-9).item()  # the official code's offset
    B = M.clamp(-eps, eps)
    O = M - B
    torch.testing.assert_close(O, torch.sign(M) * torch.relu(M.abs() - eps))
    assert B.abs().max() <= eps.item()
    # about 10% of entries are clipped at q = 0.9
    assert abs((M.abs() > eps).float().mean().item() - 0.1) < 0.01


def test_no_suppression_when_q_is_none() -> None:
    V = torch.randn(2, 5, 5)
    V[0, 0, 0] = 100.0  # an outlier any threshold would clip
    before, thresholds = V.clone(), []
    root_direction(V, resolve("polar_express", 5, 5, 5), quantile=None, thresholds=thresholds)
    assert torch.equal(V, before) and thresholds == []
    root_direction(V, resolve("polar_express", 5, 5, 5), quantile=0.9, thresholds=thresholds)
    assert len(thresholds) == 1 and thresholds[0].shape == (2, 1, 1)
    assert V[0, 0, 0].item() == thresholds[0][0].item() < 100.0


@pytest.mark.parametrize("shape", [(256, 256), (300, 700), (2, 256, 512)])
@pytest.mark.parametrize("q", [0.0, 0.5, 0.9, 0.999, 1.0])
@pytest.mark.parametrize("kind", ["normal", "ties", "zeros", "heavy"])
def test_cpu_bracket_equals_selection_bit_for_bit(
    shape: tuple[int, ...], q: float, kind: str
) -> None:
    """The CPU fast path (sampled bracket) against the reference selection, including
    cases where the bracket must fall back (q=1, all-equal entries)."""
    M = torch.randn(*shape)
    if kind == "ties":
        M = (M * 4).round()
    elif kind == "zeros":
        M = torch.zeros(*shape)
    elif kind == "heavy":
        M = torch.distributions.StudentT(1.5).sample(shape)
    assert M[..., :, :].numel() // (shape[0] if len(shape) == 3 else 1) >= fn.BRACKET_MIN_ENTRIES
    x = M.abs().float().flatten(-2)
    n = x.size(-1)
    pos = q * (n - 1)
    lo = min(int(pos), n - 1)
    expected = fn._quantile_select(x, lo, pos - lo)
    assert torch.equal(abs_quantile(M, q).squeeze(-1), expected)


@pytest.mark.parametrize("q", [0.0, 0.1, 0.5, 0.9, 0.999, 1.0])
@pytest.mark.parametrize("kind", ["gaussian", "ties", "zeros", "heavy", "half_zero", "tiny"])
def test_topk_rows_equal_selection_bit_for_bit(q: float, kind: str) -> None:
    """The accelerator path (one topk per row) against the reference selection, on the
    CPU: upper and lower quantiles, ties, all-zero rows, heavy tails, subnormals."""
    g = torch.Generator().manual_seed(1)
    M = torch.randn(3, 61, 97, generator=g)
    if kind == "ties":
        M = (M * 4).round()
    elif kind == "zeros":
        M = torch.zeros(3, 61, 97)
    elif kind == "heavy":
        M = torch.distributions.StudentT(1.5).sample((3, 61, 97))
    elif kind == "half_zero":
        M[:, :30] = 0.0
    elif kind == "tiny":
        M = M * 1e-42  # subnormal float32 values
    v = M.flatten(-2)
    n = v.size(-1)
    pos = q * (n - 1)
    lo = min(int(pos), n - 1)
    expected = fn._quantile_select(v.abs(), lo, pos - lo)
    got = fn.quantile_topk_rows(v, lo, pos - lo)
    assert got.shape == expected.shape == (3, 1)
    assert torch.equal(got, expected)
