"""Building this process's part of a pipeline from a plan: check the layers, keep the local ones, shard them.

The one place that turns a module and a :class:`~lightning_bfpp.plan.plan.Plan` into a
:class:`~lightning_bfpp.engine.pipeline.Pipeline`. What is placed how is the runner's that the plan's schedule kind
names (:attr:`~lightning_bfpp.plan.schedules.base.ScheduleKind.runner`, looked up in :data:`RUNNERS`):
``"stages"`` (here: each rank keeps its stages, one FSDP2 unit each, run on torch's pipeline runtime by a
:class:`~lightning_bfpp.engine.executors.StageExecutor`) or ``"weight_passing"``
(:func:`lightning_bfpp.engine.weight_passing.place_chunks`). Nothing else asks which schedule runs.

A build has two halves with the initial state's broadcast between them (:class:`~lightning_bfpp.engine.
initial_state.PendingBuild`): placing runs no collective, so that the caller can agree on its errors first (a
check of the module may fail on some ranks only); sharding runs after every replica took the same values.
:func:`build_pipeline` runs the whole sequence, for the strategy and for a plain torch loop alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_bfpp.engine import _compat
from lightning_bfpp.engine.agreement import agree
from lightning_bfpp.engine.executors import StageExecutor
from lightning_bfpp.engine.initial_state import Broadcast, PendingBuild, buffers_outside, local_state
from lightning_bfpp.engine.layers import (
    StageModule,
    batch_statistics_layers,
    batch_statistics_warning,
    check_no_collective_layers,
    layer_weights,
)
from lightning_bfpp.engine.pipeline import Pipeline
from lightning_bfpp.engine.placing import Build, BuildContext, fill_pretrained, finish_module, keep_layers, parallelised
from lightning_bfpp.engine.reductions import GradientReductions
from lightning_bfpp.engine.sharding import DATA_PARALLEL, PIPELINE_PARALLEL, shard_stage, tensor_parallel_mesh
from lightning_bfpp.engine.tied import TiedParameters, TieGroup, check_shared_modules, find_ties, retie
from lightning_bfpp.engine.weight_passing import BATCH_STATISTICS_NOTE, place_chunks
from lightning_bfpp.plan.plan import Plan

__all__ = ["RUNNERS", "Build", "BuildContext", "Runner", "build_pipeline", "place"]


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


@dataclass(frozen=True)
class Runner:
    """How a kind's plan is placed: ``place`` builds this rank's part; ``replicas_keep_statistics``: whether each
    data-parallel replica keeps its own running statistics (batch-norm layers), with ``statistics_note`` saying
    what else differs."""

    place: Callable[[nn.Module, Sequence[tuple[str, nn.Module]], list[TieGroup], Plan, BuildContext], Build]
    replicas_keep_statistics: bool = True
    statistics_note: str | None = None

    def statistics_warning(
        self, found: Sequence[tuple[str, str]], num_microbatches: int, data_parallel_size: int
    ) -> str | None:
        """What the batch-statistics layers ``found`` compute differently under this runner than on one device."""
        return batch_statistics_warning(
            found,
            num_microbatches,
            replicas_keep_own=data_parallel_size > 1 and self.replicas_keep_statistics,
            note=self.statistics_note,
        )


RUNNERS: dict[str, Runner] = {
    "stages": Runner(place_stages),
    "weight_passing": Runner(place_chunks, replicas_keep_statistics=False, statistics_note=BATCH_STATISTICS_NOTE),
}


def place(module: nn.Module, named: Sequence[tuple[str, nn.Module]], plan: Plan, context: BuildContext) -> Build:
    """Check the layers, then keep this process's part of ``module`` (the other ranks' layers become
    :class:`~lightning_bfpp.engine.layers.RemoteLayer` or storage-less), materialise and convert it, and return the
    rest of the build. No collectives in here."""
    ties = find_ties(module, named)
    check_no_collective_layers(named)
    check_tensor_parallel(named, tensor_parallel_mesh(context.device_mesh), context.parallelize)
    check_shared_modules(named, plan.stage_of_layer())
    runner = RUNNERS[plan.kind.runner]
    warning = runner.statistics_warning(batch_statistics_layers(named), plan.num_microbatches, plan.data_parallel_size)
    if warning is not None:
        context.warn(warning)
    return runner.place(module, named, ties, plan, context)


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
    if parallelize is None and not any(parallelised(layer) for _, layer in named):
        raise ValueError(
            f"BFPPStrategy: tensor_parallel_size={tensor_mesh.size()} but no layer is tensor-parallel: apply"
            " `parallelize_module(layer, self.device_mesh['tensor_parallel'], plan)` to the layers in the"
            " module's `configure_model`, pass `parallelize_fn=` to the strategy, or define"
            " `parallelize_layer(layer, tp_mesh)` on the module (the Hugging Face adapter does, from the model's"
            " `base_model_tp_plan`)."
        )


def build_pipeline(
    module: nn.Module,
    layers_and_plan: Callable[[], tuple[Sequence[tuple[str, nn.Module]], Plan]],
    context: BuildContext,
) -> tuple[Pipeline, TiedParameters]:
    """Every step of a build, in order, on every rank: place (agreed: a check may fail on some ranks only), share
    the initial values (collectives), shard and build the executor (agreed), connect the executor's and the ties'
    process groups, and make every copy of a tied parameter its owner's.

    ``layers_and_plan`` runs inside the first agreement, before anything is placed: the caller's checks, the
    module's pipeline layers and the plan for them (whatever of the whole module it wants to read, e.g. a summary,
    it reads there, before the other ranks' layers are gone).
    """

    def placed() -> Build:
        named, plan = layers_and_plan()
        return place(module, named, plan, context)

    build = agree(placed, "setting up the pipeline")
    # collectives, so after the agreement: every replica takes data-parallel rank 0's initial values (FSDP2
    # does not broadcast them as DDP does, see engine.initial_state), then the stages are sharded
    build.pending.share()
    pipeline = agree(build.pending.finish, "sharding the pipeline's stages")
    # collectives, so after the agreement: every rank knows every tie and creates its groups in one order
    build.tied.create_groups(context.device_mesh, PIPELINE_PARALLEL)
    pipeline.executor.connect()
    build.tied.broadcast_from_owner()
    return pipeline, build.tied
