"""``pipeline_parallel_size="auto"``, ``schedule="auto"`` and ``partition="time"``: layouts from a measured profile.

At setup, global rank 0 measures the module's layers on its device with one real training batch
(:mod:`lightning_bfpp.measure.profile`), describes the machine (:class:`~lightning_bfpp.plan.cluster.Cluster`,
given or derived from the devices, with ``memory_budget`` as its memory where given), simulates every feasible
pipeline size (or the given one), schedule (with ``schedule="auto"``: every registered kind the other arguments
allow) and, where they are ``"auto"`` too, stages per rank and micro-batch counts, for the configured sharding, and
broadcasts the fastest that fits in memory to every rank; all ranks then build the same mesh.
``partition="time"`` measures the same way and broadcasts each layer's forward + backward time, which the
partitioner balances.

With ``tensor_parallel_size=t > 1`` every tensor group (``t`` consecutive global ranks, a group in every
layout) measures at once, each layer split by the module's own per-layer parallelisation
(``parallelize_layer`` or ``parallelize_fn``), and global rank 0's group's profile is planned: one tensor rank's
share of each layer's compute and bytes, with its collectives counted and charged as the cluster prices them
(``LayerCost.measured_split``). Measuring layers whole and dividing by ``t`` would miss which layers split and
what the user's plan leaves whole.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_bfpp.adapter._lightning_compat import request_train_dataloader
from lightning_bfpp.adapter.user_step import training_step_input
from lightning_bfpp.engine.agreement import AgreedError
from lightning_bfpp.engine.sharding import tensor_group_mesh
from lightning_bfpp.plan.cluster import Cluster
from lightning_bfpp.plan.config import AUTO, PipelineConfig, config_rules
from lightning_bfpp.plan.costs import ModelProfile
from lightning_bfpp.plan.schedules import get_schedule, schedule_names
from lightning_bfpp.plan.search import Candidate, SearchSpace, format_size, format_table, search_per_replica_batch

# assumed when no `cluster=` is given; they decide only how communication weighs against compute
_DEFAULT_BANDWIDTH = {"cuda": (100e9, 12.5e9), "cpu": (1e9, 1e9)}


def default_cluster(world_size: int, processes_per_node: int, device: torch.device) -> Cluster:
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(processes_per_node, 1)
    intra, inter = _DEFAULT_BANDWIDTH.get(device.type, _DEFAULT_BANDWIDTH["cpu"])
    return Cluster(world_size, processes_per_node, int(memory), intra, inter)


def load_cluster(cluster: Cluster | str | Path | None, world_size: int, per_node: int, device: torch.device) -> Cluster:
    if cluster is None:
        return default_cluster(world_size, per_node, device)
    if not isinstance(cluster, Cluster):
        cluster = Cluster.from_json(Path(cluster))
    return replace(cluster, num_devices=world_size, devices_per_node=per_node)


@dataclass(frozen=True)
class TensorSplit:
    """How this rank splits a layer to measure it: the module's ``parallelize(layer, tp_mesh)`` on its tensor
    group's own mesh (:func:`~lightning_bfpp.engine.sharding.tensor_group_mesh`)."""

    mesh: DeviceMesh
    parallelize: Callable[[nn.Module, DeviceMesh], Any]


def _training_batch(trainer: Trainer, split: TensorSplit | None) -> Any:
    """One training batch; with ``split``, global rank 0's on every rank (each all-reduce of a split layer
    needs the same shapes on every member of a group, and batches padded to their own longest differ)."""
    if split is None:
        return next(iter(request_train_dataloader(trainer)))
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = next(iter(request_train_dataloader(trainer)))
        except Exception as error:  # shared, so that nobody waits for a batch that never comes
            box[0] = error
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


def measure_profile(
    module: LightningModule,
    trainer: Trainer,
    device: torch.device,
    split: TensorSplit | None = None,
    split_backward: bool = False,
) -> ModelProfile:
    """Profile the module on one training batch (its micro-batch size is the per-replica batch size); with
    ``split``, every rank calls it, and each layer is measured split over the rank's tensor group;
    ``split_backward`` measures the weight-gradient part of each backward (for ``breadth_first_zb``)."""
    from lightning_bfpp.measure.profile import profile_module

    batch = trainer.strategy.batch_to_device(_training_batch(trainer, split), device)
    # each kind of layer measured once, on a copy on `device` where it is elsewhere or on the meta device: the
    # module itself is neither moved nor materialized (a model that needs a pipeline fits on no one device)
    if split is None:
        return profile_module(module, batch, training_step_input, split_backward=split_backward)
    return profile_module(
        module,
        batch,
        training_step_input,
        parallelize=split.parallelize,
        tensor_mesh=split.mesh,
        split_backward=split_backward,
    )


def layer_times(
    module: LightningModule,
    trainer: Trainer,
    profile: ModelProfile | None,
    device: torch.device,
    is_global_zero: bool,
) -> list[float]:
    """``partition="time"``: each layer's forward + backward time, from ``profile`` or measured on global rank 0
    with one training batch, and the same on every rank (one broadcast; a failure is raised everywhere)."""
    box: list[Any] = [None]
    if is_global_zero:
        try:
            if profile is None:
                profile = measure_profile(module, trainer, device)
            box[0] = [layer.forward_s + layer.backward_s for layer in profile.layers]
        except Exception as error:  # measured on rank 0 only: share the failure, never hang
            box[0] = RuntimeError(
                f"BFPPStrategy(partition='time'): measuring the layers on global rank 0 failed:"
                f" {type(error).__name__}: {error}"
            )
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise AgreedError(str(box[0]))
    return box[0]


def candidate_schedules(config: PipelineConfig) -> tuple[str, ...]:
    """The schedules the planner may choose: the configured one, or with ``schedule="auto"`` every registered kind
    that accepts the other arguments (its own up-front checks pass)."""
    if config.schedule != AUTO:
        return (config.schedule,)
    allowed = []
    for name in schedule_names():
        try:
            config_rules(name).check_config(replace(config, schedule=name))
        except ValueError:
            continue
        allowed.append(name)
    return tuple(allowed)


def search_space(config: PipelineConfig, pipeline_sizes: tuple[int, ...] | None) -> SearchSpace:
    """What the planner varies for ``config``: what it leaves ``"auto"``, within what the arguments fix."""
    return SearchSpace(
        tensor_parallel_sizes=(config.tensor_parallel_size,),
        schedules=candidate_schedules(config),
        shardings=(config.sharding,),
        mesh_orders=(config.mesh_order,),
        pipeline_sizes=pipeline_sizes,
        stages_per_rank=(1, 2, 4, 8) if config.stages_per_rank == AUTO else (config.stages_per_rank,),  # type: ignore[arg-type]
        num_microbatches=None if config.num_microbatches == AUTO else (config.num_microbatches,),  # type: ignore[arg-type]
        prefetch_stages=config.prefetch_stages,
    )


def _choose_here(
    config: PipelineConfig,
    module: LightningModule,
    trainer: Trainer,
    cluster: Cluster,
    profile: ModelProfile | None,
    device: torch.device,
    split: TensorSplit | None,
    pipeline_sizes: tuple[int, ...] | None,
) -> tuple[Candidate, str] | Exception:
    space = search_space(config, pipeline_sizes)
    if profile is None:
        profile = measure_profile(module, trainer, device, split=split, split_backward=_splits_backward(space))
    candidates = search_per_replica_batch(profile, cluster, profile.microbatch_size, space)
    feasible = [c for c in candidates if c.infeasible is None]
    if not feasible:
        return RuntimeError(no_layout_fits(config, space, candidates, cluster))
    return feasible[0], format_table(candidates, top=5, infeasible=3)


def given_arguments(config: PipelineConfig) -> str:
    """``BFPPStrategy(...)`` with the arguments of ``config`` that differ from their defaults: what the user set."""
    defaults = PipelineConfig()
    given = [
        f"{f.name}={getattr(config, f.name)!r}"
        for f in fields(config)
        if getattr(config, f.name) != getattr(defaults, f.name)
    ]
    return f"BFPPStrategy({', '.join(given)})"


def no_layout_fits(
    config: PipelineConfig, space: SearchSpace, candidates: Sequence[Candidate], cluster: Cluster
) -> str:
    """Why the planner has nothing to run: per schedule kind it considered, the reason its layouts were excluded
    (the most common one, with how many it excluded), or that no layout of that kind matches the sizes."""
    lines = []
    for name in space.schedules:
        reasons = [c.infeasible for c in candidates if c.plan.schedule == name and c.infeasible]
        if not reasons:
            lines.append(f"- {name}: no layout of {cluster.num_devices} processes matches the other arguments")
            continue
        # by kind of reason ("memory: 32.1 MiB > 1.0 MiB" and "memory: 8.1 MiB > …" are one), most frequent first
        kinds = Counter(reason.split(":")[0] for reason in reasons)
        example = {kind: next(r for r in reasons if r.split(":")[0] == kind) for kind in kinds}
        lines.append(f"- {name}: " + "; ".join(f"{n} layout(s) excluded: {example[k]}" for k, n in kinds.most_common()))
    budget = f" within {format_size(cluster.memory_bytes)} per device" if cluster.memory_bytes else ""
    return (
        f"{given_arguments(config)}: the planner found no layout that runs{budget} on {cluster.num_devices}"
        " processes. By schedule:\n" + "\n".join(lines) + "\nFix one of these: more devices or memory"
        " (`memory_budget=`), fewer fixed arguments (leave them 'auto'), or another `schedule=`/`sharding=`."
    )


def choose(
    config: PipelineConfig,
    module: LightningModule,
    trainer: Trainer,
    cluster: Cluster,
    profile: ModelProfile | None,
    device: torch.device,
    is_global_zero: bool,
    parallelize: Callable[[nn.Module, DeviceMesh], Any] | None = None,
    pipeline_sizes: tuple[int, ...] | None = None,
) -> tuple[Candidate, str]:
    """The fastest layout, decided on global rank 0 and identical on every rank, with the table behind it.

    With tensor parallelism (and no profile given), every tensor group measures its layers split at the same
    time (each device busy, as in a step), and global rank 0's group's profile is planned."""
    split = None
    if config.tensor_parallel_size > 1 and profile is None:
        assert parallelize is not None
        split = TensorSplit(tensor_group_mesh(config.tensor_parallel_size, device), parallelize)  # a collective
    box: list[Any] = [None]
    if is_global_zero:
        try:
            box[0] = _choose_here(config, module, trainer, cluster, profile, device, split, pipeline_sizes)
        except Exception as error:  # measured and planned on rank 0 only: share the failure, never hang
            box[0] = RuntimeError(
                f"BFPPStrategy(pipeline_parallel_size='auto'): planning on global rank 0 failed:"
                f" {type(error).__name__}: {error}"
            )
    elif split is not None:
        # global rank 0 meets any failure in the same place, and shares it
        with contextlib.suppress(Exception):
            space = search_space(config, pipeline_sizes)
            measure_profile(module, trainer, device, split=split, split_backward=_splits_backward(space))
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise AgreedError(str(box[0]))
    return box[0]


def _splits_backward(space: SearchSpace) -> bool:
    """Whether a schedule the planner may choose splits each backward (and so needs the profile's weight-gradient
    times and what the input-gradient pass keeps)."""
    return any(get_schedule(name).splits_backward for name in space.schedules)


def _profile(given: ModelProfile | str | Path | None) -> ModelProfile | None:
    return given if given is None or isinstance(given, ModelProfile) else ModelProfile.from_json(Path(given))


def planned_config(
    config: PipelineConfig,
    module: LightningModule,
    trainer: Trainer,
    *,
    cluster: Cluster | str | Path | None,
    profile: ModelProfile | str | Path | None,
    overlap_reductions: bool,
    world_size: int,
    processes_per_node: int,
    device: torch.device,
    is_global_zero: bool,
    info: Callable[[str], None],
    parallelize: Callable[[nn.Module, DeviceMesh], Any] | None = None,
    pipeline_parallel_size: int | None = None,
    memory_budget: int | None = None,
) -> tuple[PipelineConfig, Candidate]:
    """``pipeline_parallel_size="auto"`` or ``schedule="auto"``: ``config`` with the layout the planner chose (the
    same on every rank), and the planner's candidate for it (its predicted step and peak memory).
    ``parallelize``: the module's per-layer tensor parallelisation, which ``tensor_parallel_size > 1`` needs
    (checked on every rank before any collective). ``pipeline_parallel_size``: the pipeline size the mesh already
    has (None: the planner chooses it). ``memory_budget``: bytes per device the choice must fit in (default: the
    cluster's memory)."""
    given = _profile(profile)
    t = config.tensor_parallel_size
    if t > 1 and given is None and parallelize is None:
        raise AgreedError(
            f"BFPPStrategy(pipeline_parallel_size='auto', tensor_parallel_size={t}) measures the layers split as"
            " training splits them, which needs the split per layer: define `parallelize_layer(layer, tp_mesh)`"
            " on the module or pass `parallelize_fn=` to the strategy. (`configure_model` runs before the layout,"
            " and so the mesh, is chosen.) Or give pipeline_parallel_size."
        )
    machine = load_cluster(cluster, world_size, processes_per_node, device)
    # the planner models the reductions the strategy will run
    machine = replace(machine, overlap_reductions=overlap_reductions)
    if memory_budget is not None:
        machine = replace(machine, memory_bytes=int(memory_budget))
    sizes = None if pipeline_parallel_size is None else (pipeline_parallel_size,)
    best, table = choose(config, module, trainer, machine, given, device, is_global_zero, parallelize, sizes)
    chosen = best.config
    info(f"BFPPStrategy: the planner chose {chosen.describe()}:\n{table}")
    return replace(config, **config_rules(chosen.schedule).arguments(chosen)), best


def resolved_partition(
    config: PipelineConfig,
    module: LightningModule,
    trainer: Trainer,
    *,
    partition_given: bool,
    profile: ModelProfile | str | Path | None,
    device: torch.device,
    is_global_zero: bool,
    info: Callable[[str], None],
) -> tuple[PipelineConfig, list[float] | None]:
    """The module's preferred partition when none was given; for ``"time"``, each layer's measured time."""
    preferred = getattr(module, "pipeline_partition", None)
    if not partition_given and preferred is not None:
        config = replace(config, partition=preferred)
    if config.partition != "time":
        return config, None
    measured = _profile(profile)
    if measured is None and trainer.state.fn != TrainerFn.FITTING:
        # measuring needs a training batch; outside fit (validate, test, predict) the stages only need to be
        # consistent, not balanced: checkpoints load into any partition
        info("BFPPStrategy: partition='time' outside `fit` balances parameters instead.")
        return replace(config, partition="parameters"), None
    return config, layer_times(module, trainer, measured, device, is_global_zero)
