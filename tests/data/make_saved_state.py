"""Writes ``saved_state_fdcf298.pt`` and ``saved_dcp_fdcf298/``: optimizer state saved by
rootopt at commit fdcf298 (before the one-update refactor), so that
``tests/test_saved_state.py`` can check that state dicts and DCP checkpoints written by that
version still load and continue the same run.

Run from the repository root, with that version's ``src`` on ``PYTHONPATH``:
``python tests/data/make_saved_state.py tests/data``. Not run by the test suite.

``after_without_selector_fdcf298.pt``: the two steps after the saved state as the same
version computes them without AdaNewton's per-matrix selector, which was removed later
(docs/adanewton.md); with it, every AdaNewton matrix took a rescaled first step. Written by
``python tests/data/make_saved_state.py --continue-without-selector tests/data`` with that
version's ``src`` on ``PYTHONPATH`` and its ``src/rootopt/coeffs/data/adanewton_selector.json``
deleted (that version then resolves no selector: the plain table schedule of each shape).
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn


class Mixed(nn.Module):
    """Matrices, a 3-D stack, a bf16 matrix, a float64 matrix, biases."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(16, 8, generator=g))
        self.b1 = nn.Parameter(torch.randn(16, generator=g))
        self.w2 = nn.Parameter(torch.randn(4, 16, generator=g))
        self.stack = nn.Parameter(torch.randn(2, 6, 10, generator=g))
        self.low = nn.Parameter(torch.randn(6, 12, generator=g).bfloat16())
        self.wide = nn.Parameter(torch.randn(5, 20, generator=g).double())


def grads(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def optimizers() -> dict[str, Any]:
    import rootopt
    from rootopt.distributed import DistributedROOT

    def explicit(m: Mixed) -> Any:
        return rootopt.ROOT(
            [
                {"params": [m.w1, m.stack], "algorithm": "root", "ns_coefficients": "muon"},
                {"params": [m.w2, m.low, m.wide], "algorithm": "root", "lr": 0.01},
                {"params": [m.b1], "algorithm": "adamw"},
            ],
            lr=0.02,
        )

    return {
        "auto": lambda m: rootopt.ROOT(m.parameters(), lr=0.02),
        "explicit": explicit,
        "robust_reference": lambda m: rootopt.ROOT(
            m.parameters(), lr=0.02, robust_scaling=True, batched=False, nesterov=False
        ),
        "distributed": lambda m: DistributedROOT(m.parameters(), lr=0.02),
    }


def main(out: Path) -> None:
    import rootopt
    from rootopt.distributed import checkpoint as dck

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    saved: dict[str, Any] = {"commit": commit, "version": rootopt.__version__, "runs": {}}
    for name, make in optimizers().items():
        torch.manual_seed(0)
        model = Mixed()
        opt = make(model)
        for step in range(2):
            grads(model, step)
            opt.step()
        entry = {
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": copy.deepcopy(opt.state_dict()),  # not the live tensors
        }
        if name == "distributed":
            dck.save(out / "saved_dcp_fdcf298", 2, model, opt, extra={"data_step": 2})
        # the next two steps, as that version computes them
        for step in range(2, 4):
            grads(model, step)
            opt.step()
        entry["after"] = {k: v.clone() for k, v in model.state_dict().items()}
        saved["runs"][name] = entry
    torch.save(saved, out / "saved_state_fdcf298.pt")


def continue_without_selector(out: Path) -> None:
    """The continuation of every saved run, loaded from ``saved_state_fdcf298.pt``."""
    from rootopt.coeffs.adanewton import load_selector_data

    if load_selector_data() is not None:
        raise SystemExit("delete adanewton_selector.json from that version's src first")
    saved = torch.load(out / "saved_state_fdcf298.pt", weights_only=True)
    after: dict[str, Any] = {}
    for name, make in optimizers().items():
        run = saved["runs"][name]
        model = Mixed()
        model.load_state_dict(run["model"])
        opt = make(model)
        opt.load_state_dict(run["optim"])
        for step in range(2, 4):
            grads(model, step)
            opt.step()
        after[name] = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(
        {"commit": saved["commit"], "after": after}, out / "after_without_selector_fdcf298.pt"
    )


if __name__ == "__main__":
    if sys.argv[1] == "--continue-without-selector":
        continue_without_selector(Path(sys.argv[2]))
    else:
        main(Path(sys.argv[1]))
