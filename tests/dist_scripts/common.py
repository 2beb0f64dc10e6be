"""Shared pieces of the distributed test workers (run under torchrun, gloo, CPU)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class Net(nn.Module):
    """Small model with the awkward shapes of docs/distributed.md's test matrix: rows not
    divisible by the world size (10, 33), a matrix smaller than the world (2 x 10,
    1 x 2), a 3-D stack, an embedding, biases and a parameter that never gets a
    gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 16)
        self.w4 = nn.Parameter(torch.randn(33, 16) / 4)
        self.w1 = nn.Parameter(torch.randn(10, 33) / 6)
        self.b1 = nn.Parameter(torch.zeros(10))
        self.w3 = nn.Parameter(torch.randn(2, 10, 10) / 3)
        self.w2 = nn.Parameter(torch.randn(2, 10) / 3)
        self.w5 = nn.Parameter(torch.randn(1, 2))
        self.unused = nn.Parameter(torch.randn(4, 4))

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh((self.emb(ids) + x) @ self.w4.T)
        h = torch.tanh(h @ self.w1.T + self.b1)
        h = torch.tanh(h @ self.w3[0].T)
        h = torch.tanh(h @ self.w3[1].T)
        out: torch.Tensor = (h @ self.w2.T) @ self.w5.T
        return out


ROOT_NAMES = ("w4", "w1", "w3", "w2", "w5", "unused")
# float32 iterations (not bfloat16, the default on a device with bf16 units): the ranks are
# compared with one process to float32 rounding, and the counted bytes assume float32 updates
HYPER: dict[str, Any] = dict(
    lr=0.02, weight_decay=0.1, outlier_quantile=0.9, momentum=0.9, ns_dtype="float32"
)


def groups(model: nn.Module) -> list[dict[str, Any]]:
    named = dict(model.named_parameters())
    root = [n for n in named if n.split(".")[-1] in ROOT_NAMES]
    adamw = [n for n in named if n not in root]
    return [
        {"params": [named[n] for n in root], "param_names": root, "algorithm": "root"},
        {"params": [named[n] for n in adamw], "param_names": adamw, "algorithm": "adamw"},
    ]


def global_batch(step: int, size: int = 12) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, 5, (size,), generator=g)
    x = torch.randn(size, 16, generator=g)
    y = torch.randn(size, 1, generator=g)
    return ids, x, y


def make_model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def write(out_dir: str, name: str, payload: dict[str, Any]) -> None:
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out_dir, f"{name}-rank{rank}.json"), "w") as fh:
        json.dump(payload, fh)


def refused(build: Callable[[], object]) -> str:
    """The one-line ValueError ``build()`` raises ("" when it does not)."""
    try:
        build()
    except ValueError as exc:
        return str(exc)
    return ""
