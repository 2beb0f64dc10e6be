"""Independent transcriptions used as test oracles (not imported by the library).

``official_root_step`` follows the update of the paper's official code (arXiv 2511.20626)
line by line, with torch.quantile and the explicit sign/relu form of the soft threshold,
one 2-D matrix at a time.
"""

from __future__ import annotations

import math

import torch

MUON = (3.4445, -4.7750, 2.0315)
TABLE = {
    (2048, 2048): (3.4916, -4.8224, 2.1095),
    (2048, 3072): (3.4509, -4.5790, 1.9325),
    (2048, 8192): (2.9794, -3.6674, 1.6207),
    (2048, 16384): (3.1943, -3.8221, 1.5322),
}


def official_direction(v: torch.Tensor, *, ns_steps: int = 5, q: float = 0.90) -> torch.Tensor:
    rows, cols = v.shape
    eps = torch.quantile(v.abs().float().flatten(), q) + 1e-9
    outlier = torch.sign(v) * torch.relu(v.abs() - eps)
    B = v - outlier
    X = B.T if rows > cols else B
    X = X / (torch.linalg.norm(X) + 1e-7)
    a, b, c = TABLE.get((min(rows, cols), max(rows, cols)), MUON)
    for _ in range(ns_steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if rows > cols else X


def official_root_step(
    p: torch.Tensor,
    g: torch.Tensor,
    buf: torch.Tensor,
    *,
    lr: float = 1e-3,
    wd: float = 0.1,
    mu: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
) -> None:
    """In place on ``p`` and ``buf``."""
    buf.mul_(mu).add_(g)
    v = g + mu * buf if nesterov else buf.clone()
    U = official_direction(v, ns_steps=ns_steps)
    rows, cols = p.shape
    p.mul_(1 - lr * wd)
    p.sub_(lr * 0.2 * math.sqrt(max(rows, cols)) * U)
