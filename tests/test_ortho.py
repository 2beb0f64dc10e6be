from __future__ import annotations

import pytest
import torch

from rootopt import orthogonalize
from rootopt.coeffs import resolve
from rootopt.ortho import newton_schulz

SHAPES = [(8, 8), (16, 48), (48, 16), (33, 7), (7, 33), (1, 20), (20, 1), (128, 96)]


def _svals(X: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(X.double())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("coeffs", ["muon", "adanewton", "polar_express", "you"])
def test_newton_schulz_orthogonality_band(shape: tuple[int, int], coeffs: str) -> None:
    G = torch.randn(*shape)
    U = orthogonalize(G, coefficients=coeffs)
    assert U.shape == G.shape and U.dtype == torch.float32
    s = _svals(U)
    # Muon-style tuples leave singular values in a band around 1, never beyond ~1.25.
    assert s.max() < 1.3
    assert s.min() > 0.3


@pytest.mark.parametrize("shape", SHAPES)
def test_svd_is_exact_polar_factor(shape: tuple[int, int]) -> None:
    G = torch.randn(*shape, dtype=torch.float64)
    U = orthogonalize(G, method="svd", dtype=torch.float64)
    torch.testing.assert_close(_svals(U), torch.ones(min(shape), dtype=torch.float64))
    # polar factor: U^T G is symmetric positive semidefinite
    P = U.T @ G if shape[0] >= shape[1] else G @ U.T
    torch.testing.assert_close(P, P.T)
    assert torch.linalg.eigvalsh(P).min() > -1e-9


@pytest.mark.parametrize("shape", SHAPES)
def test_qr_direction_orthonormal_and_same_span(shape: tuple[int, int]) -> None:
    G = torch.randn(*shape, dtype=torch.float64)
    Q = orthogonalize(G, method="qr", dtype=torch.float64)
    assert Q.shape == G.shape
    torch.testing.assert_close(_svals(Q), torch.ones(min(shape), dtype=torch.float64))


def test_ns_converges_to_polar_with_many_classic_steps() -> None:
    G = torch.randn(24, 40, dtype=torch.float64)
    G = G + 0.5 * torch.eye(24, 40, dtype=torch.float64)
    exact = orthogonalize(G, method="svd", dtype=torch.float64)
    approx = orthogonalize(G, coefficients="quintic", steps=60, dtype=torch.float64)
    torch.testing.assert_close(approx, exact, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("shape", [(5, 16, 24), (3, 24, 16)])
def test_batched_equals_per_matrix(shape: tuple[int, int, int]) -> None:
    G = torch.randn(*shape)
    sched = resolve("muon", shape[1], shape[2], 5)
    batched = newton_schulz(G, sched)
    for i in range(shape[0]):
        torch.testing.assert_close(batched[i], newton_schulz(G[i], sched), atol=1e-5, rtol=1e-5)
    for method in ("svd", "qr"):
        b = orthogonalize(G, method=method)
        for i in range(shape[0]):
            torch.testing.assert_close(
                b[i], orthogonalize(G[i], method=method), atol=1e-5, rtol=1e-5
            )


def test_bfloat16_iteration_close_to_float32() -> None:
    G = torch.randn(64, 128)
    U32 = orthogonalize(G, coefficients="muon")
    U16 = orthogonalize(G, coefficients="muon", dtype=torch.bfloat16)
    assert U16.dtype == torch.bfloat16
    assert (U16.float() - U32).norm() / U32.norm() < 0.05


@pytest.mark.parametrize("method", ["newton_schulz", "svd", "qr"])
def test_zero_input_gives_zero(method: str) -> None:
    U = orthogonalize(torch.zeros(6, 9), method=method)  # type: ignore[arg-type]
    assert torch.isfinite(U).all() and U.abs().max() == 0


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="2-D or 3-D"):
        orthogonalize(torch.randn(3))
    with pytest.raises(ValueError, match="complex"):
        orthogonalize(torch.randn(3, 3, dtype=torch.complex64))
    with pytest.raises(ValueError, match="method"):
        orthogonalize(torch.randn(3, 3), method="lu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="steps"):
        orthogonalize(torch.randn(3, 3), steps=0)
