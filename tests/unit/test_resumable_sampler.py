"""A ``StatefulDataLoader`` with Lightning's data-parallel sampler resumes in its epoch exactly, under any replicas.

Lightning wraps torchdata's ``RandomSampler`` in a ``DistributedSamplerWrapper``, which draws the permutation from
the sampler's generator each epoch; the loader's saved state holds no generator, so a resumed epoch read other
samples than the run it continued (the first case below shows it). A loader's state is one replica's place in its
share of the epoch; resumed on fewer (or more) replicas, each must take its share of the rest. The strategy makes
Lightning's samplers resumable.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from lightning_bfpp.adapter.resumable_sampler import (
    ResumableDistributedSampler,
    ResumableSamplerWrapper,
    make_resumable,
    share_of_rest,
)
from lightning_bfpp.engine.checkpoint import replica_loader_states

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def lightning_loader(resumable: bool, num_workers: int = 0) -> StatefulDataLoader:
    """The loader as Lightning hands it to a strategy at data-parallel rank 0 of 2."""
    generator = torch.Generator().manual_seed(2)
    data = list(range(40))
    loader = StatefulDataLoader(data, batch_size=4, shuffle=True, generator=generator, num_workers=num_workers)
    wrapper = DistributedSamplerWrapper(loader.sampler, num_replicas=2, rank=0, shuffle=True, seed=0)
    loader = _update_dataloader(loader, wrapper)
    if resumable:
        make_resumable(loader)
    return loader


def epochs(loader: StatefulDataLoader, first: int, stop: tuple[int, int] | None = None) -> tuple[list, dict | None]:
    """Batches of epochs ``first``..2, until (and including) batch ``stop``; the loader's state there."""
    seen = []
    for epoch in range(first, 3):
        loader.batch_sampler.sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            seen.append(batch.tolist())
            if (epoch, i) == stop:
                return seen, loader.state_dict()
    return seen, None


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_resume_mid_epoch_reads_what_the_uninterrupted_run_read(num_workers):
    straight, _ = epochs(lightning_loader(False, num_workers), 0)
    assert epochs(lightning_loader(True, num_workers), 0)[0] == straight  # the order Lightning gives, unchanged
    assert len(straight) == 15 and len({tuple(b) for b in straight[:5]} & {tuple(b) for b in straight[5:10]}) == 0

    for resumable in (False, True):
        before, state = epochs(lightning_loader(resumable, num_workers), 0, stop=(1, 2))
        resumed = lightning_loader(resumable, num_workers)
        resumed.load_state_dict(state)
        after, _ = epochs(resumed, 1)
        assert (before + after == straight) is resumable  # Lightning's own wrapper: epoch 1 resumes in another order


def test_only_lightnings_samplers_in_a_stateful_loader_are_changed():
    assert type(lightning_loader(True).batch_sampler.sampler) is ResumableSamplerWrapper
    # torch's DataLoader saves no state: Lightning restarts its epoch, and the wrapper stays Lightning's
    plain = torch.utils.data.DataLoader(
        list(range(40)), batch_size=4, sampler=torch.utils.data.SubsetRandomSampler(range(40))
    )
    plain = _update_dataloader(plain, DistributedSamplerWrapper(plain.sampler, num_replicas=2, rank=0))
    make_resumable(plain)
    assert type(plain.sampler) is DistributedSamplerWrapper
    # a wrapped sampler with no generator of its own (here a fixed order) and torch's DistributedSampler
    fixed = StatefulDataLoader(list(range(40)), batch_size=4, sampler=list(range(39, -1, -1)))
    fixed = _update_dataloader(fixed, DistributedSamplerWrapper(fixed.sampler, num_replicas=2, rank=0))
    make_resumable(fixed)
    assert type(fixed.batch_sampler.sampler) is ResumableSamplerWrapper
    assert type(replica_loader("sampler", 0, 2).batch_sampler.sampler) is ResumableDistributedSampler
    # the user's own subclass keeps its class
    own = StatefulDataLoader(list(range(40)), batch_size=4, sampler=StatefulDistributedSampler(range(40), 2, 0))
    make_resumable(own)
    assert type(own.batch_sampler.sampler) is StatefulDistributedSampler


def test_a_resumable_loader_left_mid_epoch_stops_its_workers_when_it_is_dropped():
    """Making a loader resumable adds no reference cycle: dropped, it and its iterator are freed at once, and the
    iterator's workers stop as they do for Lightning's own loader. A cycle left them to the garbage collector, which
    closed the iterator's queues before its shutdown: each worker was then waited for 5 s and terminated."""
    loader = lightning_loader(True, num_workers=2)
    iterator = iter(loader)
    next(iterator)
    workers = list(iterator._workers)
    freed = weakref.ref(loader), weakref.ref(iterator)
    gc.disable()
    try:
        del loader, iterator
        assert [ref() for ref in freed] == [None, None]
    finally:
        gc.enable()
    assert [worker.exitcode for worker in workers] == [0, 0]  # stopped by their messages, not terminated


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_the_share_of_a_whole_epoch_is_the_distributed_samplers(shuffle, drop_last):
    for size in (3, 10, 11, 40):
        for replicas in (1, 2, 3, 4):
            for rank in range(replicas):
                sampler = DistributedSampler(range(size), replicas, rank, shuffle=shuffle, drop_last=drop_last)
                sampler.set_epoch(3)
                whole = DistributedSampler(range(size), 1, 0, shuffle=shuffle)
                whole.set_epoch(3)
                assert share_of_rest(list(whole), 0, rank, replicas, drop_last) == list(sampler)


# the two samplers Lightning puts in a StatefulDataLoader: its DistributedSampler (a loader over torch's own
# samplers) and its wrapper of a sampler with a generator (StatefulDataLoader(shuffle=True))
KINDS = ["sampler", "wrapper"]


def replica_loader(kind: str, rank: int, replicas: int, batch_size: int = 4, num_workers: int = 0):
    """A loader over 40 samples as Lightning hands it to a strategy at data-parallel rank ``rank`` of ``replicas``,
    made resumable."""
    data = list(range(40))
    if kind == "sampler":
        loader = StatefulDataLoader(data, batch_size=batch_size, num_workers=num_workers)
        sampler = DistributedSampler(data, num_replicas=replicas, rank=rank, shuffle=True, seed=5)
    else:
        generator = torch.Generator().manual_seed(2)
        loader = StatefulDataLoader(data, batch_size=batch_size, shuffle=True, generator=generator,
                                    num_workers=num_workers)  # fmt: skip
        sampler = DistributedSamplerWrapper(loader.sampler, num_replicas=replicas, rank=rank, shuffle=False)
    loader = _update_dataloader(loader, sampler)
    make_resumable(loader)
    return loader


def run(loaders: list, epoch: int, steps: int | None = None) -> list[list[list[int]]]:
    """``steps`` steps of every replica's loader together (all of the epoch: None), each step's batch per replica."""
    for loader in loaders:
        loader.batch_sampler.sampler.set_epoch(epoch)
    iterators = [iter(loader) for loader in loaders]
    seen = []
    while steps is None or len(seen) < steps:
        batches = [next(it, None) for it in iterators]
        if any(batch is None for batch in batches):
            assert all(batch is None for batch in batches)
            break
        seen.append([batch.tolist() for batch in batches])
    return seen


def resumed(kind: str, saved: list[dict], replicas: int, batch_size: int, num_workers: int = 0) -> list:
    """Every replica of ``replicas`` resumed from the states ``saved`` (one per replica that saved them), as the
    strategy hands them out (``replica_loader_states``)."""
    stored = {"data_parallel_size": len(saved), "states": [[state] for state in saved]}
    loaders = []
    for rank in range(replicas):
        states, warning = replica_loader_states(stored, [saved[0]], data_parallel_rank=rank,
                                                data_parallel_size=replicas)  # fmt: skip
        assert warning is None
        loader = replica_loader(kind, rank, replicas, batch_size, num_workers)
        loader.load_state_dict(states[0])
        loaders.append(loader)
    return loaders


def samples(steps: list[list[list[int]]]) -> list[int]:
    return sorted(index for step in steps for batch in step for index in batch)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_run_resumed_on_fewer_replicas_reads_each_sample_of_the_epoch_once(kind, num_workers):
    """Saved at 2 replicas after 3 of 5 steps of epoch 1, resumed at 1 replica with twice the batch (the same
    global batch): every later step reads the samples the uninterrupted run read at that step, in the same global
    order, and the next epoch is the uninterrupted run's."""
    uninterrupted = [replica_loader(kind, r, 2, num_workers=num_workers) for r in range(2)]
    straight, straight_next = run(uninterrupted, 1), run(uninterrupted, 2)
    assert samples(straight) == list(range(40))

    loaders = [replica_loader(kind, r, 2, num_workers=num_workers) for r in range(2)]
    before = run(loaders, 1, steps=3)
    saved = [loader.state_dict() for loader in loaders]
    after = run(resumed(kind, saved, 1, 8, num_workers), 1)
    assert before == straight[:3] and len(after) == 2
    for step, (want, got) in enumerate(zip(straight[3:], after, strict=True)):
        assert sorted(got[0]) == sorted(want[0] + want[1]), step  # the same samples at each step
        assert got[0] == [i for pair in zip(want[0], want[1], strict=True) for i in pair]  # in the global order
    assert samples(before + after) == list(range(40))
    # the next epoch: one replica, the whole order as the two replicas interleave it
    again = resumed(kind, saved, 1, 8, num_workers)
    run(again, 1)
    nxt = run(again, 2)
    assert [s[0] for s in nxt] == [[i for pair in zip(*s, strict=True) for i in pair] for s in straight_next]


@pytest.mark.parametrize("kind", KINDS)
def test_a_run_resumed_on_more_replicas_and_back_reads_each_sample_once(kind):
    """2 replicas, 3 steps; 3 replicas for 1 step; then 2 replicas again to the epoch's end: each sample once.
    To the end on 3 replicas, the 16 samples left after step 3 are padded to 18, as DistributedSampler pads."""
    loaders = [replica_loader(kind, r, 2) for r in range(2)]
    first = run(loaders, 1, steps=3)
    saved = [loader.state_dict() for loader in loaders]
    middle_loaders = resumed(kind, saved, 3, 2)
    middle = run(middle_loaders, 1, steps=1)
    last = run(resumed(kind, [loader.state_dict() for loader in middle_loaders], 2, 4), 1)
    assert len(samples(first)) == 24 and len(samples(middle)) == 6
    assert samples(first + middle + last) == list(range(40))
    on_three = [index for step in run(resumed(kind, saved, 3, 2), 1) for batch in step for index in batch]
    assert sorted(set(samples(first)) | set(on_three)) == list(range(40)) and len(on_three) == 18


@pytest.mark.parametrize("kind", KINDS)
def test_a_resume_under_the_same_replicas_goes_on_where_each_stopped(kind):
    straight = run([replica_loader(kind, r, 2) for r in range(2)], 1)
    loaders = [replica_loader(kind, r, 2) for r in range(2)]
    before = run(loaders, 1, steps=2)
    stored = {"data_parallel_size": 2, "states": [[loader.state_dict()] for loader in loaders]}
    again = []
    for rank in range(2):
        states, _ = replica_loader_states(stored, stored["states"][0], data_parallel_rank=rank, data_parallel_size=2)
        loader = replica_loader(kind, rank, 2)
        loader.load_state_dict(states[0])
        again.append(loader)
    assert before + run(again, 1) == straight


def test_a_state_saved_before_the_sampler_recorded_its_place_resumes_where_it_stopped():
    """An earlier release left Lightning's DistributedSampler as it is (torchdata skips the samples yielded): its
    state has no sampler state, and resumes at the same place; under other replicas it is not restored."""
    straight = run([replica_loader("sampler", 0, 2)], 1)
    loader = replica_loader("sampler", 0, 2)
    before = run([loader], 1, steps=2)
    state = loader.state_dict()
    del state["_sampler_iter_state"]["sampler_state"]  # as torchdata saved a sampler that was not Stateful
    again = replica_loader("sampler", 0, 2)
    again.load_state_dict(state)
    assert before + run([again], 1) == straight
    stored = {"data_parallel_size": 2, "states": [[state], [state]]}
    states, warning = replica_loader_states(stored, [state], data_parallel_rank=0, data_parallel_size=1)
    assert states is None and "predates samplers that record their place" in warning


def test_replica_states_that_differ_are_not_moved_to_another_replica_count():
    loaders = [replica_loader("sampler", r, 2) for r in range(2)]
    run(loaders, 1, steps=2)
    saved = [loader.state_dict() for loader in loaders]
    saved[1]["dataset_state"] = {"augmentation": 7}  # a dataset with a place of its own in each replica's share
    stored = {"data_parallel_size": 2, "states": [[state] for state in saved]}
    states, warning = replica_loader_states(stored, [saved[0]], data_parallel_rank=0, data_parallel_size=1)
    assert states is None and "cannot be split or merged for 1 replicas" in warning
    # one process's state (a file consolidated from one replica) moves like one replica's
    states, warning = replica_loader_states(None, [saved[0]], data_parallel_rank=1, data_parallel_size=2)
    assert states == [saved[0]] and warning is None
