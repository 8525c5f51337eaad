"""What every runner's build shares: where this process builds, and the first steps of keeping its layers.

A runner (:mod:`lightning_bfpp.engine.runners`: a pipeline of sharded stages, or weight passing's chunks)
turns a module and a :class:`~lightning_bfpp.plan.plan.Plan` into this rank's part of a
:class:`~lightning_bfpp.engine.pipeline.Pipeline`. It is given a :class:`BuildContext` (this process's mesh, device
and the caller's callbacks) and returns a :class:`Build`: what it placed, and what is left to do once the ranks
have agreed (share the initial values, then shard). :func:`keep_layers` is the part of placing both runners run
alike.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_bfpp.engine.initial_state import PendingBuild
from lightning_bfpp.engine.layers import Recompute, compiled, keep_local_layers, materialize_remaining
from lightning_bfpp.engine.pipeline import Pipeline, StepCode
from lightning_bfpp.engine.pretrained import PretrainedWeights, layer_tensors
from lightning_bfpp.engine.sharding import PIPELINE_PARALLEL
from lightning_bfpp.engine.tied import Identities, TiedParameters, record_identities

_log = logging.getLogger(__name__)


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)


@dataclass
class BuildContext:
    """Where this process builds, and how its layers are prepared: not part of the plan, the same on no two ranks.

    ``convert_module`` applies the precision (Lightning's precision plugin under the strategy); ``recompute``
    says which layers recompute their activations in backward; ``compile_options`` compiles each layer
    (``None``: not). ``parallelize`` splits each of this rank's layers over its tensor group (layers already
    parallelised, by a LightningModule's ``configure_model``, are left alone). ``overlap`` is how gradient
    reductions overlap the backward (``"stream"``, ``"thread"`` on ``reduce_group``, or ``None``). ``pretrained``
    fills this rank's layers from a full checkpoint as they are kept (:mod:`lightning_bfpp.engine.pretrained`).
    ``info`` and ``warn`` report what the build chose and what looks wrong (the strategy passes Lightning's
    rank-zero versions).
    """

    device_mesh: DeviceMesh
    device: torch.device
    global_rank: int
    world_size: int
    processes_per_node: int
    step_code: StepCode
    base_seed: int = 0
    sharding_mesh: DeviceMesh | None = None  # hybrid_shard's (replicate, shard) view of the data-parallel mesh
    convert_module: Callable[[nn.Module], Any] = field(default=lambda module: module)
    recompute: Callable[[nn.Module], bool] = field(default=lambda layer: False)
    compile_options: dict[str, Any] | None = None
    parallelize: Callable[[nn.Module, DeviceMesh], Any] | None = None
    overlap: str | None = None
    reduce_group: Any = None
    agreement_timeout: float | None = None
    pretrained: PretrainedWeights | None = None
    info: Callable[[str], None] = _log.info
    warn: Callable[[str], None] = _warn

    @property
    def pipeline_rank(self) -> int:
        return self.device_mesh[PIPELINE_PARALLEL].get_local_rank()

    def prepare(self, layer: nn.Module) -> nn.Module:
        layer = compiled(layer, self.compile_options)
        return Recompute(layer) if self.recompute(layer) else layer


@dataclass
class Build:
    """A placed pipeline: the copies of tied parameters, and what is left to do (share values, then shard)."""

    tied: TiedParameters
    pending: PendingBuild[Pipeline]


def keep_layers(
    module: nn.Module,
    named: Sequence[tuple[str, nn.Module]],
    layer_owner: Sequence[int],
    me: int,
    context: BuildContext,
    *,
    tied_slots: Sequence[int] | None = None,
    read_pretrained: bool = True,
) -> tuple[dict[str, nn.Module], Identities]:
    """Keep the layers ``me`` owns (``layer_owner[i]``: the owner of layer ``i``; the others become
    :class:`~lightning_bfpp.engine.layers.RemoteLayer`). No collectives.

    Returns the kept layers by name, and which of the ``tied_slots`` layers' slots shared a tensor (default: the
    kept ones), recorded before materialising breaks the sharing: what
    :func:`~lightning_bfpp.engine.tied.retie` ties again once the runner has placed everything.
    """
    slots = [i for i, rank in enumerate(layer_owner) if rank == me] if tied_slots is None else tied_slots
    identities = record_identities(named, slots)
    local = keep_local_layers(module, named, layer_owner, me, context.device, seed=context.base_seed)
    if read_pretrained:
        fill_pretrained(local, context)
    return local, identities


def fill_pretrained(local: dict[str, nn.Module], context: BuildContext) -> None:
    """Fill this rank's layers from the module's pretrained checkpoint, if it has one: their tensors only (and of
    a tensor-parallel layer, where the file allows, only the rows it holds)."""
    if context.pretrained is not None:
        read = context.pretrained.fill(layer_tensors(local))
        context.info(f"BFPPStrategy: read {read / 2**20:,.1f} MiB of this rank's layers from {context.pretrained.path}")


def finish_module(module: nn.Module, context: BuildContext) -> None:
    """What every runner does once its layers are kept: the module's remaining tensors materialised, converted
    (precision) and on the device."""
    materialize_remaining(module, context.device, seed=context.base_seed)
    context.convert_module(module)
    module.to(context.device)


def parallelised(module: nn.Module) -> bool:
    """Whether ``module`` holds a tensor-parallel (DTensor) parameter."""
    return any(isinstance(p, DTensor) for p in module.parameters())
