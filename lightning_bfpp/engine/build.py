"""Building this process's part of a pipeline: cut the layers into stages, keep the local ones, shard them.

The one place that turns a module, a configuration and a mesh into a :class:`~lightning_bfpp.engine.pipeline.
Pipeline` with its executor: breadth-first and the other pipeline schedules get stages sharded by FSDP2 and a
:class:`~lightning_bfpp.engine.executors.StageExecutor`; weight passing gets one chunk per rank and a
:class:`~lightning_bfpp.engine.executors.WeightPassingExecutor`. Nothing else branches on the schedule's kind.

A build has two halves with the initial state's broadcast between them (:class:`~lightning_bfpp.engine.
initial_state.PendingBuild`): placing runs no collective, so that the caller can agree on its errors first (a
check of the module may fail on some ranks only); sharding runs after every replica took the same values.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_bfpp.engine import _compat
from lightning_bfpp.engine.executors import StageExecutor, WeightPassingExecutor
from lightning_bfpp.engine.initial_state import Broadcast, PendingBuild, buffers_outside, local_state
from lightning_bfpp.engine.layers import (
    Recompute,
    StageModule,
    batch_statistics_layers,
    batch_statistics_warning,
    check_no_collective_layers,
    compiled,
    keep_local_layers,
    layer_weights,
    materialize_meta,
    materialize_remaining,
)
from lightning_bfpp.engine.pipeline import Pipeline, StepCode
from lightning_bfpp.engine.reductions import GradientReductions
from lightning_bfpp.engine.sharding import (
    DATA_PARALLEL,
    PIPELINE_PARALLEL,
    schedule_sharding,
    shard_stage,
    tensor_parallel_mesh,
)
from lightning_bfpp.engine.tied import TiedParameters, check_shared_modules, find_ties, record_identities, retie
from lightning_bfpp.engine.weight_passing import ChunkTransfers, ChunkWeights, chunk_buffers, follow_mode
from lightning_bfpp.plan.config import Layout, MeshShape, PipelineConfig
from lightning_bfpp.plan.partition import StagePlan
from lightning_bfpp.plan.topology import NodeTopology

_log = logging.getLogger(__name__)


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)


@dataclass
class Placement:
    """Where this process builds, and how its layers are prepared.

    ``convert_module`` applies the precision (Lightning's precision plugin under the strategy); ``recompute``
    says which layers recompute their activations in backward; ``compile_options`` compiles each layer
    (``None``: not). ``info`` and ``warn`` report what the build chose and what looks wrong (the strategy passes
    Lightning's rank-zero versions).
    """

    config: PipelineConfig
    mesh_shape: MeshShape
    device_mesh: DeviceMesh
    device: torch.device
    global_rank: int
    world_size: int
    processes_per_node: int
    sharding_mesh: DeviceMesh | None = None  # hybrid_shard's (replicate, shard) view of the data-parallel mesh
    convert_module: Callable[[nn.Module], Any] = field(default=lambda module: module)
    recompute: Callable[[nn.Module], bool] = field(default=lambda layer: False)
    compile_options: dict[str, Any] | None = None
    # tensor parallelism: called on each of this rank's layers with the tensor-parallel mesh (e.g. applying
    # `parallelize_module`); layers already parallelised (a LightningModule's `configure_model`) are left alone
    parallelize: Callable[[nn.Module, DeviceMesh], Any] | None = None
    agreement_timeout: float | None = None
    info: Callable[[str], None] = _log.info
    warn: Callable[[str], None] = _warn

    @property
    def pipeline_rank(self) -> int:
        return self.device_mesh[PIPELINE_PARALLEL].get_local_rank()

    def prepare(self, layer: nn.Module) -> nn.Module:
        layer = compiled(layer, self.compile_options)
        return Recompute(layer) if self.recompute(layer) else layer


def plan_stages(
    config: PipelineConfig,
    mesh_shape: MeshShape,
    named: Sequence[tuple[str, nn.Module]],
    layer_times: Sequence[float] | None = None,
) -> tuple[Layout, StagePlan]:
    """The layout (sizes, micro-batches, layers per stage) and which rank holds which stage. Pure."""
    layout = config.resolve_layout(mesh_shape, layer_weights(named), layer_times)
    plan = StagePlan(tuple(name for name, _ in named), layout.stage_layer_counts, layout.pipeline_parallel_size)
    return layout, plan


@dataclass
class Build:
    """A placed pipeline: the copies of tied parameters, and what is left to do (share values, then shard)."""

    tied: TiedParameters
    pending: PendingBuild[Pipeline]


def place(
    module: nn.Module,
    named: Sequence[tuple[str, nn.Module]],
    layout: Layout,
    plan: StagePlan,
    placement: Placement,
    *,
    step_code: StepCode,
    base_seed: int,
    overlap: str | None = None,
    reduce_group: Any = None,
) -> Build:
    """Keep this process's layers of ``module`` (the others become :class:`~lightning_bfpp.engine.layers.
    RemoteLayer` or storage-less), materialise and convert them, and return the rest of the build.

    No collectives in here. ``overlap`` is how gradient reductions overlap the backward (``"stream"``,
    ``"thread"`` on ``reduce_group``, or ``None``).
    """
    ties = find_ties(module, named)
    check_no_collective_layers(named)
    check_tensor_parallel(named, tensor_parallel_mesh(placement.device_mesh), placement.parallelize)
    layer_stage = [s for s in range(plan.num_stages) for _ in plan.layer_range(s)]
    check_shared_modules(named, layer_stage)
    weight_passing = placement.config.schedule == "weight_passing"
    warning = batch_statistics_warning(
        batch_statistics_layers(named), layout.num_microbatches, layout.data_parallel_size, weight_passing
    )
    if warning is not None:
        placement.warn(warning)
    if weight_passing:
        return _place_chunks(module, named, ties, layout, plan, layer_stage, placement, step_code, base_seed)
    return _place_stages(
        module, named, ties, layout, plan, layer_stage, placement, step_code, base_seed, overlap, reduce_group
    )


def _place_stages(
    module: nn.Module,
    named: Sequence[tuple[str, nn.Module]],
    ties: list[Any],
    layout: Layout,
    plan: StagePlan,
    layer_stage: list[int],
    placement: Placement,
    step_code: StepCode,
    base_seed: int,
    overlap: str | None,
    reduce_group: Any,
) -> Build:
    """A pipeline: this rank keeps its stages' layers, one FSDP2 unit per stage over the data-parallel group."""
    config, device, me = placement.config, placement.device, placement.pipeline_rank
    owner = [plan.rank_of(s) for s in layer_stage]
    # which local slots share a tensor, before materializing breaks that (see lightning_bfpp.engine.tied.retie)
    identities = record_identities(named, [i for i, rank in enumerate(owner) if rank == me])
    local = keep_local_layers(module, named, owner, me, device)
    tensor_mesh = tensor_parallel_mesh(placement.device_mesh)
    if tensor_mesh is not None and placement.parallelize is not None:
        for name, layer in local.items():
            if not _parallelised(layer):
                local[name] = placement.parallelize(layer, tensor_mesh) or layer
    tied = retie(identities, ties, layer_stage, [plan.rank_of(s) for s in range(plan.num_stages)])
    materialize_remaining(module, device)
    placement.convert_module(module)
    module.to(device)
    stage_modules = []
    for stage in plan.stages_of(me):
        names = plan.stage_layers(stage)
        layers = [placement.prepare(local[name]) for name in names]
        stage_modules.append(StageModule(layers, stage, names=names, is_last=stage == plan.num_stages - 1))
    placement.info(
        f"BFPPStrategy: pipeline_parallel_size={layout.pipeline_parallel_size},"
        f" data_parallel_size={layout.data_parallel_size}, stages_per_rank={layout.stages_per_rank},"
        f" num_microbatches={layout.num_microbatches}, schedule={config.schedule},"
        f" sharding={config.sharding}\n{plan.describe(layer_weights(named))}"
    )
    if layout.num_microbatches < layout.pipeline_parallel_size:
        placement.warn(
            f"BFPPStrategy: num_microbatches={layout.num_microbatches} is smaller than"
            f" pipeline_parallel_size={layout.pipeline_parallel_size}: under the breadth-first schedule every"
            " loop around the pipeline then waits for its first micro-batch to come back, so ranks idle."
            " Use at least as many micro-batches as pipeline ranks."
        )
    mesh = placement.device_mesh

    def finish() -> Pipeline:
        dp_mesh = placement.sharding_mesh if placement.sharding_mesh is not None else mesh[DATA_PARALLEL]
        sharded = [shard_stage(stage_module, dp_mesh, config.sharding) for stage_module in stage_modules]
        reductions = None
        if overlap is not None:
            if overlap == "thread":
                for stage_module in sharded:
                    stage_module.set_custom_reduce_scatter(_compat.ReduceScatterOn(reduce_group))
            stages = dict(zip(plan.stages_of(me), sharded, strict=True))
            reductions = GradientReductions(stages, overlap)  # type: ignore[arg-type]
        return Pipeline(
            module,
            plan,
            sharded,
            mesh,
            device,
            schedule=config.schedule,
            sharding=schedule_sharding(config.sharding),
            num_microbatches=layout.num_microbatches,
            microbatch_group_size=layout.microbatch_group_size,
            prefetch_stages=config.prefetch_stages,
            base_seed=base_seed,
            step_code=step_code,
            executor=StageExecutor(mesh, device, plan.pipeline_parallel_size, reductions),
            agreement_timeout=placement.agreement_timeout,
            tied=tied,
        )

    # the layers of pipeline rank k take data-parallel rank 0 of pipeline rank k's values (each layer drawn
    # once, by one process, as under DDP), the buffers every rank keeps outside the layers global rank 0's
    replicas = mesh[DATA_PARALLEL].get_group() if layout.data_parallel_size > 1 else None
    world = dist.group.WORLD if placement.world_size > 1 else None
    broadcasts = [
        Broadcast(local_state(stage_modules), 0, replicas),
        Broadcast(buffers_outside(module, [name for name, _ in named]), 0, world),
    ]
    return Build(tied, PendingBuild(broadcasts, finish))


def _parallelised(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def check_tensor_parallel(
    named: Sequence[tuple[str, nn.Module]],
    tensor_mesh: DeviceMesh | None,
    parallelize: Callable[..., Any] | None,
) -> None:
    """Refuse, before anything is placed, tensor parallelism with nothing that parallelises. (Parameters
    parallelised outside the pipeline layers are refused with every other parameter outside them, by
    ``layers.pipeline_layers``; tied copies split differently on their stages by ``tied``, once split.)"""
    if tensor_mesh is None:
        return
    if parallelize is None and not any(_parallelised(layer) for _, layer in named):
        raise ValueError(
            f"BFPPStrategy: tensor_parallel_size={tensor_mesh.size()} but no layer is tensor-parallel: apply"
            " `parallelize_module(layer, self.device_mesh['tensor_parallel'], plan)` to the layers in the"
            " module's `configure_model`, pass `parallelize_fn=` to the strategy, or define"
            " `parallelize_layer(layer, tp_mesh)` on the module (the Hugging Face adapter does, from the model's"
            " `base_model_tp_plan`)."
        )


def _place_chunks(
    module: nn.Module,
    named: Sequence[tuple[str, nn.Module]],
    ties: list[Any],
    layout: Layout,
    plan: StagePlan,
    layer_stage: list[int],
    placement: Placement,
    step_code: StepCode,
    base_seed: int,
) -> Build:
    """Weight passing: one chunk per rank, owned whole by the rank TawPipe's placement gives it; the module keeps
    the owned layers (so the optimizer and checkpoints see exactly those), the other chunks' layers are kept
    beside it with no storage until fetched (see :mod:`lightning_bfpp.engine.weight_passing`).

    A chunk's parameters and persistent buffers are its owner's: the buffers travel with every fetch, and at
    setup every buffer of a chunk (persistent or not) takes the owner's value, as do the buffers outside the
    layers global rank 0's. Borrowed layers follow the module's mode (``train()`` / ``eval()``), which a trainer
    sets on the module and so on its own layers only."""
    if ties:
        raise ValueError(
            f"BFPPStrategy(schedule='weight_passing') cannot train parameters shared by several layers yet"
            f" (`{ties[0].canonical}`); use schedule='breadth_first', which supports them."
        )
    device, me = placement.device, placement.global_rank
    topology = NodeTopology(placement.world_size, placement.processes_per_node)
    chunk_owner = [topology.chunk_owner(c) for c in range(plan.num_stages)]
    owner = [chunk_owner[s] for s in layer_stage]
    identities = record_identities(named, range(len(named)))
    local = keep_local_layers(module, named, owner, me, device)
    borrowed = {}
    for (name, layer), rank in zip(named, owner, strict=True):
        if rank != me:
            materialize_meta(layer, device)
            borrowed[name] = placement.convert_module(layer.to(device))
            follow_mode(borrowed[name], module)
    tied = retie(identities, ties, layer_stage, chunk_owner)  # a layer's own ties, broken by to_empty
    materialize_remaining(module, device)
    placement.convert_module(module)
    module.to(device)
    layers_by_name = {**local, **borrowed}
    stage_modules, chunks = [], []
    world = dist.group.WORLD if placement.world_size > 1 else None
    broadcasts = [Broadcast(buffers_outside(module, [name for name, _ in named]), 0, world)]
    for c in range(plan.num_stages):
        names = plan.stage_layers(c)
        layers = [layers_by_name[name] for name in names]
        broadcasts.append(Broadcast(local_state(layers, parameters=False), chunk_owner[c], world))
        stage_module = StageModule(
            [placement.prepare(layer) for layer in layers], c, names=names, is_last=c == plan.num_stages - 1
        )
        stage_modules.append(stage_module)
        chunks.append(
            ChunkWeights(
                list(stage_module.parameters()), owned=chunk_owner[c] == me, buffers=chunk_buffers(stage_module)
            )
        )
    weights = layer_weights(named)
    placement.info(
        f"BFPPStrategy: schedule=weight_passing over {placement.world_size} ranks ({topology.num_nodes} node(s) of"
        f" {topology.processes_per_node}), num_microbatches={layout.num_microbatches} per rank\n"
        + "\n".join(
            f"chunk {c:>3} owned by rank {chunk_owner[c]:>3}: {len(plan.stage_layers(c)):>3} layers,"
            f" {sum(weights[i] for i in plan.layer_range(c)):,} parameters"
            for c in range(plan.num_stages)
        )
    )

    def finish() -> Pipeline:
        return Pipeline(
            module,
            plan,
            stage_modules,
            placement.device_mesh,
            device,
            schedule="weight_passing",
            sharding="weight_passing",
            num_microbatches=layout.num_microbatches,
            prefetch_stages=placement.config.prefetch_stages,
            base_seed=base_seed,
            step_code=step_code,
            executor=WeightPassingExecutor(ChunkTransfers(chunks, topology, me), device),
            agreement_timeout=placement.agreement_timeout,
        )

    return Build(tied, PendingBuild(broadcasts, finish))
