"""Operations per step on the d = 2048, 8-layer decoder's 32 matrices, counted on meta
tensors (what the step dispatches on an accelerator; ``rootopt_analysis.opcount``): ROOT, with
its threshold and per-matrix coefficient selection, launches no more than
``torch.optim.Muon``, and reads the device once per step (the non-finite check)."""

from __future__ import annotations

import pytest
import torch

from rootopt_analysis.opcount import OpCounter, count_step, optimizer_counts, standard_makers


@pytest.fixture(scope="module")
def counts() -> dict[str, dict[str, object]]:
    return optimizer_counts(standard_makers())


@pytest.mark.parametrize("name", ["root", "root_bf16", "root_muon_mode"])
def test_root_dispatches_no_more_than_torch_muon(
    counts: dict[str, dict[str, int]], name: str
) -> None:
    muon = counts["torch_muon"]
    # torch.optim.Muon: a handful of operations per matrix, 15 of them matmuls
    assert muon["kernels"] >= 32 * 20 and muon["syncs"] == 0
    got = counts[name]
    assert got["kernels"] <= muon["kernels"], (name, got["kernels"], muon["kernels"])
    assert got["ops"] <= muon["ops"], (name, got["ops"], muon["ops"])
    assert got["syncs"] == 1  # the non-finite check
    assert got["kernels"] > 32  # it counted a real step


def test_counter_sees_host_reads_and_views() -> None:
    x = torch.empty(4, 4, device="meta")

    def step() -> None:
        y = x.t() @ x  # a view and a kernel
        assert bool(y.amax() > 0)  # two kernels and a host read, answered "true"

    got = count_step(step, warmup=0)
    assert got["syncs"] == 1
    assert got["kernels"] == 3  # mm, amax, gt
    assert got["ops"] > got["kernels"]
    with OpCounter() as c:
        torch.ones(2).add_(1)
    assert c.syncs == 0 and c.ops["aten.add_"] == 1
