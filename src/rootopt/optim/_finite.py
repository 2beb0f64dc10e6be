"""The non-finite gradient policy of a step: one check for every gradient, before anything
is updated."""

from __future__ import annotations

import torch
from torch import Tensor


class NonFiniteGradientError(ValueError):
    """A gradient holds NaN or Inf; nothing was updated."""


def finite_flags(grads: list[Tensor]) -> Tensor:
    """One bool per gradient (on the gradients' device): all its entries finite (an
    empty one, e.g. an FSDP2 shard of no rows, is; neither ``aminmax`` nor the inf-norm
    is defined on it). One read of each gradient and no host synchronisation."""
    full = [i for i, g in enumerate(grads) if g.numel()]  # shapes only: no sync
    ok = torch.ones(len(grads), dtype=torch.bool, device=grads[0].device)
    if not full:
        return ok
    some = [grads[i] for i in full]
    if some[0].device.type == "cpu":
        # min and max, one vectorised pass each gradient (the CPU's inf-norm is not
        # vectorised: 12x slower here); calls cost nothing on the CPU
        ends = [torch.stack(torch.aminmax(g)).float() for g in some]
        flags = torch.stack(ends).isfinite().all(dim=1)
    else:  # one launch for all: max |g| (NaN propagates)
        norms = torch._foreach_norm(some, float("inf"))
        flags = torch.stack([n.to(norms[0].device, torch.float32) for n in norms]).isfinite()
    if len(full) == len(grads):
        return flags
    ok[full] = flags
    return ok


def check_finite(
    grads: list[Tensor], names: list[str], *, skip: bool
) -> tuple[list[bool], float | Tensor]:
    """``(finite per gradient, what the step counts advance by)``.

    Eager: ``max |g|`` per gradient in one ``_foreach`` call (on the CPU: min and max per
    gradient; NaN propagates, ±Inf shows), read with the step's one host synchronisation; a non-finite gradient raises
    :class:`NonFiniteGradientError` naming it, unless ``skip``. In a step traced by
    ``torch.compile`` (``skip=False``): an asynchronous assertion, no host sync and no graph
    break; it precedes every update in the graph, so a failing step changes nothing, and
    the counts advance by the check itself (a compiler may order the CPU counters' update
    before the assertion).
    """
    if not grads:
        return [], 1.0
    ok = finite_flags(grads)
    if torch.compiler.is_compiling() and not skip:
        every = ok.all()
        torch._assert_async(
            every, "non-finite gradient (NaN/Inf) in a parameter; nothing was updated"
        )
        return [True] * len(grads), every.to(torch.float32)
    finite = [bool(f) for f in ok.tolist()]  # the one host sync of the step
    bad = [n for n, f in zip(names, finite) if not f]
    if bad and not skip:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise NonFiniteGradientError(
            f"non-finite gradient (NaN/Inf) in parameter {bad[0]}{more}; nothing was updated"
        )
    return finite, 1.0
