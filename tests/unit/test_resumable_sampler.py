"""A ``StatefulDataLoader(shuffle=True)`` that Lightning wrapped for data parallelism resumes in its epoch exactly.

Lightning wraps torchdata's ``RandomSampler`` in a ``DistributedSamplerWrapper``, which draws the permutation from
the sampler's generator each epoch; the loader's saved state holds no generator, so a resumed epoch read other
samples than the run it continued (the first case below shows it). The strategy makes the wrapper resumable.
"""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.utilities.data import _update_dataloader
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_bfpp.adapter.resumable_sampler import ResumableSamplerWrapper, make_resumable

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


def test_only_a_wrapped_sampler_with_a_generator_of_its_own_in_a_stateful_loader_is_changed():
    assert type(lightning_loader(True).batch_sampler.sampler) is ResumableSamplerWrapper
    # torch's DataLoader saves no state: Lightning restarts its epoch, and the wrapper stays Lightning's
    plain = torch.utils.data.DataLoader(
        list(range(40)), batch_size=4, sampler=torch.utils.data.SubsetRandomSampler(range(40))
    )
    plain = _update_dataloader(plain, DistributedSamplerWrapper(plain.sampler, num_replicas=2, rank=0))
    make_resumable(plain)
    assert type(plain.sampler) is DistributedSamplerWrapper
    # a sampler with no generator of its own (here a fixed order) has nothing to restore
    fixed = StatefulDataLoader(list(range(40)), batch_size=4, sampler=list(range(39, -1, -1)))
    fixed = _update_dataloader(fixed, DistributedSamplerWrapper(fixed.sampler, num_replicas=2, rank=0))
    make_resumable(fixed)
    assert type(fixed.batch_sampler.sampler) is DistributedSamplerWrapper
