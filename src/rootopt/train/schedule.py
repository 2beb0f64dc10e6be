"""Learning-rate schedules (multipliers of ``base_lr``) and gradient clipping.

See docs/training.md, "Schedules, clipping, accumulation".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from rootopt.optim._norm import clip_grads_, sum_of_squares


class LRMultiplier:
    """``step -> lr / base_lr``: linear warmup, then cosine / linear decay to ``min_ratio``, or constant.

    A callable object (not a closure) so ``LambdaLR.state_dict`` can save it.
    """

    def __init__(self, kind: str, *, warmup: int, total: int, min_ratio: float) -> None:
        self.kind, self.warmup, self.total, self.min_ratio = kind, warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if self.warmup and step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        if self.kind == "cosine":
            return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0 - (1 - self.min_ratio) * progress


def global_grad_norm(params: Iterable[Tensor]) -> Tensor:
    """L2 norm over all gradients, a float32 0-d tensor (inf/nan propagate), summed in
    chunks (:func:`rootopt.optim._norm.sum_of_squares`) so that it is accurate to float32
    and the same however the gradients are cut across ranks; FSDP2's sharded gradients
    (DTensors) through ``torch.nn.utils.get_total_norm``."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if any(_is_dtensor(g) for g in grads):
        return torch.nn.utils.get_total_norm([g.float() for g in grads], 2.0)
    return sum_of_squares(grads).sqrt().float()


def _is_dtensor(t: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class GradClipper:
    """Clip by value, by global norm, or adaptively against a running norm.

    ``adaptive`` (docs/training.md, made self-tuning): the threshold is
    ``min(max_norm, factor × EMA(grad norm))`` once the EMA has warmed up; the EMA state is
    part of checkpoints via :meth:`state_dict`.
    """

    def __init__(
        self, mode: str, *, max_norm: float, value: float, beta: float, factor: float
    ) -> None:
        self.mode, self.max_norm, self.value, self.beta, self.factor = (
            mode,
            max_norm,
            value,
            beta,
            factor,
        )
        self.ema = 0.0
        self.count = 0

    def threshold(self) -> float:
        if self.mode == "adaptive" and self.count >= 10:
            debiased = self.ema / (1 - self.beta**self.count)
            return min(self.max_norm, self.factor * debiased)
        return self.max_norm

    def __call__(self, grads: Sequence[Tensor], norm: Tensor) -> float:
        """Clip ``grads`` in place given their pre-clip global ``norm``; return the scale
        applied (1 = none).

        ``grads``: the gradient tensors the update reads (``p.grad``, or on each rank the
        parts it owns or holds: :meth:`rootopt.train.sync.GradSync.clip_targets`), clipped
        with the arithmetic of torch's ``clip_grad_value_`` / ``clip_grads_with_norm_``
        (:func:`rootopt.optim._norm.clip_grads_`)."""
        if self.mode == "none":
            return 1.0
        if self.mode == "value":
            if grads:
                torch._foreach_clamp_min_(list(grads), -self.value)
                torch._foreach_clamp_max_(list(grads), self.value)
            return 1.0
        limit = self.threshold()
        n = float(norm)
        if self.mode == "adaptive":
            self.ema = self.beta * self.ema + (1 - self.beta) * n
            self.count += 1
        scale = limit / (n + 1e-6)
        if scale < 1.0:
            clip_grads_(grads, limit, norm)
            return scale
        return 1.0

    def state_dict(self) -> dict[str, float]:
        return {"ema": self.ema, "count": float(self.count)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.ema, self.count = float(state["ema"]), int(state["count"])
