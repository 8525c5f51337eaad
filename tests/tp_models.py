"""Modules with tensor-parallel layers for ``tensor_parallel_size > 1`` (built by the worker from a RunSpec).

The suite's ``PipeNet`` whose blocks' MLPs are split Megatron-style over the tensor group: ``up`` column-wise
(each tensor rank computes half the hidden units), ``down`` row-wise (partial sums all-reduced), so a block's
output is replicated over the group and crosses to the next stage as a plain tensor. The embedding, the norms and
the head stay replicated. Two ways in, as users write them:

- ``tp="layer"``: the module's ``parallelize_layer(layer, tp_mesh)``, which the strategy calls on each layer
  this rank holds, after the split;
- ``tp="configure_model"``: Lightning's convention (as under ``ModelParallelStrategy``): ``configure_model``
  applies ``parallelize_module`` to every block with ``self.device_mesh["tensor_parallel"]``, before the split;
- ``tp="outside"``: ``configure_model`` also parallelises the module's ``extra`` linear, which is outside
  ``pipeline_layers()``: refused;
- ``tp="not_last"``: ``parallelize_layer`` leaves the last block whole; with ``tie_blocks`` its ``up`` weight,
  tied to the first block's split one, is then split differently on two stages: refused.

On one device (the reference) there is no tensor mesh and both leave the module as it is.

``gpt_module``: the GPT of ``examples/train_gpt.py`` (and of the benchmark suite), whose ``parallelize_layer``
splits each block's attention by heads (a fused, head-by-head ``qkv``) and its MLP, trained with SGD on the
example's sorting task; ``gpt_reference_run`` is the same on one process.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader

from examples.train_gpt import GPT, SortDigits
from tests.models import Block, PipeNet, Reference, RunSpec, fit_on_one_device

MLP_PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


class TensorParallelNet(PipeNet):
    def __init__(self, tp: str = "layer", **spec: Any) -> None:
        super().__init__(**spec)
        self.tp = tp
        if tp == "outside":
            self.extra = nn.Linear(4, 4)  # not a pipeline layer, and unused
        self.blocks[-1].last = True

    def _tensor_mesh(self) -> Any:
        mesh = getattr(self, "device_mesh", None)
        names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
        return mesh["tensor_parallel"] if "tensor_parallel" in names else None

    def parallelize_layer(self, layer: nn.Module, tp_mesh: Any) -> nn.Module:
        every = self.tp == "layer" or (self.tp == "not_last" and not getattr(layer, "last", False))
        if every and isinstance(layer, Block):
            parallelize_module(layer, tp_mesh, dict(MLP_PLAN))
        return layer

    def configure_model(self) -> None:
        tp_mesh = self._tensor_mesh()
        if tp_mesh is None or self.tp not in ("configure_model", "outside"):
            return
        for block in self.blocks:
            parallelize_module(block, tp_mesh, dict(MLP_PLAN))
        if self.tp == "outside":
            parallelize_module(self.extra, tp_mesh, ColwiseParallel())


def make(run: RunSpec) -> TensorParallelNet:
    spec = dict(run.model)
    spec.setdefault("batch_format", run.data.get("batch_format", "tuple"))
    return TensorParallelNet(**spec)


class SGDGPT(GPT):
    """The example's GPT with plain SGD, whose updates show a gradient's scale (AdamW's normalisation hides it)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:  # type: ignore[override]
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def gpt_module(run: RunSpec) -> GPT:
    torch.manual_seed(0)
    return SGDGPT(layers=run.model.get("layers", 4), dim=32, heads=4, block_size=16, lr=0.5)


def _sorting_data(run: RunSpec) -> SortDigits:
    return SortDigits(run.model.get("samples", 96), seed=0)


def gpt_loader(run: RunSpec, trainer: L.Trainer) -> DataLoader:
    return DataLoader(_sorting_data(run), batch_size=run.local_batch_size)


def gpt_reference_run(run: RunSpec) -> Reference:
    """``run`` on one process on the global batches (the distributed sampler's order, as ``reference_run``)."""
    return fit_on_one_device(gpt_module(run), _sorting_data(run), run)
