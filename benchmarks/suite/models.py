"""The models every implementation trains: emulated accelerators, and the small GPT for real compute.

Emulated layers sleep for their forward and backward time inside a custom autograd function while real
tensors flow (the weight is gathered and its gradient reduced by FSDP2, the activation sent between pipeline
ranks), as ``lightning_bfpp/measure/emulated.py``'s do; here the time scales with the rows a layer receives, so that a
data-parallel-only run, whose ranks each take a larger share of the global batch, is charged for it, and the
time slept is counted (:data:`benchmarks.suite.instrument.COUNTERS`). A sleeping process leaves the cores to
the others: several processes behave like several devices, on two cores. With ``Emulated.weight_grad_ms`` set,
the backward is split into an input-gradient and a weight-gradient node
(:func:`lightning_bfpp.measure.emulated.split_sleep`), so that zero-bubble schedules' ``I`` and ``W`` actions
each take their own time.

Each model is described by :class:`ModelParts`: its pipeline layers, a batch maker and the loss, which the
hand-driven workers use directly and the Lightning modules wrap.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

from benchmarks.suite.instrument import COUNTERS, MEMORY
from benchmarks.suite.spec import Emulated, GPTSpec, Job
from examples.train_gpt import GPT, SortDigits
from lightning_bfpp.measure.emulated import LayerStack, split_sleep


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        _sleep(forward_s)
        ctx.backward_s = backward_s
        ctx.weight_shape = weight.shape
        out = x + weight[:1].sum() * 0.0
        MEMORY.sample()
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        _sleep(ctx.backward_s)
        # contiguous: a mean loss hands back an expanded (stride-0) gradient, which gloo cannot receive into
        grads = grad.contiguous(), torch.zeros(ctx.weight_shape, dtype=grad.dtype, device=grad.device)
        MEMORY.sample()
        return *grads, None, None


def _sleep(seconds: float) -> None:
    start = time.perf_counter()
    time.sleep(seconds)
    COUNTERS.compute_s += time.perf_counter() - start
    COUNTERS.nominal_s += seconds


def _sleep_and_sample(seconds: float) -> None:
    """The split layer's sleep: counted, and memory sampled after it as :class:`_Sleep` samples it."""
    _sleep(seconds)
    MEMORY.sample()


class SleepLayer(nn.Module):
    """One emulated layer: ``forward_ms`` / ``backward_ms`` per ``microbatch_size`` rows, ``param_numel`` weights;
    with ``weight_grad_ms`` also ``weight_grad_ms``, the backward split in input and weight gradient."""

    def __init__(self, spec: Emulated, microbatch_size: int) -> None:
        super().__init__()
        self.forward_s, self.backward_s = spec.forward_ms / 1e3, spec.backward_ms / 1e3
        self.weight_grad_s = None if spec.weight_grad_ms is None else spec.weight_grad_ms / 1e3
        self.microbatch_size = microbatch_size
        self.weight = nn.Parameter(torch.zeros(spec.param_numel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.shape[0] / self.microbatch_size
        if self.weight_grad_s is None:
            return _Sleep.apply(x, self.weight, self.forward_s * scale, self.backward_s * scale)
        times = self.forward_s * scale, self.backward_s * scale, self.weight_grad_s * scale
        return split_sleep(x, self.weight, *times, sleep=_sleep_and_sample)


@dataclass
class ModelParts:
    """A model as the pipeline sees it: ordered layers, a batch of ``rows`` samples, and the loss."""

    layers: list[nn.Module]
    make_batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]  # (rows, seed) -> (inputs, targets)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def model_parts(job: Job) -> ModelParts:
    if job.model == "emulated":
        spec = job.emulated
        layers: list[nn.Module] = [SleepLayer(spec, job.microbatch_size) for _ in range(spec.layers)]

        def emulated_batch(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(seed)
            return torch.randn(rows, spec.activation_numel, generator=g), torch.zeros(rows)

        return ModelParts(layers, emulated_batch, _mean_loss, _frozen_sgd)
    gpt = build_gpt(job.gpt)

    def gpt_batch(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        data = SortDigits(rows, seed=seed)
        return data.inputs, data.targets

    return ModelParts(list(gpt.pipeline_layers()), gpt_batch, gpt_loss, _adamw)


def _mean_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output.mean()


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def _frozen_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    # lr 0: the step costs what an SGD step costs, and the emulated weights stay zero
    return torch.optim.SGD(params, lr=0.0)


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def build_gpt(spec: GPTSpec) -> TimedGPT:
    """The same initial weights in every process and implementation; memory is sampled after each layer."""
    torch.manual_seed(0)
    gpt = TimedGPT(layers=spec.layers, dim=spec.dim, heads=spec.heads, block_size=spec.block_size)
    for layer in gpt.pipeline_layers():
        layer.register_forward_hook(_sample_memory)
    return gpt


def _sample_memory(*_: Any) -> None:
    MEMORY.sample()


# -- Lightning modules ----------------------------------------------------------------------------------------


class EmulatedNet(LayerStack):
    """The emulated model for ``BFPPStrategy``: ``pipeline_layers()`` and a single-device step."""

    def __init__(self, spec: Emulated, microbatch_size: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SleepLayer(spec, microbatch_size) for _ in range(spec.layers))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, target = batch
        return _mean_loss(self(x), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _frozen_sgd(list(self.parameters()))


class ShardedEmulatedNet(EmulatedNet):
    """The emulated model for Lightning's ``ModelParallelStrategy``: FSDP2 per layer, no pipeline."""

    _sharded = False

    def configure_model(self) -> None:
        if self._sharded:  # Lightning may call the hook again (e.g. when restarting fit)
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)
        self._sharded = True


class TimedGPT(GPT):
    """``examples/train_gpt.py``'s GPT with a plain AdamW (as the hand-driven runs use) and no metrics logged."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return gpt_loss(self(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:  # type: ignore[override]
        return _adamw(list(self.parameters()))


def lightning_module(job: Job) -> L.LightningModule:
    if job.model == "gpt":
        return build_gpt(job.gpt)
    if job.kind == "fsdp":
        return ShardedEmulatedNet(job.emulated, job.microbatch_size)
    return EmulatedNet(job.emulated, job.microbatch_size)


def train_loader(job: Job, rows_per_batch: int, replicas: int) -> DataLoader:
    """``warmup + steps`` batches of ``rows_per_batch`` for each of ``replicas`` data-parallel replicas.

    The batches are built before training and the loader hands them out whole (``batch_size=None``; Lightning's
    distributed sampler deals them to the replicas), as the hand-driven and independent runs hold theirs: the
    per-sample indexing and collation of a default loader (about 1–5 ms per batch of 256 here, on every rank)
    is the data pipeline's cost, the same under any strategy, and would otherwise be counted as Lightning's.
    """
    rows = (job.warmup + job.steps) * rows_per_batch * replicas
    if job.model == "gpt":
        data = SortDigits(rows, seed=0)
        inputs, targets = data.inputs, data.targets
    else:
        g = torch.Generator().manual_seed(0)
        inputs, targets = torch.randn(rows, job.emulated.activation_numel, generator=g), torch.zeros(rows)
    batches = list(zip(inputs.split(rows_per_batch), targets.split(rows_per_batch), strict=True))
    return DataLoader(batches, batch_size=None)  # type: ignore[arg-type]
