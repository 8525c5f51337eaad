"""The ``"stages"`` runner: a pipeline. Each rank keeps its stages' layers (on the ranks the plan's placement gives
them), one FSDP2 unit per stage over the data-parallel group, run on torch's pipeline runtime by a
:class:`~lightning_bfpp.engine.executors.StageExecutor`."""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from lightning_bfpp.engine import _compat
from lightning_bfpp.engine.executors import StageExecutor
from lightning_bfpp.engine.initial_state import Broadcast, PendingBuild, buffers_outside, local_state
from lightning_bfpp.engine.layers import StageModule, layer_weights
from lightning_bfpp.engine.pipeline import Pipeline
from lightning_bfpp.engine.placing import Build, BuildContext, fill_pretrained, finish_module, keep_layers, parallelised
from lightning_bfpp.engine.reductions import GradientReductions
from lightning_bfpp.engine.runners.base import Runner, register_runner
from lightning_bfpp.engine.sharding import DATA_PARALLEL, shard_stage, tensor_parallel_mesh
from lightning_bfpp.engine.tied import TieGroup, retie
from lightning_bfpp.plan.plan import Plan


def place_stages(
    module: nn.Module,
    named: Sequence[tuple[str, nn.Module]],
    ties: list[TieGroup],
    plan: Plan,
    context: BuildContext,
) -> Build:
    """A pipeline: this rank keeps its stages' layers (on the ranks the plan's placement gives them), one FSDP2
    unit per stage over the data-parallel group."""
    device, me = context.device, context.pipeline_rank
    layer_stage = plan.stage_of_layer()
    stage_owner = [plan.rank_of(s) for s in range(plan.num_stages)]
    tensor_mesh = tensor_parallel_mesh(context.device_mesh)
    split = tensor_mesh is not None and context.parallelize is not None
    # split over the tensor group first, so that each rank reads only its part of a split weight
    local, identities = keep_layers(
        module, named, [stage_owner[s] for s in layer_stage], me, context, read_pretrained=not split
    )
    if split:
        for name, layer in local.items():
            if not parallelised(layer):
                local[name] = context.parallelize(layer, tensor_mesh) or layer
        fill_pretrained(local, context)
    tied = retie(identities, ties, layer_stage, stage_owner)
    finish_module(module, context)
    stage_modules = []
    for stage in plan.stages_of(me):
        names = plan.stage_layers(stage)
        layers = [context.prepare(local[name]) for name in names]
        stage_modules.append(StageModule(layers, stage, names=names, is_last=stage == plan.num_stages - 1))
    context.info(
        f"BFPPStrategy: pipeline_parallel_size={plan.pipeline_parallel_size},"
        f" data_parallel_size={plan.data_parallel_size}, stages_per_rank={plan.stages_per_rank},"
        f" num_microbatches={plan.num_microbatches}, schedule={plan.schedule},"
        f" sharding={plan.sharding}\n{plan.describe_stages(layer_weights(named))}"
    )
    if plan.num_microbatches < plan.pipeline_parallel_size:
        context.warn(
            f"BFPPStrategy: num_microbatches={plan.num_microbatches} is smaller than"
            f" pipeline_parallel_size={plan.pipeline_parallel_size}: every loop around the pipeline then waits for"
            " its first micro-batch to come back, so ranks idle. Use at least as many micro-batches as pipeline"
            " ranks."
        )
    mesh = context.device_mesh

    def finish() -> Pipeline:
        dp_mesh = context.sharding_mesh if context.sharding_mesh is not None else mesh[DATA_PARALLEL]
        sharded = [shard_stage(stage_module, dp_mesh, plan.sharding) for stage_module in stage_modules]
        reductions = None
        if context.overlap is not None:
            if context.overlap == "thread":
                for stage_module in sharded:
                    stage_module.set_custom_reduce_scatter(_compat.ReduceScatterOn(context.reduce_group))
            stages = dict(zip(plan.stages_of(me), sharded, strict=True))
            reductions = GradientReductions(stages, context.overlap)  # type: ignore[arg-type]
        return Pipeline(
            module,
            plan,
            sharded,
            mesh,
            device,
            base_seed=context.base_seed,
            step_code=context.step_code,
            executor=StageExecutor(mesh, device, reductions, sharded=plan.sharding != "no_shard"),
            agreement_timeout=context.agreement_timeout,
            tied=tied,
        )

    # the layers of pipeline rank k take data-parallel rank 0 of pipeline rank k's values (each layer drawn
    # once, by one process, as under DDP), the buffers every rank keeps outside the layers global rank 0's
    replicas = mesh[DATA_PARALLEL].get_group() if plan.data_parallel_size > 1 else None
    world = dist.group.WORLD if context.world_size > 1 else None
    broadcasts = [
        Broadcast(local_state(stage_modules), 0, replicas),
        Broadcast(buffers_outside(module, [name for name, _ in named]), 0, world),
    ]
    return Build(tied, PendingBuild(broadcasts, finish))


STAGES = register_runner(Runner("stages", place_stages))
