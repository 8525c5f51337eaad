"""Measure a LightningModule's pipeline layers on this machine: the planner's model description.

Each layer of ``pipeline_layers()`` runs forward and backward on the output of the previous one, starting
from what ``training_step`` passes to ``self(...)`` for one real batch (the same capture the strategy uses, passed
in by the caller: ``lightning_bfpp.adapter.user_step.training_step_input``; this package imports nothing above the
engine), and records its median forward and backward time, its parameter bytes, the bytes it hands on, and the bytes
autograd keeps for its backward (counted once per storage, parameters excluded). With ``split_backward`` (for the
zero-bubble schedules) the layer also runs a forward and torch's own split backward, as its runtime runs a
``BACKWARD_INPUT`` and a ``BACKWARD_WEIGHT`` (``stage_backward_input``, then ``stage_backward_weight``): each pass is
timed (``LayerCost.backward_input_s``, ``backward_weight_s``), and the gradients the first keeps for the second
are counted (``intermediate_grad_bytes``: what a split backward holds from each ``I`` to its ``W`` beside the
saved activations). The two passes need not add up to the whole backward: a layer whose backward is one autograd
node runs that node in both. A layer whose inputs need no gradient (the first, on token
ids) has only a weight pass. The whole model runs on
one device, layer by layer, so it must fit there; for models that do not, describe the layers instead
(``lightning_bfpp.plan.costs``).

With ``parallelize`` (tensor parallelism), every process of a tensor group measures together: each layer is
copied and split over the group by the module's own parallelisation before it runs, so its times are one rank's
share of the compute, whatever the plan leaves whole, and its bytes one rank's shares. The group's collectives
are counted in the first run and their time, measured on the group back to back, is
taken out: the planner charges them as a step pays them (``Cluster.tensor_collective_overhead_s``: each also
waits for the other member, which a profile's lockstep hides), and ``LayerCost.measured_split`` marks the layer.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_bfpp.engine._compat import (
    CollectiveCounter,
    backward_input,
    backward_weight,
    kept_for_weight_pass,
    tree_flatten,
)
from lightning_bfpp.engine.layers import materialize_meta, pipeline_layers
from lightning_bfpp.plan.costs import LayerCost, ModelProfile

# what a module's step passes to ``self(...)`` for a batch: the first layer's positional and keyword arguments
ModelInput = tuple[tuple[Any, ...], dict[str, Any]]
Module = TypeVar("Module", bound=nn.Module)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's share of a tensor-parallel tensor (what it stores); any other tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def _collective_s(mesh: DeviceMesh, like: list[torch.Tensor], repeats: int) -> float:
    """The median time of one all-reduce of ``like``'s bytes over ``mesh``'s group, back to back."""
    buffer = torch.zeros(max(sum(t.numel() * t.element_size() for t in like) // 4, 1), device=like[0].device)
    group = mesh.get_group()
    times = []
    for attempt in range(repeats + 1):
        start = time.perf_counter()
        torch.distributed.all_reduce(buffer, group=group)
        if attempt:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _fresh(leaves: list[Any]) -> list[Any]:
    """The same inputs as new leaves (their gradient not yet taken)."""
    return [t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in leaves]


def _leaves(inputs: Any, first: bool) -> list[Any]:
    """A layer's inputs as new leaves: the batch needs no gradient, as in the pipeline; later layers' inputs are
    activations."""
    return [
        t.detach().requires_grad_(t.is_floating_point() and not first) if isinstance(t, torch.Tensor) else t
        for t in (inputs if isinstance(inputs, tuple) else (inputs,))
    ]


def _call(layer: nn.Module, leaves: list[Any], kwargs: dict[str, Any], first: bool) -> Any:
    """The first layer gets the step's arguments; later layers get activations as StageModule passes them: one
    tensor, or a tuple as one argument."""
    return layer(*leaves, **kwargs) if first else layer(leaves[0] if len(leaves) == 1 else tuple(leaves))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _split_backward(
    layer: nn.Module, leaves: list[Any], kwargs: dict[str, Any], first: bool, device: torch.device
) -> tuple[float, float, int]:
    """One forward of ``layer`` on ``leaves``, then torch's split backward: the input pass's and the weight pass's
    seconds, and the bytes the first keeps for the second."""
    output = _call(layer, leaves, kwargs, first)
    # copies: torch's input pass detaches its outputs in place, which a view refuses (a copy changes no intermediate)
    outs = [t.clone() for t in _tensors(output) if t.requires_grad]
    weights = [p for p in layer.parameters() if p.requires_grad]
    _sync(device)
    start = time.perf_counter()
    groups = backward_input(outs, [torch.ones_like(t) for t in outs], leaves, weights)
    _sync(device)
    middle = time.perf_counter()
    kept = kept_for_weight_pass(groups)  # the weight pass lets go of them
    resumed = time.perf_counter()
    backward_weight(weights, groups)
    _sync(device)
    return middle - start, time.perf_counter() - resumed, kept


def _return_freed_memory(device: torch.device) -> None:
    """Give the memory the measured copies used back, so that the stages allocated next do not come on top of it:
    whatever a reference cycle still holds (collected now, not whenever the collector next runs), the freed heap
    memory glibc keeps for reuse (``malloc_trim`` returns it), CUDA's caching allocator's blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _alike(layer: nn.Module, inputs: tuple[Any, ...], first: bool) -> tuple[Any, ...]:
    """What a layer's cost depends on: its class and kind (a decoder block's attention type), its tensors' names,
    shapes, dtypes and whether they train, and its inputs' shapes and dtypes. Layers alike in all of these (a
    transformer's blocks) are measured once: each rank's profile then costs one layer of each kind, whatever the
    depth, and never holds the whole model."""
    tensors = tuple(
        (name, tuple(t.shape), t.dtype, t.requires_grad) for name, t in layer.state_dict(keep_vars=True).items()
    )
    shapes = tuple((tuple(t.shape), t.dtype) for t in _tensors(inputs))
    return type(layer).__qualname__, getattr(layer, "layer_type", None), tensors, shapes, first


def _placed(layer: nn.Module, device: torch.device) -> nn.Module:
    """``layer`` itself if its tensors are on ``device``; else a copy there, allocated and initialized with its own
    ``reset_parameters`` where it was built on the meta device (a model that needs a pipeline is never moved whole)."""
    tensors = [*layer.parameters(), *layer.buffers()]
    if all(t.device == device for t in tensors):
        return layer
    probe = copy.deepcopy(layer)
    materialize_meta(probe, device)
    return probe.to(device)


@dataclass(frozen=True)
class _Setup:
    """How every layer of one profile is measured (:func:`profile_module`'s arguments)."""

    device: torch.device
    kwargs: dict[str, Any]  # the first layer's keyword arguments
    repeats: int
    split_backward: bool
    parallelize: Callable[[nn.Module, DeviceMesh], Any] | None
    tensor_mesh: DeviceMesh | None


class _Run(NamedTuple):
    """One forward and backward of a layer: its times, the bytes autograd saved for the backward (parameters left
    out) and those torch's input pass kept for its weight pass."""

    forward_s: float
    backward_s: float
    input_grad_s: float
    weight_grad_s: float
    saved_bytes: int
    kept_bytes: int


def profile_module(
    module: Module,
    batch: Any,
    capture: Callable[[Module, Any], ModelInput],
    *,
    microbatch_size: int | None = None,
    repeats: int = 5,
    name: str | None = None,
    parallelize: Callable[[nn.Module, DeviceMesh], Any] | None = None,
    tensor_mesh: DeviceMesh | None = None,
    split_backward: bool = True,
) -> ModelProfile:
    """Per-layer costs of ``module`` for one micro-batch, ``batch`` (on the device to measure on: a layer elsewhere,
    or on the meta device, is measured on a copy there, one layer at a time), each kind of layer measured once
    (:func:`_alike`).

    ``capture(module, batch)``: the arguments the module's step passes to ``self(...)`` for ``batch`` (the first
    layer's input), as the strategy captures them (``lightning_bfpp.adapter.user_step.training_step_input``).

    ``split_backward=False`` skips torch's split backward (``backward_input_s`` and ``backward_weight_s`` left
    unknown): only a zero-bubble schedule needs it, and it costs another forward and backward per layer.

    ``parallelize(layer, tensor_mesh)``: split a copy of each layer over this process's tensor group before
    measuring it (called by every member of the group, on the same batch); the module itself is left as it is."""
    if (parallelize is None) != (tensor_mesh is None):
        raise ValueError("profile_module: give both `parallelize` and `tensor_mesh`, or neither")
    layers = [layer for _, layer in pipeline_layers(module)]
    args, kwargs = capture(module, batch)
    sizes = {t.shape[0] for t in _tensors(args) if t.dim() > 0}
    device = next((t.device for t in _tensors(args)), torch.device("cpu"))
    setup = _Setup(device, kwargs, repeats, split_backward, parallelize, tensor_mesh)
    costs = _layer_costs(layers, args, setup)
    size = microbatch_size or (sizes.pop() if len(sizes) == 1 else 1)
    _return_freed_memory(device)
    return ModelProfile(tuple(costs), microbatch_size=size, name=name or type(module).__name__)


def _layer_costs(layers: list[nn.Module], args: tuple[Any, ...], setup: _Setup) -> list[LayerCost]:
    """Each layer's cost, each run on the previous one's outputs, the first on ``args``."""
    costs = []
    inputs: tuple[Any, ...] = args
    # a layer alike one measured already, on inputs alike, costs what that one cost, and gives outputs alike
    measured: dict[tuple[Any, ...], tuple[LayerCost, tuple[Any, ...]]] = {}
    for index, layer in enumerate(layers):
        key = _alike(layer, inputs, index == 0)
        if key not in measured:
            measured[key] = _measure_layer(layer, inputs, index == 0, setup)
        cost, inputs = measured[key]
        costs.append(cost)
    return costs


def _for_measuring(layer: nn.Module, setup: _Setup) -> nn.Module:
    """``layer`` on the device to measure on (:func:`_placed`) and, with ``parallelize``, split over the tensor
    group, on a copy: the module's own layer stays whole."""
    placed = _placed(layer, setup.device)
    if setup.parallelize is None:
        return placed
    placed = copy.deepcopy(placed) if placed is layer else placed
    return setup.parallelize(placed, setup.tensor_mesh) or placed


def _measure_layer(
    layer: nn.Module, inputs: tuple[Any, ...], first: bool, setup: _Setup
) -> tuple[LayerCost, tuple[Any, ...]]:
    """One layer's cost, its runs' medians after a warm-up run, and its outputs, detached (the next layer's
    inputs). A copy measured is freed on return, with the graph its last outputs hold, before the next is made."""
    layer = _for_measuring(layer, setup)
    # the first run counts the group's collectives: in the forward, and in the whole backward
    counters = (CollectiveCounter(), CollectiveCounter()) if setup.tensor_mesh is not None else None
    param_storages = {_local(p).untyped_storage().data_ptr() for p in layer.parameters()}
    runs = []
    output: Any = None
    for attempt in range(setup.repeats + 1):
        run, output = _run_once(layer, inputs, first, setup, param_storages, None if attempt else counters)
        if attempt:  # the first run warms up
            runs.append(run)
    layer.zero_grad(set_to_none=True)
    times = _Run(
        *(statistics.median(values) for values in list(zip(*runs, strict=True))[:4]),
        saved_bytes=runs[-1].saved_bytes,
        kept_bytes=runs[-1].kept_bytes,
    )
    split: dict[str, int] = {}
    if counters is not None and setup.tensor_mesh is not None:
        times, split = _without_collectives(times, output, counters, setup.tensor_mesh, setup.repeats)
    cost = LayerCost(
        forward_s=times.forward_s,
        backward_s=times.backward_s,
        param_bytes=sum(_local(p).numel() * p.element_size() for p in layer.parameters()),
        output_bytes=sum(t.numel() * t.element_size() for t in _tensors(output)),
        saved_bytes=times.saved_bytes,
        backward_weight_s=times.weight_grad_s if setup.split_backward else None,
        backward_input_s=times.input_grad_s if setup.split_backward else None,
        intermediate_grad_bytes=times.kept_bytes,
        **split,
    )
    outputs = _tensors(output)
    return cost, tuple(t.detach() for t in outputs) if isinstance(output, tuple) else (output.detach(),)


def _run_once(
    layer: nn.Module,
    inputs: tuple[Any, ...],
    first: bool,
    setup: _Setup,
    param_storages: set[int],
    counters: tuple[CollectiveCounter, CollectiveCounter] | None,
) -> tuple[_Run, Any]:
    """One forward and backward of ``layer`` on ``inputs`` (with ``split_backward``, torch's split backward too, on
    a forward of its own), and its output; ``counters`` count the tensor group's collectives in the forward and
    in the whole backward."""
    # each backward starts without gradients, as a step's first micro-batch does: accumulating over the runs would
    # hold a second gradient of the layer beside the one it adds to (an embedding's is as large as the embedding)
    layer.zero_grad(set_to_none=True)
    leaves = _leaves(inputs, first)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = _local(t).untyped_storage()
        if storage.data_ptr() not in param_storages:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    forward_count, backward_count = counters or (contextlib.nullcontext(), contextlib.nullcontext())
    _sync(setup.device)
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), forward_count:
        output = _call(layer, leaves, setup.kwargs, first)
    _sync(setup.device)
    middle = time.perf_counter()
    outs = [t for t in _tensors(output) if t.requires_grad]
    if outs:
        with backward_count:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    _sync(setup.device)
    end = time.perf_counter()
    wanted = any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)
    if outs and wanted and setup.split_backward:  # torch's split backward, on a forward of its own
        input_s, weight_s, kept = _split_backward(layer, _fresh(leaves), setup.kwargs, first, setup.device)
    else:  # no input to differentiate (the first layer): the whole backward is the weight pass
        input_s, weight_s, kept = 0.0, end - middle, 0
    return _Run(middle - start, end - middle, input_s, weight_s, sum(storages.values()), kept), output


def _without_collectives(
    times: _Run,
    output: Any,
    counters: tuple[CollectiveCounter, CollectiveCounter],
    mesh: DeviceMesh,
    repeats: int,
) -> tuple[_Run, dict[str, int]]:
    """``times`` less the tensor group's collectives (each timed on the group back to back: the planner charges
    them as a step pays them), and the fields that mark the layer as measured split."""
    n_forward, n_backward = counters[0].count, counters[1].count
    each = _collective_s(mesh, _tensors(output), repeats) if n_forward or n_backward else 0.0
    less = times._replace(
        forward_s=max(times.forward_s - n_forward * each, 0.0),
        # the input gradient's all-reduces run in the input-gradient pass and again in the whole backward
        input_grad_s=max(times.input_grad_s - n_backward * each, 0.0),
        backward_s=max(times.backward_s - n_backward * each, 0.0),
    )
    return less, {"tensor_parallel_all_reduces": n_forward, "measured_split": mesh.size()}
