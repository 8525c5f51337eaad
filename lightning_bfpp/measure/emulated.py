"""Layers that behave like an accelerator's: fixed wall-clock time per forward and backward, no CPU work.

On a few CPU cores, processes running real compute share the cores, so a pipeline bubble costs nothing
and schedules cannot be compared. An :class:`EmulatedLayer` sleeps for its forward and backward time
instead (the process yields the core), while real tensors still flow: its weight (``param_numel`` fp32
values) is gathered and its gradient reduced by FSDP2, and its activation (``activation_numel`` values
per sample) is sent between pipeline ranks. Several processes then behave like several devices.

Part of the package because ``plan calibrate`` trains such a model to measure the runtime's own cost per
schedule action and per step on the machine it plans for; the benchmarks and tests use it too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        ctx.weight_shape = weight.shape
        return x + weight[:1].sum() * 0.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        # contiguous: a mean loss hands back an expanded (stride-0) gradient, which gloo cannot receive into
        return grad.contiguous(), torch.zeros(ctx.weight_shape, dtype=grad.dtype, device=grad.device), None, None


class EmulatedLayer(nn.Module):
    def __init__(self, forward_ms: float, backward_ms: float, param_numel: int) -> None:
        super().__init__()
        self.forward_s, self.backward_s = forward_ms / 1e3, backward_ms / 1e3
        self.weight = nn.Parameter(torch.zeros(param_numel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.weight, self.forward_s, self.backward_s)


@dataclass(frozen=True)
class EmulatedModel:
    """A model of ``layers`` identical emulated layers; times are per micro-batch."""

    layers: int = 16
    forward_ms: float = 5.0
    backward_ms: float = 10.0
    param_numel: int = 250_000
    activation_numel: int = 4096

    @property
    def param_bytes(self) -> int:
        return 4 * self.param_numel

    @property
    def activation_bytes(self) -> int:
        return 4 * self.activation_numel


class EmulatedNet(L.LightningModule):
    def __init__(self, spec: EmulatedModel) -> None:
        super().__init__()
        self.spec = spec
        self.layers = nn.ModuleList(
            EmulatedLayer(spec.forward_ms, spec.backward_ms, spec.param_numel) for _ in range(spec.layers)
        )

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self(x).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def emulated_loader(spec: EmulatedModel, microbatches: int, steps: int, microbatch_size: int = 1) -> DataLoader:
    """``steps`` batches of ``microbatches`` micro-batches of ``microbatch_size`` samples."""
    batch = microbatches * microbatch_size
    # the same batches in every process: the ranks of a pipeline check that they load the same batch
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(steps * batch, spec.activation_numel // microbatch_size, generator=generator))
    return DataLoader(data, batch_size=batch)
