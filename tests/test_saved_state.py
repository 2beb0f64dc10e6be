"""State written by an earlier version still loads and continues the same run.

``tests/data/saved_state_fdcf298.pt`` and ``tests/data/saved_dcp_fdcf298/`` were written by
rootopt at commit fdcf298 (``tests/data/make_saved_state.py``): the state dicts of four
optimizers after two steps, and what that version computed for the two steps after. Loaded
here into freshly built optimizers, the next two steps must give the same parameters up to
float round-off (the update was reorganised, not changed) as that version computes them
without AdaNewton's per-matrix selector (``tests/data/after_without_selector_fdcf298.pt``),
which was removed since (docs/adanewton.md)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

DATA = Path(__file__).resolve().parent / "data"
sys.path.insert(0, str(DATA))

from make_saved_state import Mixed, grads, optimizers  # noqa: E402

SAVED = torch.load(DATA / "saved_state_fdcf298.pt", weights_only=True)
AFTER = torch.load(DATA / "after_without_selector_fdcf298.pt", weights_only=True)["after"]


def _continue(model: Mixed, opt: torch.optim.Optimizer) -> None:
    for step in range(2, 4):
        grads(model, step)
        opt.step()


def _assert_after(model: Mixed, after: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert sorted(got) == sorted(after)
    for k, v in after.items():
        assert got[k].dtype == v.dtype, k
        torch.testing.assert_close(got[k], v, atol=1e-5, rtol=1e-5, msg=k)


@pytest.mark.parametrize("name", ["auto", "explicit", "robust_reference", "distributed"])
def test_state_dict_saved_by_the_earlier_version_loads_and_continues(name: str) -> None:
    run: dict[str, Any] = SAVED["runs"][name]
    model = Mixed()
    model.load_state_dict(run["model"])
    opt = optimizers()[name](model)
    opt.load_state_dict(run["optim"])
    # state is kept at the higher of float32 and the parameter's dtype
    for p in model.parameters():
        for key, value in opt.state[p].items():
            if key != "step":
                assert value.dtype == torch.promote_types(p.dtype, torch.float32), key
    _continue(model, opt)
    _assert_after(model, AFTER[name])
    # moved: the comparison is not between two untouched models
    assert (model.w1 - run["model"]["w1"]).abs().max() > 1e-3


def test_dcp_checkpoint_saved_by_the_earlier_version_loads_and_continues() -> None:
    from rootopt.distributed import checkpoint as dck

    model = Mixed()
    opt = optimizers()["distributed"](model)
    step, extra = dck.load(DATA / "saved_dcp_fdcf298" / "dcp-00000002", model, opt)
    assert step == 2 and extra == {"data_step": 2}
    _continue(model, opt)
    _assert_after(model, AFTER["distributed"])
