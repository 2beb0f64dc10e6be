"""A data order that does not depend on the world size.

One global sample order per epoch (a seeded permutation of ``range(num_samples)``); the
global batch of step ``t`` is the ``t``-th block of ``global_batch_size`` indices of that
order (an epoch's incomplete last block is dropped); rank ``r`` of ``W`` takes the
``r``-th contiguous part of the block (``torch.tensor_split`` sizes, so parts differ by at
most one when ``W`` does not divide the batch), and a data-loader worker the same way
inside its rank's part. So the ranks' parts cover the global batch with no overlap and no
gap, the global batch at step ``t`` is the same for every world size, and resuming at any
step, at any world size, continues the same sequence (docs/distributed.md).

When parts are uneven, weight each rank's mean loss by :meth:`GlobalBatchSampler.loss_weight`
so that DDP's average over ranks is the mean over the global batch.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

_EPOCH_STRIDE = 0x9E3779B97F4A7C15  # odd 64-bit constant: distinct seeds per (seed, epoch)


def split_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` when ``n`` items are cut into ``parts``
    contiguous parts like ``torch.tensor_split`` (the first ``n % parts`` get one more)."""
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"part {index} of {parts} does not exist")
    q, r = divmod(n, parts)
    start = index * q + min(index, r)
    return start, start + q + (1 if index < r else 0)


def worker_share(indices: list[int], worker_id: int, num_workers: int) -> list[int]:
    """Worker ``worker_id``'s contiguous part of a rank's indices (for iterable datasets;
    with ``DataLoader(batch_sampler=...)`` each worker already receives whole batches)."""
    start, stop = split_bounds(len(indices), num_workers, worker_id)
    return indices[start:stop]


class GlobalBatchSampler(Sampler[list[int]]):
    """Batch sampler yielding this rank's indices of each global batch, from
    ``start_step`` for ``num_steps`` steps (``None``: without end).

    Use as ``DataLoader(dataset, batch_sampler=GlobalBatchSampler(...))``. ``state_dict``
    / ``load_state_dict`` carry the next global step and nothing rank-specific, so a
    resumed run may use another world size.
    """

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        start_step: int = 0,
        num_steps: int | None = None,
    ) -> None:
        for name, value, low in (
            ("num_samples", num_samples, 1),
            ("global_batch_size", global_batch_size, 1),
            ("world_size", world_size, 1),
            ("start_step", start_step, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if global_batch_size > num_samples:
            raise ValueError(
                f"global_batch_size {global_batch_size} exceeds the {num_samples} samples"
            )
        if global_batch_size < world_size:
            raise ValueError(
                f"global_batch_size {global_batch_size} is smaller than the world size "
                f"{world_size}: some rank would get no sample"
            )
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        if num_steps is not None and (not isinstance(num_steps, int) or num_steps < 0):
            raise ValueError(f"num_steps must be an integer >= 0 or None, got {num_steps!r}")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = int(seed)
        self.shuffle = shuffle
        self.step = start_step
        self.num_steps = num_steps
        self.steps_per_epoch = num_samples // global_batch_size
        self._order: tuple[int, torch.Tensor] | None = None

    def order(self, epoch: int) -> torch.Tensor:
        """The global sample order of ``epoch``."""
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed((self.seed + epoch * _EPOCH_STRIDE) % (1 << 63))
                perm = torch.randperm(self.num_samples, generator=gen)
            else:
                perm = torch.arange(self.num_samples)
            self._order = (epoch, perm)
        return self._order[1]

    def global_batch(self, step: int) -> list[int]:
        """All indices of global step ``step`` (every rank's part, in rank order)."""
        epoch, block = divmod(step, self.steps_per_epoch)
        b = self.global_batch_size
        out: list[int] = self.order(epoch)[block * b : (block + 1) * b].tolist()
        return out

    def local_batch(self, step: int) -> list[int]:
        """This rank's part of global step ``step``."""
        start, stop = split_bounds(self.global_batch_size, self.world_size, self.rank)
        return self.global_batch(step)[start:stop]

    def loss_weight(self) -> float:
        """``n_rank · W / B``: multiply this rank's mean loss by it so that the average
        over ranks (DDP) equals the mean over the global batch (1.0 when W divides B)."""
        start, stop = split_bounds(self.global_batch_size, self.world_size, self.rank)
        return (stop - start) * self.world_size / self.global_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        end = None if self.num_steps is None else self.step + self.num_steps
        while end is None or self.step < end:
            batch = self.local_batch(self.step)
            self.step += 1
            yield batch

    def __len__(self) -> int:
        if self.num_steps is None:
            raise TypeError("GlobalBatchSampler without num_steps has no length")
        return self.num_steps

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "seed": self.seed, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at the saved global step (any world size); the seed and global batch
        size must match, or the sequence would silently change."""
        for key in ("seed", "global_batch_size"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state.get(key)!r}, this sampler "
                    f"{getattr(self, key)!r}; resuming would change the data order"
                )
        self.step = int(state["step"])
