"""Layers that behave like an accelerator's: fixed wall-clock time per forward and backward, no CPU work.

On a few CPU cores, processes running real compute share the cores, so a pipeline bubble costs nothing
and schedules cannot be compared. An :class:`EmulatedLayer` sleeps for its forward and backward time
instead (the process yields the core), while real tensors still flow: its weight (``param_numel`` fp32
values) is gathered and its gradient reduced by FSDP2, and its activation (``activation_numel`` values
per sample) is sent between pipeline ranks. Several processes then behave like several devices.

With ``weight_grad_ms`` set, a layer's backward is split as zero-bubble schedules split it (:func:`split_sleep`):
``backward_ms`` is spent computing the input gradient and ``weight_grad_ms`` the weight gradient, each only in
the autograd pass that asks for it, so ``torch.distributed.pipelining``'s ``BACKWARD_INPUT`` and
``BACKWARD_WEIGHT`` take those times; a full backward takes both, as one node sleeping their sum would.

Under tensor parallelism (``EmulatedNet.parallelize_layer``, run by ``BFPPStrategy(tensor_parallel_size=t)``)
a layer is split as Megatron splits a block: each rank of the tensor group keeps ``1/t`` of the weight (a
DTensor sharded over the group, which FSDP2 then shards over the data-parallel group), sleeps ``1/t`` of
each time, and all-reduces the layer's output in the forward and its input gradient in the backward with
real collectives on the group (one all-reduce each way: the planner's ``tensor_parallel_all_reduces=1``).

Part of the package because ``plan calibrate`` trains such a model to measure the runtime's own cost per
schedule action and per step on the machine it plans for; the benchmarks and tests use it too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_bfpp.engine.tensor_regions import SumGradient


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


Sleep = Callable[[float], None]


class _SleepInput(torch.autograd.Function):
    """The forward time, and the input-gradient time in the backward pass that computes ``x``'s gradient.

    ``anchor`` (the weight, passed only when ``x`` needs no gradient, as a first layer's input) keeps the node in
    the graph, so that the layer's whole backward still takes ``input + weight`` time: that backward is then
    the weight pass (torch's first stage runs its whole backward as its ``BACKWARD_WEIGHT``).
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, anchor: torch.Tensor | None, forward_s: float, input_grad_s: float, sleep: Sleep
    ) -> torch.Tensor:
        sleep(forward_s)
        ctx.input_grad_s, ctx.sleep = input_grad_s, sleep
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        ctx.sleep(ctx.input_grad_s)
        # contiguous: a mean loss hands back an expanded (stride-0) gradient, which gloo cannot receive into
        return (grad.contiguous() if ctx.needs_input_grad[0] else None), None, None, None, None


class _SleepWeight(torch.autograd.Function):
    """A zero that depends on the weight: the weight-gradient time, spent only when the weight's gradient is asked.

    It keeps the layer's input until then, as a real weight gradient (``x^T · grad``) does.
    """

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, x: torch.Tensor, weight_grad_s: float, sleep: Sleep) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.weight_grad_s, ctx.sleep, ctx.weight_shape = weight_grad_s, sleep, weight.shape
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        ctx.sleep(ctx.weight_grad_s)
        (_,) = ctx.saved_tensors  # the input a real weight gradient reads (autograd frees it after this pass)
        return torch.zeros(ctx.weight_shape, dtype=grad.dtype, device=grad.device), None, None, None


def split_sleep(
    x: torch.Tensor,
    weight: torch.Tensor,
    forward_s: float,
    input_grad_s: float,
    weight_grad_s: float,
    sleep: Sleep = time.sleep,
) -> torch.Tensor:
    """``x`` after sleeping ``forward_s``, with a backward split in two autograd nodes.

    ``torch.autograd.grad(out, inputs=[x])`` (torch's ``stage_backward_input``) sleeps ``input_grad_s`` only,
    a weight pass from there (``stage_backward_weight``) ``weight_grad_s`` only, and ``out.backward()`` both.
    ``sleep`` is called with every duration (the benchmarks count the time slept).
    """
    anchor = None if x.requires_grad else weight
    head = _SleepInput.apply(x, anchor, forward_s, input_grad_s, sleep)
    return head + _SleepWeight.apply(weight, x.detach(), weight_grad_s, sleep)


class _LeaveTensorGroup(torch.autograd.Function):
    """Megatron's ``g``: the ranks' partial outputs all-reduced (averaged here, so that values stay put across
    layers: an emulated layer computes nothing); the gradient as is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out.div_(dist.get_world_size(group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class EmulatedLayer(nn.Module):
    """``forward_ms`` and ``backward_ms`` of sleep per call; with ``weight_grad_ms``, ``backward_ms`` is the
    input-gradient time and ``weight_grad_ms`` the weight-gradient time, in separate autograd nodes
    (:func:`split_sleep`); without it, one node sleeps ``backward_ms`` for the whole backward."""

    def __init__(
        self,
        forward_ms: float,
        backward_ms: float,
        param_numel: int,
        weight_grad_ms: float | None = None,
        per_sample: bool = False,
    ) -> None:
        super().__init__()
        self.per_sample = per_sample
        self.forward_s, self.backward_s = forward_ms / 1e3, backward_ms / 1e3
        self.weight_grad_s = None if weight_grad_ms is None else weight_grad_ms / 1e3
        self.weight = nn.Parameter(torch.zeros(param_numel))
        self.tensor_group: dist.ProcessGroup | None = None

    def parallelize(self, tp_mesh: DeviceMesh) -> None:
        """Split over ``tp_mesh``: ``1/t`` of the weight (sharded as a DTensor) and of each time per rank, and an
        all-reduce of the output in the forward and of the input gradient in the backward."""
        size = tp_mesh.size()
        if self.weight.numel() % size:
            raise ValueError(f"an emulated layer of {self.weight.numel()} values does not split over {size} ranks")
        self.weight = nn.Parameter(distribute_tensor(self.weight.detach(), tp_mesh, [Shard(0)]))
        self.forward_s, self.backward_s = self.forward_s / size, self.backward_s / size
        if self.weight_grad_s is not None:
            self.weight_grad_s /= size
        self.tensor_group = tp_mesh.get_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.tensor_group is not None:
            x = SumGradient.apply(x, self.tensor_group)
            weight = weight.to_local() if isinstance(weight, DTensor) else weight
        k = x.shape[0] if self.per_sample else 1  # samples in this micro-batch
        if self.weight_grad_s is None:
            y = _Sleep.apply(x, weight, k * self.forward_s, k * self.backward_s)
        else:
            y = split_sleep(x, weight, k * self.forward_s, k * self.backward_s, k * self.weight_grad_s)
        return y if self.tensor_group is None else _LeaveTensorGroup.apply(y, self.tensor_group)


@dataclass(frozen=True)
class EmulatedModel:
    """A model of ``layers`` identical emulated layers; times are per micro-batch, or with ``per_sample`` per
    sample (a micro-batch of ``k`` samples sleeps ``k`` times as long, as a real layer's compute grows: what a
    planner that chooses micro-batch sizes from one measured batch assumes).

    ``weight_grad_ms`` set splits each layer's backward: ``backward_ms`` is then the input-gradient time only.
    """

    layers: int = 16
    forward_ms: float = 5.0
    backward_ms: float = 10.0
    param_numel: int = 250_000
    activation_numel: int = 4096
    weight_grad_ms: float | None = None
    per_sample: bool = False

    @property
    def param_bytes(self) -> int:
        return 4 * self.param_numel

    @property
    def activation_bytes(self) -> int:
        return 4 * self.activation_numel


class LayerStack(L.LightningModule):
    """A module that is its ``self.layers`` applied in order: the smallest ``pipeline_layers()`` contract, shared
    by the emulated models here, the benchmark suite's and the tests'."""

    layers: nn.ModuleList

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class EmulatedNet(LayerStack):
    def __init__(self, spec: EmulatedModel) -> None:
        super().__init__()
        self.spec = spec
        self.layers = nn.ModuleList(
            EmulatedLayer(spec.forward_ms, spec.backward_ms, spec.param_numel, spec.weight_grad_ms, spec.per_sample)
            for _ in range(spec.layers)
        )

    def parallelize_layer(self, layer: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
        """``BFPPStrategy(tensor_parallel_size=t)`` calls this for each layer a rank holds."""
        assert isinstance(layer, EmulatedLayer)
        layer.parallelize(tp_mesh)
        return layer

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
