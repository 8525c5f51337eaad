"""The same random draws wherever a micro-batch's step runs.

A step's code before ``self(...)`` runs twice under the pipeline: on the rank holding the first stage (to
capture the model's input) and on the rank holding the last stage (to compute the loss). A step that draws
random numbers there (denoising noise, a masking pattern, an augmentation) must draw the same numbers in
both runs, or the model is fed one draw and scored against another. Each (step, micro-batch) therefore runs
under generator states forked from the process's and seeded from one key that every rank of a pipeline
computes alike: the run's base seed, where the step is in training (epoch, batch index, ...), the
micro-batch and the data-parallel replica. Replicas draw independently, as different samples do on one
device; two runs with the same seed and layout draw identically.

Generators covered: torch's CPU generator, the current CUDA device's (on GPU), NumPy's global generator and
Python's ``random``. The process's own states are restored afterwards, so the fork leaves the stream that
layers (dropout) and the rest of the program draw from untouched.

This module is the package's one home for random state: the seed every rank derives draws from
(:func:`shared_base_seed`), the per-(step, micro-batch) fork above, and the snapshot weight passing restores
to recompute a chunk's forward with the same dropout masks (:class:`RandomStateSnapshot`), and the seed a module
materialized from the meta device is initialized from (:func:`seed_for_name`).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with every supported torch/Lightning install
    np = None  # type: ignore[assignment]


def shared_base_seed(broadcast: Callable[[int], int]) -> int:
    """The seed every rank derives its steps' random draws from: global rank 0's torch seed (set by
    ``seed_everything``), handed to every rank by ``broadcast`` (from rank 0), so that processes seeded
    differently, or not at all, still agree."""
    return int(broadcast(process_seed()))


def seed_for_name(base_seed: int, name: str) -> int:
    """A 63-bit seed from ``base_seed`` and a module's fully-qualified name, stable across processes and Python
    runs: what a module materialized from the meta device is initialized from (see
    :func:`~lightning_bfpp.engine.layers.materialize_meta`), so its values never depend on which rank, or which
    other modules before it, drew."""
    digest = hashlib.blake2b(f"{int(base_seed)}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def process_seed() -> int:
    """This process's torch seed (``seed_everything``'s, or torch's own random one), as :func:`shared_base_seed`
    reads it on global rank 0."""
    return torch.initial_seed() & 0x7FFF_FFFF_FFFF_FFFF


def derive_seed(base_seed: int, key: Sequence[int]) -> int:
    """A 63-bit seed from ``base_seed`` and an integer key, stable across processes and Python runs."""
    text = ",".join(str(int(k)) for k in (base_seed, *key)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & 0x7FFF_FFFF_FFFF_FFFF


@contextmanager
def forked_random_state(seed: int, device: torch.device) -> Iterator[None]:
    """Inside the block every covered generator starts from ``seed``; outside, nothing changed."""
    with forked_random_states(device) as reseed:
        reseed(seed)
        yield


@contextmanager
def forked_random_states(device: torch.device) -> Iterator[Callable[[int], None]]:
    """One fork for several runs back to back: yields ``reseed(seed)``, which starts every covered generator
    from ``seed``; outside the block, nothing changed.

    Each run started by ``reseed`` draws what it would under its own :func:`forked_random_state`, but the
    process's states are saved and restored once, not once per run: NumPy's legacy state alone takes ~60 µs
    to read and write, 1 ms per step at 16 micro-batches on the rank that captures every micro-batch's input
    before its first forward. Only for runs with nothing else drawing in between (the capture loop); a run
    between a stage's computations (the loss) forks on its own, so that layers draw from the process's stream.
    """
    cuda = device.type == "cuda"
    torch_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state(device) if cuda else None
    numpy_state = np.random.get_state() if np is not None else None
    python_state = random.getstate()

    def reseed(seed: int) -> None:
        # the generators themselves: `torch.manual_seed` would also probe every backend (~0.2 ms per call)
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.manual_seed(seed)  # the current device's, whose state is restored below
        if np is not None:
            np.random.seed(seed % 2**32)
        random.seed(seed)

    try:
        yield reseed
    finally:
        torch.set_rng_state(torch_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)
        if numpy_state is not None:
            np.random.set_state(numpy_state)
        random.setstate(python_state)


class RandomStateSnapshot:
    """The torch generator states at one point (CPU, and the device's on CUDA), to run code again from there:
    a recomputed forward draws the same dropout masks as the first (as ``torch.utils.checkpoint`` does)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.accelerator = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextmanager
    def restored(self) -> Iterator[None]:
        """Inside the block the generators start from the snapshot; outside, nothing changed."""
        devices = [self.device] if self.accelerator is not None else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.set_rng_state(self.cpu)
            if self.accelerator is not None:
                torch.cuda.set_rng_state(self.accelerator, self.device)
            yield
