"""Lightning's data-parallel samplers resume in the epoch they were saved in, under any number of replicas.

Two things a ``StatefulDataLoader`` does not save make a resumed epoch read other samples than the run it continues
(under any multi-process strategy):

- The generator. Lightning replaces a training loader's sampler by a ``DistributedSampler`` only when it is torch's
  own ``RandomSampler`` or ``SequentialSampler``; any other (``torchdata``'s ``StatefulDataLoader(shuffle=True)`` has
  its own ``RandomSampler``) is wrapped in a ``DistributedSamplerWrapper``, which draws the user's permutation
  afresh from the sampler's generator each epoch. The loader saves how many samples it yielded, not that generator,
  so a resumed run drew its epoch's permutation from the generator as it was at the start of the run.
- The number of replicas. "Samples yielded" is one replica's place in its share of the epoch, and means nothing
  under another ``data_parallel_size`` (a run resumed on fewer machines). Both samplers hand replica ``r`` of
  ``R`` every ``R``-th sample of the epoch's order, and replicas step together, so ``y`` samples yielded by each
  are the first ``y * R`` of that order, whichever the replica: the epoch's place is one number, the same on
  every replica.

The samplers here are Lightning's (their class is swapped, no state is copied: the loader and its batch sampler
hold references to the object) made ``Stateful``, the protocol ``StatefulDataLoader`` asks its samplers for. Their
state is the epoch's place (samples of the order read before this layout took over, the replica count, samples
yielded since) and, for the wrapper, its sampler's generator at the epoch's start and now. Resumed under the replica
count that saved it, a sampler goes on where it stopped; under another, each replica takes its share of the rest of
the epoch's order, padded to a multiple of the new count or cut with ``drop_last`` as ``DistributedSampler`` does,
so every sample of the epoch is read once. The epoch's order is the one torch's or Lightning's own ``__iter__``
gives with one replica, so the order without a resume is theirs.

A loader saved before its sampler was ``Stateful`` (by an earlier release) holds only the samples yielded; torchdata
skips that many only for a sampler that is not ``Stateful``, so :func:`make_resumable` reads such a state as the
place the sampler skips to.
"""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import DistributedSampler, Sampler

from lightning_bfpp.adapter._lightning_compat import wrapped_sampler
from lightning_bfpp.engine.checkpoint.loader_states import (
    CONSUMED_KEY,
    REPLICAS_KEY,
    SAMPLER_STATE_KEY,
    YIELDED_KEY,
    sampler_positions,
)


def share_of_rest(order: list[int], consumed: int, rank: int, replicas: int, drop_last: bool) -> list[int]:
    """Replica ``rank``'s share of ``order`` after its first ``consumed`` samples: every ``replicas``-th, the rest
    padded with its own first samples to a multiple of ``replicas`` (or cut to one with ``drop_last``), as
    ``DistributedSampler`` shares a whole epoch (``consumed=0`` gives its shares exactly)."""
    rest = order[consumed:]
    if drop_last:
        rest = rest[: len(rest) // replicas * replicas]
    elif rest and len(rest) % replicas:
        padding = replicas - len(rest) % replicas
        rest = rest + (rest * math.ceil(padding / len(rest)))[:padding]
    return rest[rank::replicas]


class _ResumableEpoch(Sampler):
    """What both samplers add to Lightning's (mixed in before a ``DistributedSampler``): an epoch's iteration that
    starts at a saved place, and that place as the sampler's state. A ``Sampler`` itself, so that the classes it
    makes share the layout of the instances whose class is swapped (Python compares the first bases' chain)."""

    _lightning_class: type[DistributedSampler]
    # set by DistributedSampler.__init__
    dataset: Any
    num_replicas: int
    rank: int
    drop_last: bool

    def __iter__(self) -> Iterator[int]:
        restore = self.__dict__.pop("_restore", None) or {}
        order = self._epoch_order(restore)
        saved_replicas = restore.get(REPLICAS_KEY) or self.num_replicas  # None: a state from before it was saved
        consumed, skip = int(restore.get(CONSUMED_KEY, 0)), int(restore.get(YIELDED_KEY, 0))
        if saved_replicas != self.num_replicas:  # the whole epoch's place, shared anew
            consumed, skip = consumed + skip * saved_replicas, 0
        self._consumed, self._yielded = consumed, skip
        share = share_of_rest(order, consumed, self.rank, self.num_replicas, self.drop_last)
        return self._counted(share[skip:])

    def _epoch_order(self, restore: Mapping[str, Any]) -> list[int]:
        """The epoch's whole order: what Lightning's sampler yields with one replica (drawn once, now)."""
        whole = copy.copy(self)
        whole.__class__ = self._lightning_class
        whole.num_replicas, whole.rank, whole.drop_last = 1, 0, False
        whole.num_samples = whole.total_size = len(self.dataset)  # type: ignore[attr-defined]
        return list(iter(whole))

    def _counted(self, indices: list[int]) -> Iterator[int]:
        for index in indices:
            self._yielded += 1
            yield index

    def state_dict(self) -> dict[str, Any]:
        return {
            REPLICAS_KEY: self.num_replicas,
            CONSUMED_KEY: getattr(self, "_consumed", 0),
            YIELDED_KEY: getattr(self, "_yielded", 0),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self._restore = dict(state_dict)


class ResumableDistributedSampler(_ResumableEpoch, DistributedSampler):
    """Lightning's ``DistributedSampler`` (torch's), whose state is the epoch's place."""

    _lightning_class = DistributedSampler


def _own_generator(wrapper: DistributedSamplerWrapper) -> torch.Generator | None:
    """The generator the sampler inside Lightning's wrapper draws its permutations from, if it has one."""
    generator = getattr(wrapped_sampler(wrapper), "generator", None)
    return generator if isinstance(generator, torch.Generator) else None


class ResumableSamplerWrapper(_ResumableEpoch, DistributedSamplerWrapper):
    """Lightning's ``DistributedSamplerWrapper``, whose state is the epoch's place and the wrapped sampler's generator
    (at the epoch's start, before the permutation is drawn, and now)."""

    _lightning_class = DistributedSamplerWrapper

    def _epoch_order(self, restore: Mapping[str, Any]) -> list[int]:
        generator = _own_generator(self)
        restores_generator = generator is not None and restore.get("epoch_start") is not None
        if generator is not None:
            if restores_generator:
                generator.set_state(restore["epoch_start"])
            self._epoch_start_generator = generator.get_state()
        order = super()._epoch_order(restore)
        if restores_generator:
            # the loader drew from the same generator since (a seed for its workers): on as the saved run went on
            generator.set_state(restore["generator"])
        return order

    def state_dict(self) -> dict[str, Any]:
        generator = _own_generator(self)
        return {
            **super().state_dict(),
            "epoch_start": getattr(self, "_epoch_start_generator", None),
            "generator": generator.get_state() if generator is not None else None,
        }


_RESUMABLE = {DistributedSampler: ResumableDistributedSampler, DistributedSamplerWrapper: ResumableSamplerWrapper}


def make_resumable(dataloader: object) -> None:
    """Make the sampler Lightning put in ``dataloader`` for data parallelism (a ``DistributedSampler`` or its
    ``DistributedSamplerWrapper``) resume in its epoch under any replica count.

    Only where the loader saves its samplers' states (``StatefulDataLoader``); any other loader is left as Lightning
    made it, and so is a sampler of another class (the user's own ``DistributedSampler`` subclass)."""
    if not hasattr(dataloader, "state_dict"):
        return
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    swapped = False
    for sampler in (getattr(dataloader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        if (resumable := _RESUMABLE.get(type(sampler))) is not None:
            sampler.__class__ = resumable
            swapped = True
    if swapped and "load_state_dict" not in vars(dataloader):
        dataloader.load_state_dict = _reading_earlier_states(dataloader.load_state_dict)  # type: ignore[attr-defined]


def _reading_earlier_states(load_state_dict: Callable[[Any], None]) -> Callable[[Any], None]:
    """The loader's ``load_state_dict``, reading a state saved while its sampler was not ``Stateful`` (samples
    yielded, no sampler state: torchdata skips them only for such a sampler) as the place to skip to.

    It holds the loader's method weakly (``WeakMethod``): holding it would make the loader a reference cycle, freed
    only by the garbage collector, with the iterator it keeps: the collector closes the iterator's queues before the
    iterator's own shutdown, whose stop messages then never reach its workers; each worker of an iterator left
    mid-epoch (a fit ending at ``max_steps``, a Trainer after another) was waited for 5 s and then terminated."""
    method = weakref.WeakMethod(load_state_dict)  # type: ignore[arg-type]

    def load(state_dict: Any) -> None:
        state_dict = copy.deepcopy(state_dict)
        for position in sampler_positions(state_dict):
            if SAMPLER_STATE_KEY not in position:
                position[SAMPLER_STATE_KEY] = {REPLICAS_KEY: None, YIELDED_KEY: position["samples_yielded"]}
        method()(state_dict)  # type: ignore[misc]

    return load
