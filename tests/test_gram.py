"""Gram-space Newton–Schulz against the plain iteration; the coefficient-tensor interface
of both."""

from __future__ import annotations

import json
import math
from importlib import resources

import pytest
import torch

from rootopt import orthogonalize
from rootopt.coeffs import resolve
from rootopt.ortho import (
    direction,
    gram_newton_schulz,
    newton_schulz,
    prefer_gram,
    prefer_spectral,
    spectral_newton_schulz,
)

ITERATIONS = [newton_schulz, gram_newton_schulz, spectral_newton_schulz]


def _orth(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(n, k, dtype=torch.float64, generator=g))[0]


def _family(name: str, m: int, n: int, seed: int, noise: float = 0.05) -> torch.Tensor:
    """A float64 m x n matrix whose spectrum is of the named family."""
    g = torch.Generator().manual_seed(seed)
    if name == "gaussian":
        return torch.randn(m, n, dtype=torch.float64, generator=g)
    if name == "heavytail":
        u = torch.rand(m, n, dtype=torch.float64, generator=g)
        M = torch.sign(u - 0.5) * (1 - (2 * u - 1).abs()).clamp_min(1e-12) ** (-1 / 2.5)
        M = M * torch.exp(0.5 * torch.randn(m, 1, dtype=torch.float64, generator=g))
        eps = torch.quantile(M.abs().flatten(), 0.9)
        return M.clamp(-eps, eps)
    if name == "lowrank":
        r = 4
        S = _orth(m, r, g) @ torch.diag(torch.arange(1, r + 1).double() ** -0.5) @ _orth(n, r, g).T
        N = torch.randn(m, n, dtype=torch.float64, generator=g)
        return S / S.norm() * math.sqrt(1 - noise) + N / N.norm() * math.sqrt(noise)
    text = (
        resources.files("rootopt_analysis.coeffs")
        .joinpath("data", "momentum_spectra.json")
        .read_text()
    )
    spectra = [e["sigma"] for e in json.loads(text)["spectra"]]
    s = torch.tensor(spectra[seed % len(spectra)], dtype=torch.float64)
    s = s[s > 0].sort(descending=True).values
    pos = ((torch.arange(m) + 0.5) / m * s.numel() - 0.5).clamp(0, s.numel() - 1)
    sig = s[pos.round().long()]
    return _orth(m, m, g) @ torch.diag(sig) @ _orth(n, m, g).T


def _polar_err(X: torch.Tensor, M: torch.Tensor) -> float:
    U, _, Vh = torch.linalg.svd(M, full_matrices=False)
    P = U @ Vh
    return float((X.double() - P).norm() / P.norm())


@pytest.mark.parametrize("shape", [(12, 40), (40, 12), (3, 10, 30), (16, 16)])
@pytest.mark.parametrize("spec", ["muon", "polar_express"])
def test_gram_equals_plain_in_float64(shape: tuple[int, ...], spec: str) -> None:
    G = torch.randn(*shape, dtype=torch.float64)
    sched = resolve(spec, shape[-2], shape[-1], 5)
    a = newton_schulz(G, sched, dtype=torch.float64)
    b = gram_newton_schulz(G, sched, dtype=torch.float64)
    c = spectral_newton_schulz(G, sched, dtype=torch.float64)
    assert a.shape == b.shape == c.shape == G.shape
    torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(a, c, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("family", ["gaussian", "heavytail", "lowrank", "momentum"])
def test_spectral_per_matrix_coefficients_equal_plain_in_float64(family: str) -> None:
    """A stack with a ``(K, batch, 3)`` coefficient tensor (one schedule per matrix)."""
    G = torch.stack([_family(family, 24, 72, seed) for seed in range(3)])
    C = torch.stack(
        [torch.tensor(resolve(s, 24, 72, 5), dtype=torch.float64) for s in
         ("muon", "polar_express", "muon")],
        dim=1,
    )  # fmt: skip
    a = newton_schulz(G, C, dtype=torch.float64)
    c = spectral_newton_schulz(G, C, dtype=torch.float64)
    torch.testing.assert_close(a, c, atol=1e-10, rtol=1e-10)
    # a shared (K, 3) tensor on one matrix too
    a1 = newton_schulz(G[0], C[:, 0], dtype=torch.float64)
    torch.testing.assert_close(spectral_newton_schulz(G[0], C[:, 0], dtype=torch.float64), a1)


@pytest.mark.parametrize("family", ["gaussian", "heavytail", "lowrank", "momentum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gram_accuracy_matches_plain_on_every_family(family: str, dtype: torch.dtype) -> None:
    """The Gram form's polar error stays within a few percent of the plain iteration's,
    in float32 and in bfloat16 (whose m x m recursion runs in float32: a bfloat16 one
    diverges on low-rank spectra, see docs/performance.md)."""
    m, n = 64, 256
    sched = resolve("polar_express", m, n, 5)
    worst = 0.0
    for seed in range(3):
        M = _family(family, m, n, seed)
        e_plain = _polar_err(newton_schulz(M.float(), sched, dtype=dtype), M)
        e_gram = _polar_err(gram_newton_schulz(M.float(), sched, dtype=dtype), M)
        assert e_plain < 0.3
        worst = max(worst, e_gram / e_plain)
    assert worst < (1.001 if dtype == torch.float32 else 1.1), worst


@pytest.mark.parametrize("family", ["gaussian", "heavytail", "lowrank", "momentum"])
def test_spectral_bfloat16_is_as_accurate_as_the_plain_bfloat16_iteration(family: str) -> None:
    """Where ``auto`` uses it (bfloat16 iteration): its distance to the float64 iteration
    is within 1.5x the plain bfloat16 iteration's, and its polar error within 2 %."""
    m, n = 128, 384
    sched = resolve("muon", m, n, 5)
    for seed in range(3):
        M = _family(family, m, n, seed)
        exact = newton_schulz(M, sched, dtype=torch.float64)
        plain = newton_schulz(M.float(), sched, dtype=torch.bfloat16)
        spec = spectral_newton_schulz(M.float(), sched, dtype=torch.bfloat16)
        assert spec.dtype == torch.bfloat16 and spec.shape == M.shape
        d_spec, d_plain = (float((X.double() - exact).norm() / exact.norm()) for X in (spec, plain))
        assert d_spec < 1.5 * d_plain, (d_spec, d_plain)
        assert _polar_err(spec, M) < 1.02 * _polar_err(plain, M)


def test_spectral_float32_error_is_why_it_is_not_the_float32_default() -> None:
    """On a low-rank spectrum the float32 eigendecomposition loses digits that the plain
    float32 iteration keeps (the reason prefer_spectral leaves float32 alone)."""
    M = _family("lowrank", 256, 768, 0)
    sched = resolve("muon", 256, 768, 5)
    exact = newton_schulz(M, sched, dtype=torch.float64)
    plain = newton_schulz(M.float(), sched, dtype=torch.float32)
    spec = spectral_newton_schulz(M.float(), sched, dtype=torch.float32)
    e_plain = float((plain.double() - exact).norm() / exact.norm())
    e_spec = float((spec.double() - exact).norm() / exact.norm())
    assert e_plain < 1e-5 and e_spec > 10 * e_plain


def test_spectral_falls_back_to_the_plain_iteration_when_the_eigensolver_fails() -> None:
    G = torch.randn(16, 48)
    G[3, 5] = float("nan")
    sched = resolve("muon", 16, 48, 5)
    out = spectral_newton_schulz(G, sched, dtype=torch.bfloat16)
    ref = newton_schulz(G, sched, dtype=torch.bfloat16)
    assert out.shape == G.shape
    assert torch.equal(out.isnan(), ref.isnan()) and bool(out.isnan().any())


def test_bfloat16_gram_recursion_would_diverge_without_float32() -> None:
    """Why the Gram recursion runs in float32: in bfloat16 it blows up on a low-rank
    spectrum (the failure this guards against), while ours stays at the plain error."""
    M = _family("lowrank", 64, 256, 0, noise=0.01)
    sched = resolve("polar_express", 64, 256, 5)
    X = M.float().bfloat16()
    A = X @ X.mT
    A = A / torch.diagonal(A).float().sum().bfloat16()
    Q = None
    for k, (a, b, c) in enumerate(sched):
        Z = a * torch.eye(64, dtype=torch.bfloat16) + b * A + c * (A @ A)
        Q = Z if Q is None else Z @ Q
        if k < len(sched) - 1:
            A = Z @ A @ Z
    assert Q is not None
    naive = (Q @ X) / X.float().norm().bfloat16()
    assert _polar_err(naive.float(), M) > 1.0
    assert _polar_err(gram_newton_schulz(M.float(), sched, dtype=torch.bfloat16), M) < 0.3


def test_prefer_gram_policy() -> None:
    assert prefer_gram(768, 3072, torch.float32) and prefer_gram(3072, 768, torch.float32)
    assert not prefer_gram(768, 768, torch.float32)  # square: more flops in Gram space
    assert not prefer_gram(768, 1400, torch.float32)  # below aspect 2
    assert not prefer_gram(16, 4096, torch.float32)  # too small to pay
    assert not prefer_gram(768, 3072, torch.bfloat16)  # measured: no speed gain in bf16


def test_prefer_spectral_policy() -> None:
    cpu, meta = torch.device("cpu"), torch.device("meta")
    bf16, f32 = torch.bfloat16, torch.float32
    assert prefer_spectral(768, 3072, bf16, cpu) and prefer_spectral(2304, 768, bf16, cpu)
    assert prefer_spectral(128, 384, bf16, cpu)  # aspect 3 from m = 128
    assert not prefer_spectral(256, 512, bf16, cpu)  # aspect 2 pays only from m = 512
    assert prefer_spectral(512, 1024, bf16, cpu)
    assert not prefer_spectral(768, 768, bf16, cpu)  # square: the eigensolver costs more
    assert not prefer_spectral(64, 4096, bf16, cpu)  # too small to pay
    assert not prefer_spectral(768, 3072, f32, cpu)  # float32: accuracy (test above)
    assert not prefer_spectral(768, 3072, bf16, meta)  # accelerators: the iteration


def test_direction_auto_takes_the_spectral_form_for_bfloat16_on_the_cpu() -> None:
    G = torch.randn(2, 128, 384)
    sched = resolve("muon", 128, 384, 5)
    auto = direction(G, sched, dtype=torch.bfloat16)
    assert torch.equal(auto, spectral_newton_schulz(G, sched, dtype=torch.bfloat16))
    assert not torch.equal(auto, newton_schulz(G, sched, dtype=torch.bfloat16))
    assert torch.equal(direction(G, sched, dtype=torch.bfloat16, gram=False),
                       newton_schulz(G, sched, dtype=torch.bfloat16))  # fmt: skip


@pytest.mark.parametrize("ns", ITERATIONS)
@pytest.mark.parametrize("shape", [(10, 30), (30, 10), (4, 10, 30)])
def test_coefficient_tensor_equals_schedule(ns: object, shape: tuple[int, ...]) -> None:
    G = torch.randn(*shape)
    sched = resolve("polar_express", shape[-2], shape[-1], 5)
    ref = ns(G, sched)  # type: ignore[operator]
    C = torch.tensor(sched)  # (K, 3)
    torch.testing.assert_close(ns(G, C), ref, atol=1e-5, rtol=1e-5)  # type: ignore[operator]
    batch = shape[0] if len(shape) == 3 else 1
    Cb = C[:, None, :].expand(5, batch, 3)  # (K, batch, 3)
    torch.testing.assert_close(ns(G, Cb), ref, atol=1e-5, rtol=1e-5)  # type: ignore[operator]


@pytest.mark.parametrize("ns", ITERATIONS)
def test_per_matrix_coefficients(ns: object) -> None:
    """Per-matrix (K, batch, 3) coefficients act like separate runs."""
    g = torch.Generator().manual_seed(0)
    low = _family("lowrank", 12, 40, 1).float()  # a few dominant directions
    G = torch.stack([torch.randn(12, 40, generator=g), low, torch.randn(12, 40, generator=g)])
    muon = torch.tensor(resolve("muon", 12, 40, 5))
    pe = torch.tensor(resolve("polar_express", 12, 40, 5))
    C = torch.stack([muon, pe, muon], dim=1)  # (K, 3, 3)
    out = ns(G, C)  # type: ignore[operator]
    for i, sched in enumerate([muon, pe, muon]):
        torch.testing.assert_close(out[i], ns(G[i], sched), atol=1e-5, rtol=1e-5)  # type: ignore[operator]


@pytest.mark.parametrize("ns", ITERATIONS)
def test_bad_coefficients(ns: object) -> None:
    G = torch.randn(3, 8, 12)
    with pytest.raises(ValueError, match="coefficient tensor"):
        ns(G, torch.zeros(5, 4))  # type: ignore[operator]
    with pytest.raises(ValueError, match="coefficient tensor"):
        ns(G, torch.zeros(5, 2, 3))  # type: ignore[operator]
    with pytest.raises(ValueError, match="at least one"):
        ns(G, [])  # type: ignore[operator]


def test_orthogonalize_gram_switch() -> None:
    G = torch.randn(70, 300)
    a = orthogonalize(G, coefficients="muon", gram=False)
    b = orthogonalize(G, coefficients="muon", gram=True)
    c = orthogonalize(G, coefficients="muon")  # auto: Gram for this shape in float32
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(b, c)
