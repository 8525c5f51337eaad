"""Gradient norms over the whole pipelined, sharded model.

Lightning clips with ``torch.nn.utils.clip_grad_norm_`` over the parameters a rank holds. Under FSDP2 the
gradients are DTensors, so their norm already covers the data-parallel shards; but each pipeline rank
holds only its own stages, so the norm must also be combined over the pipeline group before clipping, or
each rank would clip its stages by a different factor (torchtitan does the same, see its issue #596).
A parameter tied across stages has one copy per stage holding the same gradient: only the owner's counts
(``exclude`` names the others), as the one shared parameter does on one device; all are clipped alike.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def total_norm(
    parameters: Iterable[torch.Tensor],
    norm_type: float,
    pipeline_group: dist.ProcessGroup | None,
    exclude: Collection[int] = frozenset(),
) -> torch.Tensor:
    """The norm of all gradients of the model, identical on every rank (a collective over the pipeline).

    ``exclude``: ids of parameters not counted (the copies of tied parameters on non-owner stages)."""
    grads = [p.grad for p in parameters if p.grad is not None and id(p) not in exclude]
    if grads:
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # reduces over the data-parallel shards
    else:
        norm = torch.zeros(())
    norm = norm.float()
    if pipeline_group is not None and dist.get_world_size(pipeline_group) > 1:
        if math.isinf(norm_type):
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=pipeline_group)
        else:
            norm = norm.pow(norm_type)
            dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=pipeline_group)
            norm = norm.pow(1.0 / norm_type)
    return norm


def clip_grad_norm(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float,
    pipeline_group: dist.ProcessGroup | None,
    exclude: Collection[int] = frozenset(),
) -> torch.Tensor:
    """Scale all gradients by ``max_norm / total_norm`` when larger; returns the norm before clipping.

    Parameters in ``exclude`` are not counted in the norm but are clipped like the others."""
    parameters = list(parameters)
    norm = total_norm(parameters, norm_type, pipeline_group, exclude)
    grads = [p for p in parameters if p.grad is not None]
    if grads:
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, norm.to(grads[0].grad.device))
    return norm
