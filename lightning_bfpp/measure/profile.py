"""Measure a LightningModule's pipeline layers on this machine: the planner's model description.

Each layer of ``pipeline_layers()`` runs forward and backward on the output of the previous one, starting
from what ``training_step`` passes to ``self(...)`` for one real batch (the same capture the strategy uses),
and records its median forward and backward time, its parameter bytes, the bytes it hands on, and the bytes
autograd keeps for its backward (counted once per storage, parameters excluded). The backward is timed twice:
its input-gradient pass alone (``torch.autograd.grad`` with respect to the layer's inputs, as torch's
``stage_backward_input`` runs it) and then whole; the difference is the weight-gradient part that zero-bubble
schedules run as their own ``W`` action (``LayerCost.backward_weight_s``). A layer whose inputs need no
gradient (the first, on token ids) has only a weight pass. The whole model runs on
one device, layer by layer, so it must fit there; for models that do not, describe the layers instead
(``lightning_bfpp.plan.costs``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from lightning.pytorch import LightningModule

from lightning_bfpp.adapter.user_step import capture_model_input
from lightning_bfpp.engine._compat import tree_flatten
from lightning_bfpp.engine.layers import pipeline_layers
from lightning_bfpp.plan.costs import LayerCost, ModelProfile


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_module(
    module: LightningModule,
    batch: Any,
    *,
    microbatch_size: int | None = None,
    repeats: int = 5,
    name: str | None = None,
) -> ModelProfile:
    """Per-layer costs of ``module`` for one micro-batch, ``batch`` (already on the module's device)."""
    layers = pipeline_layers(module)
    args, kwargs = capture_model_input(module, module.training_step, "training_step", batch, 0)
    sizes = {t.shape[0] for t in _tensors(args) if t.dim() > 0}
    device = next((t.device for t in _tensors(args)), torch.device("cpu"))
    costs = []
    inputs: tuple[Any, ...] = args
    first = True
    for _, layer in layers:
        param_storages = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        forward_times, backward_times, input_grad_times = [], [], []
        saved_bytes = 0
        output: Any = None
        for attempt in range(repeats + 1):
            leaves = [
                # the batch needs no gradient, as in the pipeline; later layers' inputs are activations
                t.detach().requires_grad_(t.is_floating_point() and not first) if isinstance(t, torch.Tensor) else t
                for t in (inputs if isinstance(inputs, tuple) else (inputs,))
            ]
            storages: dict[int, int] = {}

            def pack(
                t: torch.Tensor, storages: dict[int, int] = storages, skip: set[int] = param_storages
            ) -> torch.Tensor:
                storage = t.untyped_storage()
                if storage.data_ptr() not in skip:
                    storages[storage.data_ptr()] = storage.nbytes()
                return t

            _sync(device)
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                # later layers get activations as StageModule passes them: one tensor, or a tuple as one argument
                activation = leaves[0] if len(leaves) == 1 else tuple(leaves)
                output = layer(*leaves, **kwargs) if first else layer(activation)
            _sync(device)
            middle = time.perf_counter()
            outs = [t for t in _tensors(output) if t.requires_grad]
            grads = [torch.ones_like(t) for t in outs]
            wanted = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
            if outs and wanted:  # the input-gradient pass alone; the graph stays for the whole backward
                torch.autograd.grad(outs, wanted, grads, retain_graph=True, allow_unused=True)
            _sync(device)
            input_done = time.perf_counter()
            if outs:
                torch.autograd.backward(outs, grads)
            _sync(device)
            end = time.perf_counter()
            if attempt:  # the first run warms up
                forward_times.append(middle - start)
                input_grad_times.append(input_done - middle)
                backward_times.append(end - input_done)
                saved_bytes = sum(storages.values())
        layer.zero_grad(set_to_none=True)
        backward_s = statistics.median(backward_times)
        costs.append(
            LayerCost(
                forward_s=statistics.median(forward_times),
                backward_s=backward_s,
                param_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
                output_bytes=sum(t.numel() * t.element_size() for t in _tensors(output)),
                saved_bytes=saved_bytes,
                backward_weight_s=max(backward_s - statistics.median(input_grad_times), 0.0),
            )
        )
        outputs = _tensors(output)
        inputs = tuple(t.detach() for t in outputs) if isinstance(output, tuple) else (output.detach(),)
        first = False
    size = microbatch_size or (sizes.pop() if len(sizes) == 1 else 1)
    return ModelProfile(tuple(costs), microbatch_size=size, name=name or type(module).__name__)
