"""The AdamW update ROOT gives everything that is not a weight matrix (embeddings, heads,
norms, biases): one formula for every path, eager and compiled."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _sqrt(x: float | Tensor) -> float | Tensor:
    return x.sqrt() if isinstance(x, Tensor) else math.sqrt(x)


def adamw_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float | Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One bias-corrected AdamW step for every tensor of the lists, in place, in
    torch.optim.AdamW's formula and order (decoupled decay ``p *= 1 - lr wd`` first).

    ``steps``: each tensor's 0-d step count (float32, on the CPU, as torch.optim keeps it),
    already counting this step. Eagerly the bias corrections are Python numbers read from
    those counts (a CPU read, not a device synchronisation); traced by ``torch.compile`` they
    stay tensor expressions, so the count is data and not a guard that recompiles. State has
    the higher of float32 and the parameter's dtype; a lower-precision parameter is updated
    in float32 and written back once. All tensors on one device.
    """
    if not params:
        return
    beta1, beta2 = betas
    work = [p if p.dtype == m.dtype else p.to(m.dtype) for p, m in zip(params, exp_avgs)]
    grads = [g if g.dtype == m.dtype else g.to(m.dtype) for g, m in zip(grads, exp_avgs)]
    traced = torch.compiler.is_compiling()
    t: list[float] | list[Tensor] = steps if traced else [float(s) for s in steps]
    bc1 = [1 - beta1**s for s in t]
    bc2_sqrt = [_sqrt(1 - beta2**s) for s in t]
    step_size = [-lr / b for b in bc1]
    torch._foreach_mul_(work, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bc2_sqrt)  # type: ignore[arg-type]
    torch._foreach_add_(denom, eps)
    if traced:  # tensor step sizes: folded into the denominators (a list of 0-d tensors)
        torch._foreach_div_(denom, step_size)  # type: ignore[arg-type]
        torch._foreach_add_(work, torch._foreach_div(exp_avgs, denom))
    else:
        torch._foreach_addcdiv_(work, exp_avgs, denom, step_size)  # type: ignore[arg-type]
    for p, w in zip(params, work):
        if w is not p:
            p.copy_(w)
