"""Building this process's part of a pipeline from a plan: check the layers, keep the local ones, shard them.

The one place that turns a module and a :class:`~lightning_bfpp.plan.plan.Plan` into a
:class:`~lightning_bfpp.engine.pipeline.Pipeline`. What is placed how is the runner's that the plan's schedule kind
names (:attr:`~lightning_bfpp.plan.schedules.base.ScheduleKind.runner`, registered in
:mod:`lightning_bfpp.engine.runners`): ``"stages"`` (each rank keeps its stages, one FSDP2 unit each, run on
torch's pipeline runtime) or ``"weight_passing"`` (one chunk per rank, the weights travel). Nothing else asks
which schedule runs.

A build has two halves with the initial state's broadcast between them (:class:`~lightning_bfpp.engine.
initial_state.PendingBuild`): placing runs no collective, so that the caller can agree on its errors first (a
check of the module may fail on some ranks only); sharding runs after every replica took the same values.
:func:`build_pipeline` runs the whole sequence, for the strategy and for a plain torch loop alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_bfpp.engine.agreement import agree
from lightning_bfpp.engine.layers import batch_statistics_layers, check_no_collective_layers
from lightning_bfpp.engine.pipeline import Pipeline
from lightning_bfpp.engine.placing import Build, BuildContext, parallelised
from lightning_bfpp.engine.runners import get_runner
from lightning_bfpp.engine.sharding import PIPELINE_PARALLEL, tensor_parallel_mesh
from lightning_bfpp.engine.tied import TiedParameters, check_shared_modules, find_ties
from lightning_bfpp.plan.plan import Plan

__all__ = ["Build", "BuildContext", "build_pipeline", "place"]


def place(module: nn.Module, named: Sequence[tuple[str, nn.Module]], plan: Plan, context: BuildContext) -> Build:
    """Check the layers, then keep this process's part of ``module`` (the other ranks' layers become
    :class:`~lightning_bfpp.engine.layers.RemoteLayer` or storage-less), materialise and convert it, and return the
    rest of the build. No collectives in here."""
    ties = find_ties(module, named)
    check_no_collective_layers(named)
    check_tensor_parallel(named, tensor_parallel_mesh(context.device_mesh), context.parallelize)
    check_shared_modules(named, plan.stage_of_layer())
    runner = get_runner(plan.kind.runner)
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
