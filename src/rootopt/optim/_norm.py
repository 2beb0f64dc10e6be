"""The squared L2 norm of many tensors, accurate in float32 whatever their sizes.

torch's float32 norm kernels on the CPU (``torch.linalg.vector_norm``, ``_foreach_norm``,
``torch.nn.utils.get_total_norm``) accumulate a tensor in float32 lanes, so their relative
error grows with its length: -1.1e-5 at 2^20 entries and -8.4e-5 at 2^22 against float64,
-9.6e-8 at 2^15 (measured on normal entries). The error also depends on how a tensor is cut:
a global gradient norm over one process's tensors and over the parts two ranks own differed by
4.6e-5 on a model with an 8,192 × 128 embedding, and so did the clip scale of every clipped
step (docs/distributed.md, "Limits"). Cut into chunks of at most :data:`CHUNK` entries, each
float32 norm is within about 3e-8, and the chunks are summed in float64.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

CHUNK = 1 << 14


def sum_of_squares(tensors: Sequence[Tensor]) -> Tensor:
    """Σ ‖t‖² over ``tensors`` as a float64 0-d tensor on their device (a zero on the CPU
    for none); NaN/Inf propagate. Entries are read as float32 (views, no copy for float32
    tensors)."""
    pieces: list[Tensor] = []
    for t in tensors:
        if t.numel():
            pieces += torch.split(t.detach().float().reshape(-1), CHUNK)
    if not pieces:
        return torch.zeros((), dtype=torch.float64)
    norms = torch._foreach_norm(pieces, 2.0)
    return torch.stack(norms).double().square().sum()


def clip_coefficient(max_norm: float, norm: Tensor) -> Tensor:
    """``min(1, max_norm / (norm + 1e-6))``, a 0-d tensor beside ``norm`` (no host
    synchronisation): the coefficient of ``torch.nn.utils.clip_grads_with_norm_``."""
    return torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)


def clip_grads_(grads: Sequence[Tensor], max_norm: float, norm: Tensor) -> None:
    """Scale ``grads`` in place by :func:`clip_coefficient`: ``torch.nn.utils.clip_grads_with_norm_``
    on gradient tensors that need not be a parameter's ``.grad`` (the parts of the gradients
    a rank owns, FSDP2's local shards), one foreach multiply per device and dtype as torch
    groups them."""
    coef = clip_coefficient(max_norm, norm)
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), same in groups.items():
        torch._foreach_mul_(same, coef.to(device))
