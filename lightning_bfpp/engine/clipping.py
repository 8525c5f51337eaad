"""Gradient norms over the whole pipelined, sharded model.

Lightning clips with ``torch.nn.utils.clip_grad_norm_`` over the parameters a rank holds. Under FSDP2 the
gradients are DTensors, so their norm already covers the data-parallel shards; but each pipeline rank
holds only its own stages, so the norm must also be combined over the pipeline group before clipping, or
each rank would clip its stages by a different factor (torchtitan does the same, see its issue #596).
A parameter tied across stages has one copy per stage holding the same gradient: only the owner's counts
(``exclude`` names the others), as the one shared parameter does on one device; all are clipped alike.
With tensor parallelism a stage holds gradients on two meshes (data-parallel shards of replicated layers,
(data, tensor) shards of parallelised ones): each mesh's norm is reduced over its shards, then they are combined.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from typing import Any

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
    # one norm per mesh: gradients sharded over the data-parallel group only, and with tensor parallelism
    # those sharded over (data, tensor), cannot be stacked into one DTensor norm
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for grad in grads:
        by_mesh.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # reduces over the shards (data-parallel, and tensor-parallel ones)
        norms.append(norm.float())
    if not norms:
        norm = torch.zeros(())
    elif len(norms) == 1:
        norm = norms[0]
    elif math.isinf(norm_type):
        norm = torch.stack(norms).max()
    else:
        norm = torch.stack(norms).pow(norm_type).sum().pow(1.0 / norm_type)
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
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm.to(group[0].grad.device))
    return norm
