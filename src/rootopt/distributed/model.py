"""Wrap a model for data-parallel training: DDP (replicated) or FSDP2 (sharded)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from rootopt.distributed.group import collective, world

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
    with ``DistributedROOT(average_grads=False)``, or better leave the model unwrapped,
    :func:`broadcast_parameters`, and let ``DistributedROOT(average_grads=True)``
    synchronise the gradients at DDP AdamW's bytes). ``fsdp``: FSDP2's ``fully_shard`` on
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


@torch.no_grad()
def broadcast_parameters(model: nn.Module, src: int = 0) -> None:
    """Give every rank rank ``src``'s parameters and buffers, as DDP does when it wraps a
    model: for a loop without DDP, where ``DistributedROOT(average_grads=True)``
    synchronises the gradients. One broadcast per dtype and device of the flattened
    tensors; nothing at world size 1."""
    if world().world_size == 1:
        return
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in (*model.parameters(), *model.buffers()):
        if t.numel():
            by_kind.setdefault((t.dtype, t.device), []).append(t)
    for tensors in by_kind.values():
        flat = torch.cat([t.reshape(-1) for t in tensors])
        collective("broadcast initial parameters", dist.broadcast, flat, src=src)
        off = 0
        for t in tensors:
            t.copy_(flat[off : off + t.numel()].view_as(t))
            off += t.numel()


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (FSDP2 modules are their own module)."""
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    assert isinstance(inner, nn.Module)
    return inner


__all__ = ["Parallel", "broadcast_parameters", "unwrap_model", "wrap_model"]
