"""A shuffling sampler that Lightning wrapped for data parallelism resumes in the epoch it was saved in.

Lightning replaces a training loader's sampler by a ``DistributedSampler`` only when it is torch's own
``RandomSampler`` or ``SequentialSampler``; any other (``torchdata``'s ``StatefulDataLoader(shuffle=True)`` has its
own ``RandomSampler``) is wrapped in a ``DistributedSamplerWrapper``, which draws the user's permutation afresh
from the sampler's generator each epoch and hands each replica its share. A ``StatefulDataLoader`` saves how many
samples it yielded, not that generator: a resumed run drew its epoch's permutation from the generator as it was
at the start of the run, and after the resume read other samples than the run it continued (under any
multi-process strategy).

The wrapper here is Lightning's, made ``Stateful`` (the protocol ``StatefulDataLoader`` asks its samplers for): it
records the generator's state at the start of each epoch, before the permutation is drawn, and a resume sets the
generator back to it, so the epoch's permutation and every later one are the uninterrupted run's. The object
stays the one Lightning placed in the loader (its class is swapped, no state is copied), as every reference the
loader and its batch sampler hold to it must.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

from lightning_bfpp.adapter._lightning_compat import wrapped_sampler


def _own_generator(wrapper: DistributedSamplerWrapper) -> torch.Generator | None:
    """The generator the sampler inside Lightning's wrapper draws its permutations from, if it has one."""
    generator = getattr(wrapped_sampler(wrapper), "generator", None)
    return generator if isinstance(generator, torch.Generator) else None


class ResumableSamplerWrapper(DistributedSamplerWrapper):
    """Lightning's ``DistributedSamplerWrapper``, whose state is the wrapped sampler's generator (at the epoch's
    start and now) and the samples yielded in the epoch."""

    def __iter__(self) -> Iterator:
        generator, restore = _own_generator(self), self.__dict__.pop("_restore", None)
        restores_generator = generator is not None and restore is not None and restore["epoch_start"] is not None
        if generator is not None:
            if restores_generator:
                generator.set_state(restore["epoch_start"])
            self._epoch_start_generator = generator.get_state()
        indices = super().__iter__()
        if len(self.dataset):  # the permutation is drawn now, whichever Lightning release defers it
            self.dataset[0]
        if restores_generator:
            # the loader drew from the same generator since (a seed for its workers): on as the saved run went on
            generator.set_state(restore["generator"])
        self._yielded = 0
        return self._counted(indices, skip=restore["yielded"] if restore is not None else 0)

    def _counted(self, indices: Iterator, skip: int) -> Iterator:
        for i, index in enumerate(indices):
            if i >= skip:  # a resume goes on after the samples the saved run had taken
                self._yielded = i + 1
                yield index

    def state_dict(self) -> dict[str, Any]:
        generator = _own_generator(self)
        return {
            "epoch_start": getattr(self, "_epoch_start_generator", None),
            "generator": generator.get_state() if generator is not None else None,
            "yielded": getattr(self, "_yielded", 0),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("epoch_start") is None or _own_generator(self) is None:
            state_dict = {**state_dict, "epoch_start": None, "generator": None}
        self._restore = state_dict


def make_resumable(dataloader: object) -> None:
    """Make the ``DistributedSamplerWrapper`` Lightning put in ``dataloader`` (if any) resume in its epoch.

    Only where the loader saves its samplers' states (``StatefulDataLoader``) and the wrapped sampler draws from a
    generator of its own; any other loader is left as Lightning made it."""
    if not hasattr(dataloader, "state_dict"):
        return
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    for sampler in (getattr(dataloader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        if type(sampler) is DistributedSamplerWrapper and _own_generator(sampler) is not None:
            sampler.__class__ = ResumableSamplerWrapper
