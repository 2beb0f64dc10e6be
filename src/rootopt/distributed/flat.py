"""Collectives on flat buffers cut into one segment per rank, and what a step counts.

A flat buffer holds every rank's segment back to back, in rank order. Gathering gives
every rank the whole buffer; reducing gives each rank the sum of its own segment over the
ranks. Equal segments use the tensor collectives (``all_gather_into_tensor``,
``reduce_scatter_tensor``), uneven ones NCCL's list forms. gloo has no uneven all-gather,
and its reduce-scatter all-reduces the whole input (measured: docs/distributed.md, "Bytes
per step"), so there both are one ``all_to_all_single``. Every collective is counted in
the caller's :class:`StepStats` with the payload bytes this rank sends and receives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from rootopt.distributed.group import PendingCollective, start_collective


@dataclass
class StepStats:
    """What one rank did in the last step: Newton–Schulz work and bytes moved."""

    ns_matrices: int = 0  # matrices thresholded + orthogonalized on this rank
    ns_cost: float = 0.0  # their estimated multiply-adds (owners.ns_cost)
    # seconds in the owner's update (momentum, threshold, Newton–Schulz, decay and step);
    # NaN on the plain single-process step (not timed apart)
    ns_seconds: float = 0.0
    # blocked in this step's collectives: issuing them and waiting for them (compute they
    # overlap not included; group.blocked_seconds), and the step's wall time from the
    # gradient synchronisation on (a closure's forward/backward included)
    comm_seconds: float = 0.0
    seconds: float = 0.0
    bytes_sent: int = 0  # per rank, payload only (collective algorithms add their own)
    bytes_received: int = 0
    collectives: dict[str, int] = field(default_factory=dict)
    # buckets whose gradient reduce-scatter started during backward (the others started
    # when the gradients were synchronised)
    in_backward: int = 0

    def count(self, op: str, sent: int, received: int) -> None:
        self.collectives[op] = self.collectives.get(op, 0) + 1
        self.bytes_sent += sent
        self.bytes_received += received


def backend(group: dist.ProcessGroup | None) -> str:
    return str(dist.get_backend(group))


def start_gather(
    send: Tensor,
    segments: Sequence[int],
    rank: int,
    group: dist.ProcessGroup | None,
    stats: StepStats,
    name: str,
) -> tuple[Tensor, PendingCollective]:
    """Start gathering every rank's segment, concatenated in rank order; ``out`` is valid
    after ``wait()``."""
    world_size = len(segments)
    total = sum(segments)
    out = torch.empty(total, dtype=send.dtype, device=send.device)
    e = send.element_size()
    seg = segments[rank]
    if len(set(segments)) == 1:
        work = start_collective(name, dist.all_gather_into_tensor, out, send, group=group)
        stats.count("all_gather", e * seg * (world_size - 1), e * seg * (world_size - 1))
    elif backend(group) == "gloo":
        inp = send.repeat(world_size)
        work = start_collective(
            name, dist.all_to_all_single, out, inp, list(segments), [seg] * world_size,
            group=group,
        )  # fmt: skip
        work.keep = (inp,)
        stats.count("all_to_all", e * seg * (world_size - 1), e * (total - seg))
    else:
        work = start_collective(
            name, dist.all_gather, list(out.split_with_sizes(list(segments))), send, group=group
        )
        stats.count("all_gather", e * seg * (world_size - 1), e * (total - seg))
    work.keep += (send,)  # read by the collective until it completes
    return out, work


def gather(
    send: Tensor,
    segments: Sequence[int],
    rank: int,
    group: dist.ProcessGroup | None,
    stats: StepStats,
    name: str,
) -> Tensor:
    """:func:`start_gather`, waited for."""
    out, work = start_gather(send, segments, rank, group, stats, name)
    work.wait()
    return out


def start_reduce_scatter(
    flat: Tensor,
    segments: Sequence[int],
    rank: int,
    group: dist.ProcessGroup | None,
    stats: Callable[[], StepStats],
) -> Callable[[], Tensor]:
    """Start reducing every rank's ``flat`` to this rank's segment of the sum; returns what
    waits and gives that segment divided by the world size (the mean gradient). The bytes
    are counted in ``stats()`` when it is waited for: the statistics of the step that uses
    the sum, even when backward started it."""
    world_size = len(segments)
    seg = segments[rank]
    e = flat.element_size()
    name = "reduce_scatter gradients to owners"
    gloo = backend(group) == "gloo"
    if gloo:
        out = torch.empty(world_size * seg, dtype=flat.dtype, device=flat.device)
        work = start_collective(
            name, dist.all_to_all_single, out, flat, [seg] * world_size, list(segments),
            group=group,
        )  # fmt: skip
        counted = ("all_to_all", e * (flat.numel() - seg), e * seg * (world_size - 1))
    else:
        out = torch.empty(seg, dtype=flat.dtype, device=flat.device)
        if len(set(segments)) == 1:
            work = start_collective(name, dist.reduce_scatter_tensor, out, flat, group=group)
        else:
            work = start_collective(
                name, dist.reduce_scatter, out, list(flat.split_with_sizes(list(segments))),
                group=group,
            )  # fmt: skip
        counted = ("reduce_scatter", e * (flat.numel() - seg), e * (flat.numel() - seg))
    work.keep = (flat,)  # read by the collective until it completes

    def finish() -> Tensor:
        work.wait()
        stats().count(*counted)
        summed = out.view(world_size, seg).sum(0) if gloo else out
        return summed.div_(world_size)

    return finish
