"""Options whose value depends on the device: ``ns_dtype="auto"`` (the iteration dtype per
device: bfloat16 where the hardware multiplies it) and ``bucket_bytes="auto"``; and the
whole-step capture option."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from rootopt import ROOT
from rootopt.optim import _options, functional


def _run(**options: Any) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(s, generator=g)) for s in [(24, 40), (40, 24), (16,)]]
    opt = ROOT(params, lr=0.02, **options)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach() for p in params]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    assert len(a) == len(b)
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def bf16_units(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Set whether this CPU multiplies bfloat16 in hardware (and CUDA devices do)."""

    def set_units(native: bool) -> None:
        monkeypatch.setattr(_options, "_x86", lambda: True)
        monkeypatch.setattr(_options, "cpu_emulates_bf16", lambda: not native)
        monkeypatch.setattr(_options, "_cuda_native_bf16", lambda index: native)

    return set_units


@pytest.mark.filterwarnings("ignore:ROOT. this CPU has no bfloat16")
def test_ns_dtype_auto_is_bfloat16_where_the_hardware_multiplies_it(bf16_units: Any) -> None:
    """The default, "auto": bfloat16 iterations where the device has bf16 units, float32
    where bf16 would be emulated (docs/optimizer.md); explicit dtypes are kept."""
    assert ROOT([nn.Parameter(torch.ones(2, 2))]).defaults["ns_dtype"] == "auto"
    for native, want in ((True, "bfloat16"), (False, "float32")):
        bf16_units(native)
        for device in ("cpu", "cuda"):
            assert _options.ns_dtype_name("auto", torch.device(device)) == want, (native, device)
        assert _options.ns_dtype_name("auto", torch.device("meta")) == "float32"
        assert _options.ns_dtype_name("float32", torch.device("cuda")) == "float32"
        assert _options.ns_dtype_name("bfloat16", torch.device("cpu")) == "bfloat16"
        p = nn.Parameter(torch.randn(24, 40))
        assert {r.key[3] for r in ROOT([p]).coefficient_resolutions()} == {want}
        # the default computes exactly what the dtype it resolves to computes
        default, explicit, other = (
            _run(), _run(ns_dtype=want),
            _run(ns_dtype="float32" if want == "bfloat16" else "bfloat16"),
        )  # fmt: skip
        assert _same(default, explicit) and not _same(default, other)


def test_an_isa_cap_below_bf16_counts_as_emulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN's ISA cap keeps a CPU's bf16 units unused (bf16 products then take 2.5-60x
    float32's time, docs/performance.md): "auto" takes float32 under it."""
    monkeypatch.setattr(_options, "_x86", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    for cap, emulated in (
        (None, False),
        ("ALL", False),
        ("avx512_core_bf16", False),
        ("AVX512_CORE_AMX", False),
        ("AVX512_CORE", True),
        ("AVX2", True),
    ):
        _options.cpu_emulates_bf16.cache_clear()
        if cap is None:
            monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        else:
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert _options.cpu_emulates_bf16() is emulated, cap
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    _options.cpu_emulates_bf16.cache_clear()
    assert _options.cpu_emulates_bf16() is True
    _options.cpu_emulates_bf16.cache_clear()


def test_bucket_bytes_auto_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _options.bucket_budget("auto", torch.device("cpu")) == 32 << 20
    assert _options.bucket_budget("auto", torch.device("meta")) == 1 << 30
    assert _options.bucket_budget(0, torch.device("meta")) == 0
    # The budget is how many same-shape matrices one Newton–Schulz call stacks; it changes
    # how the step runs, never what it computes.
    stacks: list[int] = []
    real = functional.root_direction

    def spy(V: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        stacks.append(V.shape[0])
        return real(V, *args, **kwargs)

    monkeypatch.setattr(functional, "root_direction", spy)

    def run(**options: Any) -> tuple[list[int], list[torch.Tensor]]:
        stacks.clear()
        g = torch.Generator().manual_seed(0)
        params = [nn.Parameter(torch.randn(64, 64, generator=g)) for _ in range(6)]
        for p in params:
            p.grad = torch.randn(64, 64, generator=g)
        ROOT(params, lr=0.02, **options).step()
        return list(stacks), [p.detach() for p in params]

    matrix = 64 * 64 * 4  # bytes of one float32 matrix
    auto, two, none = run(), run(bucket_bytes=2 * matrix), run(bucket_bytes=0)
    assert auto[0] == [6]  # 32 MiB on the CPU: all six in one call
    assert two[0] == [2, 2, 2]
    assert none[0] == [6]  # 0: no limit
    assert _same(auto[1], two[1]) and _same(auto[1], none[1])


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("ns_dtype", "int8", "Invalid ns_dtype"),
        ("bucket_bytes", "big", "Invalid bucket_bytes"),
        ("compile_step", "fast", "Invalid compile_step"),
        ("compile_step", 1, "Invalid compile_step"),
    ],
)
def test_bad_device_options(key: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ROOT([nn.Parameter(torch.randn(4, 4))], **{key: value})


def test_only_an_explicit_emulated_bfloat16_is_warned_about(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On an x86 CPU without AVX-512 BF16 or AMX, bfloat16 iterations are emulated: the
    default ("auto") takes float32 there and says nothing; an explicit bfloat16 is told
    once, with the default that avoids it."""
    import warnings

    p = nn.Parameter(torch.randn(24, 40))
    for emulated, ns_dtype, told in (
        (False, "bfloat16", False),
        (False, "auto", False),
        (True, "float32", False),
        (True, "auto", False),
        (True, "bfloat16", True),
    ):
        _options._warn_emulated_bf16.cache_clear()
        monkeypatch.setattr(_options, "cpu_emulates_bf16", lambda e=emulated: e)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ROOT([p], ns_dtype=ns_dtype)
            ROOT([p], ns_dtype=ns_dtype)  # once per process
        said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(said) == int(told), (emulated, ns_dtype, said)
        if told:
            assert "emulated" in said[0] and "ns_dtype='auto'" in said[0]
    _options._warn_emulated_bf16.cache_clear()


def test_a_group_saved_before_auto_changed_keeps_its_dtype(bf16_units: Any) -> None:
    """A state dict saved before 2026-12-06 has "auto" groups without ``ns_auto``: loaded
    today they iterate as they did then (float32 on the CPU), while new "auto" groups take
    the dtype the hardware multiplies (CHANGELOG.md)."""
    bf16_units(True)
    g = torch.Generator().manual_seed(0)
    p = nn.Parameter(torch.randn(24, 40, generator=g))
    saved = ROOT([p], lr=0.02).state_dict()
    assert all(grp["ns_auto"] == "native" for grp in saved["param_groups"])
    for grp in saved["param_groups"]:
        del grp["ns_auto"]  # as written by that version
    grad = torch.randn(24, 40, generator=g)

    def step(opt_of: Any) -> torch.Tensor:
        q = nn.Parameter(p.detach().clone())
        opt = opt_of(q)
        q.grad = grad.clone()
        opt.step()
        return q.detach()

    def loaded(q: nn.Parameter) -> ROOT:
        opt = ROOT([q], lr=0.02)
        opt.load_state_dict(saved)
        assert _options.group_ns_dtype(opt.param_groups[0], torch.device("cpu")) == "float32"
        return opt

    old = step(loaded)
    assert torch.equal(old, step(lambda q: ROOT([q], lr=0.02, ns_dtype="float32")))
    assert not torch.equal(old, step(lambda q: ROOT([q], lr=0.02)))  # today's auto: bf16
