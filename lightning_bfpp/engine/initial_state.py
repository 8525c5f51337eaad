"""Every data-parallel replica starts from the same parameters and buffers, as under DDP.

DDP broadcasts rank 0's parameters and buffers when it wraps a module. FSDP2's ``fully_shard`` and
``replicate`` do not (FSDP1's ``sync_module_states`` has no FSDP2 counterpart): each process keeps what it
initialised. A model built without ``seed_everything`` would then train replicas that never agree
(``no_shard``, and across nodes under ``hybrid_shard``), or under ``full_shard`` weights whose shards come from
different processes' draws.

So after setup's agreement and before the stages are sharded, each rank takes:

- data-parallel rank 0's values of every parameter and buffer of its local layers. The layers of pipeline
  rank ``k`` then hold what data-parallel rank 0 of pipeline rank ``k`` drew: each layer drawn once, by one
  process, as on one device, and the same on every replica. That is DDP's guarantee (one process's
  initialisation, everywhere); only which process drew a layer differs (rank 0 drew all under DDP), which a run
  without a seed cannot tell apart;
- global rank 0's values of the buffers outside the pipeline layers: every rank keeps those, and the step code
  on the first and on the last stage must read the same values;
- under weight passing, every chunk's buffers from the chunk's owner. A chunk's parameters exist on its owner
  alone and need nothing (see :mod:`lightning_bfpp.engine.runners.weight_passing` for how buffers travel afterwards).

Cost, once per setup: each rank receives the bytes of what it holds before sharding (its local stages: about
``Ψ / p`` of a model of ``Ψ`` bytes over ``p`` pipeline ranks; under weight passing only the chunks' buffers)
over its data-parallel group, where DDP sends every rank ``Ψ``. Tensors of at least 1 MiB are broadcast one by
one, in place; smaller ones of every dtype are packed as bytes into buckets of up to 250 MiB (DDP's size), one
broadcast each. Measured with gloo on 2 CPU processes: 512 MiB of 4 MiB weights in 0.6–0.7 s (as fast as a
broadcast per tensor), 5,000 tensors of 4 KiB in 0.1 s (3.3 s with a broadcast per tensor).

Written here, not taken from torch: torch's own broadcast of a module's state (DDP's ``_sync_module_states``,
``_broadcast_coalesced``) is private API.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

T = TypeVar("T")

BUCKET_BYTES = 250 * 2**20  # as DDP's broadcast of the initial state
ALONE_BYTES = 2**20  # a tensor this large is broadcast on its own, in place, rather than copied into a bucket


def local_state(modules: Iterable[nn.Module], *, parameters: bool = True) -> list[torch.Tensor]:
    """The parameters (unless ``parameters=False``) and buffers of ``modules``, each tensor once, in module order
    (the same on every rank holding the same layers)."""
    seen: set[int] = set()
    out = []
    for module in modules:
        for tensor in (*(module.parameters() if parameters else ()), *module.buffers()):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                # a tensor-parallel (DTensor) parameter: its shard, which the same tensor rank of every replica holds
                out.append(tensor.to_local() if isinstance(tensor, DTensor) else tensor)
    return out


def buffers_outside(module: nn.Module, layer_names: Sequence[str]) -> list[torch.Tensor]:
    """The module's buffers outside its pipeline layers, listed by name, so the same list on every rank whichever
    layers it holds."""
    seen: set[int] = set()
    out = []
    for name, buffer in module.named_buffers(remove_duplicate=False):
        if any(name.startswith(layer + ".") for layer in layer_names) or id(buffer) in seen:
            continue
        seen.add(id(buffer))
        out.append(buffer)
    return out


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s contents as a flat uint8 tensor (a view when it is contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' contents, one after the other, as one uint8 tensor."""
    return torch.cat([as_bytes(t) for t in tensors])


@torch.no_grad()
def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy the contents :func:`pack` put in ``flat`` back into ``tensors``."""
    offset = 0
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        part = flat[offset : offset + size]
        if part.storage_offset() % tensor.element_size():  # a wider dtype's view must start aligned
            part = part.clone()
        tensor.copy_(part.view(tensor.dtype).view(tensor.shape))
        offset += size


def broadcast_tensors(
    tensors: Sequence[torch.Tensor], src: int, group: dist.ProcessGroup | None, bucket_bytes: int = BUCKET_BYTES
) -> int:
    """Overwrite ``tensors`` on every rank of ``group`` with group rank ``src``'s values. Returns the bytes
    broadcast.

    A contiguous tensor of at least ``ALONE_BYTES`` travels alone, in place (no copy); the others are packed as
    bytes into buckets of at most ``bucket_bytes``, so biases, norms and buffers cost few collectives.
    """
    if group is None or dist.get_world_size(group) == 1:
        return 0
    sending = dist.get_rank(group) == src
    total = 0
    with torch.no_grad():
        for members in collective_plan(tensors, bucket_bytes):
            if len(members) == 1 and members[0].is_contiguous():
                flat = as_bytes(members[0])  # a view: received in place
                dist.broadcast(flat, group_src=src, group=group)
            else:
                nbytes = sum(t.numel() * t.element_size() for t in members)
                device = members[0].device
                flat = pack(members) if sending else torch.empty(nbytes, dtype=torch.uint8, device=device)
                dist.broadcast(flat, group_src=src, group=group)
                if not sending:
                    unpack(flat, members)
            total += flat.numel()
    return total


def collective_plan(tensors: Sequence[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """The tensors of each broadcast of :func:`broadcast_tensors`, in order (the same on every rank)."""
    collectives: list[list[torch.Tensor]] = []
    bucket: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            continue
        if nbytes >= ALONE_BYTES and tensor.is_contiguous():
            collectives.append([tensor])
            continue
        if bucket and (size + nbytes > bucket_bytes or bucket[0].device != tensor.device):
            collectives.append(bucket)
            bucket, size = [], 0
        bucket.append(tensor)
        size += nbytes
    if bucket:
        collectives.append(bucket)
    return collectives


@dataclass
class Broadcast:
    """``tensors`` take group rank ``src``'s values over ``group``."""

    tensors: list[torch.Tensor]
    src: int
    group: dist.ProcessGroup | None


@dataclass
class PendingBuild(Generic[T]):
    """What the agreed part of a build returns: the initial state the ranks share, then the rest of the build
    (which may fail on some ranks again, so it is agreed on separately)."""

    broadcasts: list[Broadcast]
    finish: Callable[[], T]

    def share(self) -> int:
        """Run the broadcasts (collectives: every rank, in the same order); the bytes broadcast."""
        return sum(broadcast_tensors(b.tensors, b.src, b.group) for b in self.broadcasts)
