"""Megatron-LM's two tensor-parallel region crossings as autograd functions, for layers split by hand.

torch's ``ColwiseParallel`` / ``RowwiseParallel`` place these collectives themselves; a layer whose split they
cannot express (a vocabulary-parallel lookup, a whole module fed one rank's share, an emulated layer) uses them:

- :class:`SumGradient` (Megatron's ``f``): the input as is, its gradient summed over the group (each rank's
  computation from it covers only the rank's part);
- :class:`SumOutputs` (Megatron's ``g``): the ranks' partial outputs summed, the gradient as is (every rank
  holds the whole sum, so its gradient is already the whole one).

This module does not import Lightning.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class SumGradient(torch.autograd.Function):
    """Identity forward; the gradient summed over ``group``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SumOutputs(torch.autograd.Function):
    """The ranks' partial outputs summed over ``group``; the gradient passes unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None
