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


def test_ns_dtype_auto_is_the_studys_choice_per_device_and_flips_in_one_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert ROOT([nn.Parameter(torch.ones(2, 2))]).defaults["ns_dtype"] == "auto"
    for device, want in (("cpu", "float32"), ("cuda", "bfloat16"), ("meta", "float32")):
        assert _options.ns_dtype_name("auto", torch.device(device)) == want
    assert _options.ns_dtype_name("bfloat16", torch.device("cuda")) == "bfloat16"
    auto, fp32, bf16 = _run(), _run(ns_dtype="float32"), _run(ns_dtype="bfloat16")
    assert _same(auto, fp32) and not _same(auto, bf16)
    # the evidence study's decision is one entry of the table (here for the CPU)
    monkeypatch.setitem(_options.AUTO_NS_DTYPE, "cpu", "bfloat16")
    assert _same(_run(), bf16)
    p = nn.Parameter(torch.randn(24, 40))
    opt = ROOT([p])
    assert {r.key[3] for r in opt.coefficient_resolutions()} == {"bfloat16"}


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
