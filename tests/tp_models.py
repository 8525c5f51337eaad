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
  ``pipeline_layers()``: refused.

On one device (the reference) there is no tensor mesh and both leave the module as it is.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tests.models import Block, PipeNet, RunSpec

MLP_PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


class TensorParallelNet(PipeNet):
    def __init__(self, tp: str = "layer", **spec: Any) -> None:
        super().__init__(**spec)
        self.tp = tp
        if tp == "outside":
            self.extra = nn.Linear(4, 4)  # not a pipeline layer, and unused

    def _tensor_mesh(self) -> Any:
        mesh = getattr(self, "device_mesh", None)
        names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
        return mesh["tensor_parallel"] if "tensor_parallel" in names else None

    def parallelize_layer(self, layer: nn.Module, tp_mesh: Any) -> nn.Module:
        if self.tp == "layer" and isinstance(layer, Block):
            parallelize_module(layer, tp_mesh, dict(MLP_PLAN))
        return layer

    def configure_model(self) -> None:
        tp_mesh = self._tensor_mesh()
        if tp_mesh is None or self.tp == "layer":
            return
        for block in self.blocks:
            parallelize_module(block, tp_mesh, dict(MLP_PLAN))
        if self.tp == "outside":
            parallelize_module(self.extra, tp_mesh, ColwiseParallel())


def make(run: RunSpec) -> TensorParallelNet:
    spec = dict(run.model)
    spec.setdefault("batch_format", run.data.get("batch_format", "tuple"))
    return TensorParallelNet(**spec)
