"""How a step's gradients become the gradients the update reads: one object per mode.

* :class:`DDPSync`: every rank holds every averaged gradient in ``p.grad`` — one process,
  or ``DistributedDataParallel``, whose all-reduces run during backward.
* :class:`OwnerSync`: ROOT and Muon under ``ddp`` at world size > 1, no DDP wrapper:
  ``DistributedROOT(average_grads=True)`` reduce-scatters the gradients to their owner ranks
  during backward, and unscales, checks and clips the parts each rank owns (ZeRO style;
  docs/distributed.md, "Training under torchrun").
* :class:`FSDPSync`: FSDP2 (``distributed.parallel: fsdp``), whose reduce-scatters in
  backward leave each rank the shards of its gradients (``DTensor``).

The step reads the same way in every mode (:func:`rootopt.train.step.train_step`): the
micro-batches, all but the last under :meth:`~GradSync.no_sync`; :meth:`~GradSync.finish`
(unscaled, the global norm); clipping of :meth:`~GradSync.clip_targets`; the optimizer step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from rootopt.train.schedule import _is_dtensor, global_grad_norm

if TYPE_CHECKING:
    from rootopt.config import Config
    from rootopt.train.build import Precision


class GradSync:
    """One mode of gradient synchronisation (see the module docstring)."""

    # each rank holds a part of the gradients: statistics over them are reduced over ranks
    partial = False
    # the optimizer unscales and checks the gradients itself, so the dynamic loss scale
    # learns the outcome every rank agreed on (Precision.step / skip with agreed=True)
    agreed = False

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]

    def no_sync(self, *, last: bool) -> contextlib.AbstractContextManager[Any]:
        """Around one micro-batch's forward and backward: gradients are synchronised on the
        step's last micro-batch only (accumulated locally before)."""
        return contextlib.nullcontext()

    def collectives(self, phase: str) -> contextlib.AbstractContextManager[Any]:
        """Around the model's ``phase`` ("forward", "backward"): where the model itself runs
        collectives, a failure there becomes one line naming rank and operation."""
        return contextlib.nullcontext()

    def finish(self, precision: Precision) -> Tensor:
        """The synchronised gradients unscaled (``precision``'s loss scale) and their
        global L2 norm, a 0-d tensor, the same on every rank; non-finite when a gradient is
        on some rank (the step reads it with the loss in its one host synchronisation)."""
        precision.unscale(self.optimizer, self.params)
        return global_grad_norm(self.params)

    def clip_targets(self) -> list[Tensor]:
        """The gradient tensors the update reads, after :meth:`finish`: scaling them
        scales the update (clipping); on each rank its part where :attr:`partial`."""
        return [p.grad for p in self.params if p.grad is not None]

    def comm_bytes(self) -> float | None:
        """Bytes this rank sent for the last step's gradient and parameter
        synchronisation; None where it is not counted."""
        return None


class DDPSync(GradSync):
    """One process, or :class:`torch.nn.parallel.DistributedDataParallel`."""

    def no_sync(self, *, last: bool) -> contextlib.AbstractContextManager[Any]:
        if not last and isinstance(self.model, nn.parallel.DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def collectives(self, phase: str) -> contextlib.AbstractContextManager[Any]:
        if not isinstance(self.model, nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext()  # one process: no collective
        what = "DDP forward" if phase == "forward" else "DDP gradient all-reduce (backward)"
        return _described(what)

    def comm_bytes(self) -> float | None:
        """From DDP's gradient buckets (``bucket_sizes``): one ring all-reduce each,
        ``2·(W−1)/W`` of the bucket's bytes. None in one process."""
        model = self.model
        if not isinstance(model, nn.parallel.DistributedDataParallel):
            return None
        W = torch.distributed.get_world_size()
        sizes = str(model._get_ddp_logging_data().get("bucket_sizes", ""))  # type: ignore[no-untyped-call]
        total = sum(int(x) for x in sizes.split(",") if x.strip())
        if not total:  # no bucket recorded: every gradient once
            total = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        return 2 * (W - 1) / W * total


class OwnerSync(GradSync):
    """``DistributedROOT(average_grads=True)``: the optimizer synchronises the gradients
    (docs/distributed.md, "Gradients inside the step")."""

    partial = True
    agreed = True

    def no_sync(self, *, last: bool) -> contextlib.AbstractContextManager[Any]:
        # DistributedROOT.no_sync: no reduce-scatter starts before the last backward
        return contextlib.nullcontext() if last else self.optimizer.no_sync()  # type: ignore[attr-defined,no-any-return]

    # collectives: without a DDP wrapper forward runs none, and the reduce-scatters that
    # backward starts fail as the optimizer's own CollectiveError lines

    def finish(self, precision: Precision) -> Tensor:
        """``DistributedROOT.sync_grads``: the reduce-scatters finished (buckets that did not
        start in backward start here, in the same order on every rank: call it before any
        other collective of the step), unscaled, checked, and the norm in one all-reduce."""
        return self.optimizer.sync_grads(inv_scale=precision.inv_scale())  # type: ignore[attr-defined,no-any-return]

    def clip_targets(self) -> list[Tensor]:
        return self.optimizer.owned_grads()  # type: ignore[attr-defined,no-any-return]

    def comm_bytes(self) -> float | None:
        """Counted at the optimizer's collectives (``DistributedROOT.stats``)."""
        return float(self.optimizer.stats.bytes_sent)  # type: ignore[attr-defined]


class FSDPSync(GradSync):
    """FSDP2: each rank holds the shards of every gradient (``DTensor``); its own
    collectives are not counted."""

    partial = True

    def collectives(self, phase: str) -> contextlib.AbstractContextManager[Any]:
        what = (
            "FSDP2 parameter all-gather (forward)"
            if phase == "forward"
            else "FSDP2 gradient reduce-scatter (backward)"
        )
        return _described(what)

    def finish(self, precision: Precision) -> Tensor:
        norm = super().finish(precision)
        # the norm of sharded gradients is a replicated DTensor (torch's get_total_norm)
        return norm.full_tensor() if _is_dtensor(norm) else norm  # type: ignore[attr-defined,no-any-return]

    def clip_targets(self) -> list[Tensor]:
        """This rank's shards of the gradients (their storage: scaling them scales the
        DTensors)."""
        with torch.no_grad():
            return [_local(g) for g in super().clip_targets()]


def grad_sync(
    cfg: Config, model: nn.Module, optimizer: torch.optim.Optimizer, world_size: int
) -> GradSync:
    """The mode of this run: the optimizer's own synchronisation where it does it
    (``DistributedROOT(average_grads=True)`` at world size > 1:
    :func:`rootopt.train.build.optimizer_syncs_grads`), FSDP2's, or DDP's (one process
    included)."""
    if world_size > 1 and bool(getattr(optimizer, "average_grads", False)):
        return OwnerSync(model, optimizer)
    if world_size > 1 and cfg.distributed.parallel == "fsdp":
        return FSDPSync(model, optimizer)
    return DDPSync(model, optimizer)


@contextlib.contextmanager
def _described(what: str) -> Iterator[None]:
    """A failure in the model's collectives as one line naming rank and operation, a
    timeout told apart by the elapsed time (:func:`rootopt.distributed.describe_failure`),
    never by the error's text."""
    from rootopt.distributed import CollectiveError, describe_failure

    start = time.monotonic()
    try:
        yield
    except (torch.OutOfMemoryError, CollectiveError):
        raise
    except RuntimeError as exc:  # gloo reports a timed-out send/recv as a plain RuntimeError
        raise describe_failure(what, exc, time.monotonic() - start) from exc


def _local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (FSDP2); ``t`` itself otherwise."""
    return t.to_local() if _is_dtensor(t) else t  # type: ignore[attr-defined, no-any-return]
