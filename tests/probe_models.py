"""Model factories for tests that probe how the pipeline runs, not what it computes (``RunSpec.model_factory``).

- :func:`sleeping_net`: layers that sleep for their forward and backward (``lightning_bfpp/measure/emulated.py``), so
  that compute lasts long enough for the timing of weight gathers around it to be measured.
- :func:`aliased_net`: a PipeNet with an alias of one of its layers, which the pipeline must refuse on
  every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_bfpp.measure.emulated import EmulatedLayer, LayerStack
from tests.models import PipeNet, RunSpec

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
    return SleepingNet(**run.model)


def aliased_net(run: RunSpec) -> PipeNet:
    """A PipeNet whose last block is also reachable as ``self.last`` (as ``self.head = self.blocks[-1]`` would)."""
    net = PipeNet(**{"batch_format": run.data.get("batch_format", "tuple"), **run.model})
    net.last = net.blocks[-1]
    return net


class _Marked(torch.autograd.Function):
    """``x + w``, recording the marker value ``w`` carries when the backward passes through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, log: list[list[Any]]) -> torch.Tensor:
        ctx.log, ctx.marker, ctx.shape = log, float(w), w.shape
        return x + w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        ctx.log.append(["B", ctx.marker])
        return grad, grad.sum().reshape(ctx.shape), None


class MarkerLayer(nn.Module):
    """One scalar weight; its forward and backward record the weight's value (the chunk id its owner wrote)."""

    def __init__(self, log: list[list[Any]]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(["F", float(self.w), torch.is_grad_enabled()])
        return _Marked.apply(x, self.w, self.log)


class MarkerNet(LayerStack):
    """Weight passing's routing probe (``schedule="weight_passing"``, one layer per chunk): at the start of
    training every owner fills its chunk's weight with the chunk id, so what a layer sees says which chunk
    reached it, and the loss weights rank ``r``'s micro-batches by ``2**r``, so the gradient an owner ends up
    with says which ranks' contributions reached it, and how often. SGD with ``lr=0`` keeps the markers."""

    def __init__(self, num_layers: int) -> None:
        super().__init__()
        self.visits: list[list[Any]] = []
        self.layers = nn.ModuleList(MarkerLayer(self.visits) for _ in range(num_layers))
        self.owner_gradients: dict[int, float] = {}

    def on_train_start(self) -> None:
        with torch.no_grad():
            for index, layer in enumerate(self.layers):
                if isinstance(layer, MarkerLayer):  # owned here (the others are stand-ins)
                    layer.w.fill_(index)
        self.visits.clear()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        return self(x).mean() * 2.0**self.global_rank

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        for index, layer in enumerate(self.layers):
            if isinstance(layer, MarkerLayer) and layer.w.grad is not None:
                self.owner_gradients[index] = float(layer.w.grad)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def marker_report(self) -> dict[str, Any]:
        return {"visits": self.visits, "owner_gradients": self.owner_gradients}


def marker_net(run: RunSpec) -> MarkerNet:
    return MarkerNet(num_layers=run.data_parallel_size)
