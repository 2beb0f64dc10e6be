"""The world-size-invariant global-batch sampler (rootopt.distributed.sampler)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from rootopt.distributed.sampler import GlobalBatchSampler, split_bounds, worker_share


def parts(step: int, world: int, **kw: int) -> list[list[int]]:
    return [
        GlobalBatchSampler(100, 12, rank=r, world_size=world, seed=3, **kw).local_batch(step)
        for r in range(world)
    ]


@pytest.mark.parametrize("world", [1, 2, 3, 5, 7, 12])
def test_ranks_cover_the_global_batch_without_overlap_or_gap(world: int) -> None:
    ref = GlobalBatchSampler(100, 12, seed=3)
    for step in (0, 1, 7, 8, 9, 30):  # 8 steps per epoch: crosses epoch boundaries
        got = parts(step, world)
        assert len(got) == world
        flat = [i for p in got for i in p]
        assert flat == ref.global_batch(step)  # same batch, same order, at any world size
        assert len(set(flat)) == 12
        sizes = [len(p) for p in got]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_epoch_is_a_permutation_and_epochs_differ() -> None:
    s = GlobalBatchSampler(100, 12, seed=3)
    assert s.steps_per_epoch == 8
    epoch0 = [i for t in range(8) for i in s.global_batch(t)]
    epoch1 = [i for t in range(8, 16) for i in s.global_batch(t)]
    assert len(set(epoch0)) == len(epoch0) == 96  # the incomplete block of 4 is dropped
    assert len(set(epoch1)) == 96
    assert epoch0 != epoch1
    assert GlobalBatchSampler(100, 12, seed=3).global_batch(5) == s.global_batch(5)
    assert GlobalBatchSampler(100, 12, seed=4).global_batch(5) != s.global_batch(5)
    plain = GlobalBatchSampler(100, 12, shuffle=False)
    assert plain.global_batch(1) == list(range(12, 24))


def test_resume_at_another_world_size_repeats_and_skips_nothing() -> None:
    whole = GlobalBatchSampler(50, 6, seed=1, num_steps=20)
    expected = [whole.global_batch(t) for t in range(20)]
    # 2 ranks for 7 steps, then a resume at 3 ranks from the saved state
    first = [GlobalBatchSampler(50, 6, rank=r, world_size=2, seed=1, num_steps=7) for r in (0, 1)]
    got = [a + b for a, b in zip(*(list(s) for s in first))]
    state = first[0].state_dict()
    assert state["step"] == 7 and first[1].state_dict() == state
    second = []
    for r in range(3):
        s = GlobalBatchSampler(50, 6, rank=r, world_size=3, seed=1, num_steps=13)
        s.load_state_dict(state)
        second.append(list(s))
    assert [len(x) for x in second] == [13, 13, 13]
    got += [a + b + c for a, b, c in zip(*second)]
    assert got == expected


def test_resume_refuses_a_changed_order() -> None:
    s = GlobalBatchSampler(50, 6, seed=1)
    with pytest.raises(ValueError, match="seed"):
        s.load_state_dict({"step": 3, "seed": 2, "global_batch_size": 6})
    with pytest.raises(ValueError, match="global_batch_size"):
        s.load_state_dict({"step": 3, "seed": 1, "global_batch_size": 8})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_samples": 0, "global_batch_size": 1}, "num_samples"),
        ({"num_samples": 5, "global_batch_size": 6}, "exceeds"),
        ({"num_samples": 50, "global_batch_size": 2, "world_size": 3}, "smaller than the world"),
        ({"num_samples": 50, "global_batch_size": 6, "rank": 2, "world_size": 2}, "rank"),
        ({"num_samples": 50, "global_batch_size": 6, "start_step": -1}, "start_step"),
        ({"num_samples": 50, "global_batch_size": 6, "num_steps": -1}, "num_steps"),
    ],
)
def test_bad_arguments(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GlobalBatchSampler(**kwargs)


def test_loss_weights_make_the_rank_average_the_global_mean() -> None:
    x = torch.randn(100)
    b, world = 12, 5
    samplers = [GlobalBatchSampler(100, b, rank=r, world_size=world, seed=0) for r in range(world)]
    local = [x[s.local_batch(2)].mean() * s.loss_weight() for s in samplers]
    assert float(torch.stack(local).mean()) == pytest.approx(
        float(x[samplers[0].global_batch(2)].mean()), rel=1e-5
    )
    assert GlobalBatchSampler(100, 12, rank=1, world_size=4).loss_weight() == 1.0


def test_split_bounds_and_worker_share() -> None:
    for n in range(0, 15):
        for k in range(1, 6):
            bounds = [split_bounds(n, k, i) for i in range(k)]
            ref = [len(c) for c in torch.arange(n).tensor_split(k)]
            assert [b - a for a, b in bounds] == ref
            assert bounds[0][0] == 0 and bounds[-1][1] == n
    idx = list(range(10, 17))
    shares = [worker_share(idx, w, 3) for w in range(3)]
    assert [i for s in shares for i in s] == idx
    with pytest.raises(ValueError, match="part 3 of 3"):
        split_bounds(7, 3, 3)


class _Ids(Dataset[int]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[int, int]:
        info = get_worker_info()
        return i, -1 if info is None else info.id


def test_dataloader_workers_get_whole_batches_in_order() -> None:
    s = GlobalBatchSampler(40, 8, rank=1, world_size=2, seed=5, num_steps=6)
    loader = DataLoader(_Ids(), batch_sampler=s, num_workers=2)
    got = [(ids.tolist(), set(w.tolist())) for ids, w in loader]
    ref = GlobalBatchSampler(40, 8, rank=1, world_size=2, seed=5)
    assert [g[0] for g in got] == [ref.local_batch(t) for t in range(6)]
    assert {w for g in got for w in g[1]} == {0, 1}  # both workers did work
    assert all(len(g[1]) == 1 for g in got)  # each batch came whole from one worker
