"""Wrap a model for data-parallel training: DDP (replicated) or FSDP2 (sharded)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from torch import nn

from rootopt.distributed.group import world

Parallel = Literal["none", "ddp", "fsdp"]


def wrap_model(
    model: nn.Module,
    mode: Parallel,
    *,
    shard_unit: Callable[[nn.Module], bool] | None = None,
    find_unused_parameters: bool = False,
    broadcast_buffers: bool = True,
) -> nn.Module:
    """Return ``model`` ready for data parallelism over the default process group.

    ``none`` (or a world of one with ``ddp``): unchanged. ``ddp``:
    ``torch.nn.parallel.DistributedDataParallel`` (gradients averaged over ranks; pair it
    with ``DistributedROOT(average_grads=False)``). ``fsdp``: FSDP2's ``fully_shard`` on
    every submodule for which ``shard_unit`` is true (e.g. transformer blocks), then on the
    root; parameters become ``DTensor``s sharded on dim 0. Build the optimizer *after*
    wrapping, from the wrapped model's parameters. ``broadcast_buffers=False`` skips DDP's
    per-forward buffer broadcast (for models whose buffers are constants, e.g. RoPE tables).
    """
    if mode not in ("none", "ddp", "fsdp"):
        raise ValueError(f"parallel mode {mode!r} is unknown; choose none, ddp or fsdp")
    info = world()
    if mode == "none" or (mode == "ddp" and info.world_size == 1):
        return model
    if info.backend is None:
        raise ValueError(f"parallel mode {mode!r} needs a process group; launch with torchrun")
    if mode == "ddp":
        dev = next(model.parameters()).device
        ids = [dev.index] if dev.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(
            model,
            device_ids=ids,
            find_unused_parameters=find_unused_parameters,
            broadcast_buffers=broadcast_buffers,
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dev = next(model.parameters()).device
    mesh = init_device_mesh(dev.type, (info.world_size,))
    if shard_unit is not None:
        for sub in list(model.modules())[1:]:
            if shard_unit(sub):
                fully_shard(sub, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (FSDP2 modules are their own module)."""
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    assert isinstance(inner, nn.Module)
    return inner


__all__ = ["Parallel", "unwrap_model", "wrap_model"]
