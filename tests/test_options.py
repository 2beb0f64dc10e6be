"""Options whose value depends on the device: ``ns_dtype="auto"`` (the iteration dtype per
device, today float32 everywhere; one table entry flips it) and ``bucket_bytes="auto"``;
and the whole-step capture option."""

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


def test_ns_dtype_default_is_the_studys_choice_and_auto_keeps_its_earlier_meaning() -> None:
    assert ROOT([nn.Parameter(torch.ones(2, 2))]).defaults["ns_dtype"] == "bfloat16"
    # "auto": the earlier default, per device, for configs and checkpoints that name it
    for device, want in (("cpu", "float32"), ("cuda", "bfloat16"), ("meta", "float32")):
        assert _options.ns_dtype_name("auto", torch.device(device)) == want
    assert _options.ns_dtype_name("float32", torch.device("cuda")) == "float32"
    default, fp32, bf16, auto = (
        _run(), _run(ns_dtype="float32"), _run(ns_dtype="bfloat16"), _run(ns_dtype="auto")
    )  # fmt: skip
    assert _same(default, bf16) and not _same(default, fp32) and _same(auto, fp32)
    p = nn.Parameter(torch.randn(24, 40))
    assert {r.key[3] for r in ROOT([p]).coefficient_resolutions()} == {"bfloat16"}
    assert {r.key[3] for r in ROOT([p], ns_dtype="auto").coefficient_resolutions()} == {"float32"}


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


def test_a_cpu_without_bf16_units_is_told_to_iterate_in_float32(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bfloat16 iterations (the default) are emulated on an x86 CPU without AVX-512 BF16 or
    AMX: ROOT says so once, with the option that fixes it; a CPU with them, or float32
    iterations, hear nothing."""
    import warnings

    p = nn.Parameter(torch.randn(24, 40))
    for emulated, ns_dtype, told in (
        (False, "bfloat16", False),
        (True, "float32", False),
        (True, "auto", False),  # float32 on the CPU
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
            assert "ns_dtype='float32'" in said[0] and "optimization.ns_dtype=float32" in said[0]
    _options._warn_emulated_bf16.cache_clear()
