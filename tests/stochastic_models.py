"""Modules whose steps draw random numbers, or misbehave on purpose, before or after ``self(...)``.

Built from a RunSpec by ``RunSpec.model_factory`` (see tests/models.py). The consistency model's layers are
the identity (times a weight of exactly 1), so each of its objectives is exactly 0 when the model is fed the
same draw its loss is computed with, and clearly not otherwise.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import SumMetric

from lightning_bfpp.measure.emulated import LayerStack
from tests.models import PipeNet, RunSpec


class Unit(nn.Module):
    """``x * w`` with ``w == 1``: the identity, with a parameter to shard and an exact result."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class DrawsBeforeModel(LayerStack):
    """Denoising, masking, NumPy and Python noise drawn before ``self(...)``, each logged as its own loss.

    A side effect before ``self(...)`` as well: ``samples_seen`` counts the samples each step sees.
    """

    def __init__(self, width: int = 6, num_layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Unit(width) for _ in range(num_layers))
        self.samples_seen = SumMetric()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        self.samples_seen.update(torch.tensor(float(len(x))))
        noisy = x + torch.randn_like(x)  # denoising
        mask = (torch.rand_like(x) < 0.3).float()  # masking
        numpy_noise = torch.from_numpy(np.random.standard_normal(x.shape)).float()
        python_noise = torch.tensor([random.random() for _ in range(x.shape[-1])])
        inputs = torch.cat([noisy, x * mask, x + numpy_noise, x + python_noise])
        out = self(inputs).chunk(4)
        losses = {
            "loss_randn": F.mse_loss(out[0], noisy),
            "loss_mask": F.mse_loss(out[1], x * mask),
            "loss_numpy": F.mse_loss(out[2], x + numpy_noise),
            "loss_python": F.mse_loss(out[3], x + python_noise),
        }
        for name, value in losses.items():
            self.log(name, value)
        self.log("samples_seen", self.samples_seen, on_step=False, on_epoch=True)
        return sum(losses.values())  # type: ignore[return-value]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def draws_before_model(run: RunSpec) -> DrawsBeforeModel:
    return DrawsBeforeModel()


class NoisyPipeNet(PipeNet):
    """PipeNet trained to denoise: its loss depends on every draw, so two runs agree only if the draws do."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = self._unpack(batch)
        keep = (torch.rand(x.shape[0], 1) > 0.25).float()
        out = self(x * keep + 0.1 * torch.randn_like(x))
        loss = F.mse_loss(out, y) + 0.01 * float(np.random.standard_normal()) ** 2 + 0.01 * random.random()
        self.log("train_loss", loss)
        return loss


def noisy_pipenet(run: RunSpec) -> NoisyPipeNet:
    return NoisyPipeNet(**run.model)


class NonFiniteLossNet(PipeNet):
    """PipeNet whose loss turns NaN at training step 2, as a diverging run's does."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = self._unpack(batch)
        loss = F.mse_loss(self(x), y)
        if self.trainer.global_step == 2:
            loss = loss * float("nan")
        self.log("train_loss", loss)
        return loss


def non_finite_loss_net(run: RunSpec) -> NonFiniteLossNet:
    return NonFiniteLossNet(**run.model)


class SyncDistNet(PipeNet):
    """Logs from the step with ``sync_dist=True``, as DDP code does; the values must be one device's."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = self._unpack(batch)
        out = self(x)
        loss = F.mse_loss(out, y)
        self.log("train_loss", loss, sync_dist=True)
        self.log("samples", float(len(x)), reduce_fx="sum", sync_dist=True)
        self.log("max_err", (out - y).abs().max(), reduce_fx="max", sync_dist=True)
        return loss


def sync_dist_net(run: RunSpec) -> SyncDistNet:
    return SyncDistNet(**run.model)
