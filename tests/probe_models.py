"""Model factories for tests that probe how the pipeline runs, not what it computes (``RunSpec.model_factory``).

- :func:`sleeping_net`: layers that sleep for their forward and backward (``lightning_bfpp/plan/emulated.py``), so
  that compute lasts long enough for the timing of weight gathers around it to be measured.
- :func:`aliased_net`: a PipeNet with an alias of one of its layers, which the pipeline must refuse on
  every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_bfpp.plan.emulated import EmulatedLayer
from tests.models import LayerStack, PipeNet, RunSpec

# per layer and micro-batch; 8 layers over (p, v) = (2, 2) make a stage's sweep over 4 micro-batches last
# 4 x 2 x 20 ms = 160 ms, against a few milliseconds for gathering a stage's 2 x 2 MB of weights
SLEEP_MS = 20.0
SLEEP_LAYER_PARAMS = 500_000


class SleepingNet(LayerStack):
    """Identity layers that take ``SLEEP_MS`` per forward and backward and hold real weights to gather."""

    def __init__(self, num_layers: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EmulatedLayer(SLEEP_MS, SLEEP_MS, SLEEP_LAYER_PARAMS) for _ in range(num_layers))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        return self(x).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def sleeping_net(run: RunSpec) -> SleepingNet:
    return SleepingNet()


def aliased_net(run: RunSpec) -> PipeNet:
    """A PipeNet whose last block is also reachable as ``self.last`` (as ``self.head = self.blocks[-1]`` would)."""
    net = PipeNet(**{"batch_format": run.data.get("batch_format", "tuple"), **run.model})
    net.last = net.blocks[-1]
    return net
