"""Messages between the ranks of a generation ring: a fixed-size header, then the tensors it describes.

A group's state moves from stage to stage as a tuple of tensors whose shapes change every step (a prompt's
length at prefill, one token after it; groups of unequal sizes), so each message says what follows: its kind,
the group, the stage that runs next and every tensor's dtype and shape. Sends are asynchronous (``isend``), so
that a rank never waits for its successor to receive before it takes the next message from its predecessor:
with every rank sending round the ring at once, blocking sends could wait on each other in a circle.

Written here, not taken from torch: ``torch.distributed.pipelining``'s stages fix their tensor shapes on first use
and have no generation (pytorch #157795); its point-to-point helpers are private.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.distributed as dist

from lightning_bfpp.engine.initial_state import pack, unpack  # bytes in, tensors out

_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
)
_MAX_TENSORS = 8
_MAX_DIMS = 5
_FIELDS_PER_TENSOR = 2 + _MAX_DIMS  # dtype, number of dimensions, sizes
_HEADER = 4 + _MAX_TENSORS * _FIELDS_PER_TENSOR
_HEADER_BYTES = 8 * _HEADER
# a message whose tensors fit travels as one transfer of this many bytes (its header, then its tensors' bytes): a
# decoding step's (one token's hidden states, the mask) usually does; a larger one sends its tensors after it
MESSAGE_BYTES = 64 * 1024


class Kind(IntEnum):
    """What a message carries: a group's inputs for a stage, or word that a group has finished."""

    DATA = 1
    DONE = 2


@dataclass
class Message:
    kind: Kind
    group: int
    stage: int
    tensors: tuple[torch.Tensor, ...] = ()


def _header(message: Message, device: torch.device) -> torch.Tensor:
    if len(message.tensors) > _MAX_TENSORS:
        raise ValueError(f"a generation message carries at most {_MAX_TENSORS} tensors; got {len(message.tensors)}")
    fields = [int(message.kind), message.group, message.stage, len(message.tensors)]
    for tensor in message.tensors:
        if tensor.dtype not in _DTYPES or tensor.dim() > _MAX_DIMS:
            raise ValueError(
                f"a layer's output in generation must be tensors of up to {_MAX_DIMS} dimensions of"
                f" {', '.join(map(str, _DTYPES))}; got {tensor.dtype} of shape {tuple(tensor.shape)}"
            )
        sizes = list(tensor.shape) + [0] * (_MAX_DIMS - tensor.dim())
        fields += [_DTYPES.index(tensor.dtype), tensor.dim(), *sizes]
    fields += [0] * (_HEADER - len(fields))
    return torch.tensor(fields, dtype=torch.int64, device=device)


class Mailbox:
    """This rank's sends to its successor and receives from its predecessor in a ring of ``ranks`` (global ranks, in
    ring order) over ``group``. Messages between two ranks arrive in the order they were sent."""

    def __init__(self, ranks: Sequence[int], me: int, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.ranks = list(ranks)
        self.me = me
        self.group = group
        self.device = device
        self._in_flight: list[tuple[dist.Work, tuple[torch.Tensor, ...]]] = []

    def send(self, message: Message, to: int) -> None:
        """Send ``message`` to ring position ``to`` without waiting for it to be received: one transfer of
        :data:`MESSAGE_BYTES` holding its header and its tensors' bytes, or where those do not fit, the header's
        transfer and one of the tensors' bytes."""
        header = _header(message, self.device).view(torch.uint8)
        payload = pack([t.to(self.device) for t in message.tensors]) if message.tensors else header[:0]
        if payload.numel() <= MESSAGE_BYTES - _HEADER_BYTES:
            buffer = torch.empty(MESSAGE_BYTES, dtype=torch.uint8, device=self.device)
            buffer[:_HEADER_BYTES] = header
            buffer[_HEADER_BYTES : _HEADER_BYTES + payload.numel()] = payload
            tensors: tuple[torch.Tensor, ...] = (buffer,)
        else:
            buffer = torch.empty(MESSAGE_BYTES, dtype=torch.uint8, device=self.device)
            buffer[:_HEADER_BYTES] = header
            tensors = (buffer, payload)
        dst = self.ranks[to]
        works = [dist.isend(t, dst=dst, group=self.group) for t in tensors]
        self._in_flight += [(work, tensors) for work in works if work is not None]
        self._in_flight = [(w, t) for w, t in self._in_flight if not w.is_completed()]

    def receive(self, source: int) -> Message:
        """The next message from ring position ``source`` (blocking)."""
        src = self.ranks[source]
        buffer = torch.empty(MESSAGE_BYTES, dtype=torch.uint8, device=self.device)
        dist.recv(buffer, src=src, group=self.group)
        fields = buffer[:_HEADER_BYTES].view(torch.int64).tolist()
        kind, group, stage, count = fields[:4]
        tensors = []
        for i in range(count):
            dtype, ndim, *sizes = fields[4 + i * _FIELDS_PER_TENSOR : 4 + (i + 1) * _FIELDS_PER_TENSOR]
            tensors.append(torch.empty(sizes[:ndim], dtype=_DTYPES[dtype], device=self.device))
        size = sum(t.numel() * t.element_size() for t in tensors)
        if size <= MESSAGE_BYTES - _HEADER_BYTES:
            unpack(buffer[_HEADER_BYTES : _HEADER_BYTES + size], tensors)
        else:
            flat = torch.empty(size, dtype=torch.uint8, device=self.device)
            dist.recv(flat, src=src, group=self.group)
            unpack(flat, tensors)
        return Message(Kind(kind), group, stage, tuple(tensors))

    def flush(self) -> None:
        """Wait until every send has been received."""
        for work, _ in self._in_flight:
            work.wait()
        self._in_flight.clear()
