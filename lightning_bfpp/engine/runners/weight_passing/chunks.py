"""One chunk's weights on one rank: owned (the real values) or borrowed (storage only while the schedule holds
the chunk), with the persistent buffers that travel with them (see the package's docstring)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_bfpp.engine.initial_state import local_state, pack, unpack


class ChunkWeights:
    """One chunk's parameters on this rank: the real values on its owner; elsewhere storage only while the
    schedule holds the chunk (the parameters' ``.data`` become views of the received buffer, then empty).

    ``buffers``: the chunk's persistent buffers, which travel with the weights (see the module's docstring);
    every rank keeps their storage, they are small.
    """

    def __init__(self, params: Sequence[nn.Parameter], owned: bool, buffers: Sequence[torch.Tensor] = ()) -> None:
        self.params = list(params)
        self.owned = owned
        self.buffers = list(buffers)
        self.buffer_bytes = sum(b.numel() * b.element_size() for b in self.buffers)
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.numel = sum(self.numels)
        self.dtype = self.params[0].dtype if self.params else torch.float32
        if any(p.dtype != self.dtype for p in self.params):
            raise TypeError(
                "BFPPStrategy(schedule='weight_passing'): a chunk's parameters travel as one buffer and must share"
                f" one dtype; this chunk mixes {sorted({str(p.dtype) for p in self.params})}."
            )
        self.device = self.params[0].device if self.params else torch.device("cpu")
        if not owned:
            self.release()

    def flat_values(self) -> torch.Tensor:
        """The owner's weights as one buffer to send."""
        if not self.params:
            return torch.empty(0, dtype=self.dtype, device=self.device)
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def borrow(self, flat: torch.Tensor) -> None:
        """Point the parameters at a received buffer."""
        for p, view, shape in zip(self.params, flat.split(self.numels), self.shapes, strict=True):
            p.data = view.view(shape)

    def flat_buffers(self) -> torch.Tensor | None:
        """The buffers' current values as one byte buffer to send, or None for a chunk without buffers."""
        return pack(self.buffers) if self.buffer_bytes else None

    def load_buffers(self, flat: torch.Tensor | None) -> None:
        """Take the values of a received :meth:`flat_buffers`."""
        if flat is not None:
            unpack(flat, self.buffers)

    def save_buffers(self) -> list[torch.Tensor]:
        """A copy of the buffers' values, for :meth:`restore_buffers`."""
        return [b.detach().clone() for b in self.buffers]

    @torch.no_grad()
    def restore_buffers(self, saved: Sequence[torch.Tensor]) -> None:
        for buffer, value in zip(self.buffers, saved, strict=True):
            buffer.copy_(value)

    def release(self) -> None:
        for p in self.params:
            p.data = torch.empty(0, dtype=self.dtype, device=self.device)
            p.grad = None

    def take_gradient(self) -> torch.Tensor:
        """This micro-batch's gradient of the chunk as one buffer (zeros where a parameter got none)."""
        parts = [
            p.grad.reshape(-1) if p.grad is not None else torch.zeros(n, dtype=self.dtype, device=self.device)
            for p, n in zip(self.params, self.numels, strict=True)
        ]
        for p in self.params:
            p.grad = None
        return torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype, device=self.device)

    def add_gradient(self, flat: torch.Tensor) -> None:
        """Add ``flat`` to the owner's accumulated gradients (``.grad``)."""
        for p, part in zip(self.params, flat.split(self.numels), strict=True):
            part = part.view(p.shape).to(p.dtype)
            p.grad = part.clone() if p.grad is None else p.grad.add_(part)


def chunk_buffers(chunk: nn.Module) -> list[torch.Tensor]:
    """The chunk's persistent buffers (those its ``state_dict`` holds), each once: what travels with it."""
    persistent = {id(t) for t in chunk.state_dict(keep_vars=True).values()}
    return [b for b in local_state([chunk], parameters=False) if id(b) in persistent]
