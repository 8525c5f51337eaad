"""``pipeline_parallel_size="auto"`` and ``partition="time"``: layouts from a measured profile.

At setup, global rank 0 measures the module's layers on its device with one real training batch
(:mod:`lightning_bfpp.measure.profile`), describes the machine (:class:`~lightning_bfpp.plan.cluster.Cluster`,
given or derived from the devices), simulates every feasible pipeline size (and, where they are
``"auto"`` too, stages per rank and micro-batch counts) for the configured schedule and sharding, and
broadcasts the fastest to every rank; all ranks then build the same mesh. ``partition="time"`` measures the
same way and broadcasts each layer's forward + backward time, which the partitioner balances.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn

from lightning_bfpp.adapter._lightning_compat import request_train_dataloader
from lightning_bfpp.engine.agreement import AgreedError
from lightning_bfpp.plan.cluster import Cluster
from lightning_bfpp.plan.config import PipelineConfig
from lightning_bfpp.plan.costs import ModelProfile
from lightning_bfpp.plan.search import Candidate, SearchSpace, format_table, search_per_replica_batch

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


def measure_profile(
    module: LightningModule,
    trainer: Trainer,
    device: torch.device,
    what: str = "BFPPStrategy(pipeline_parallel_size='auto')",
    instead: str = "a fixed pipeline_parallel_size",
) -> ModelProfile:
    """Profile the module on one training batch (its micro-batch size is the per-replica batch size)."""
    from lightning_bfpp.measure.profile import profile_module

    if any(p.is_meta for p in module.parameters()):
        raise RuntimeError(
            f"{what} measures the model's layers on one device, but the model is on the meta device. Pass"
            f" `plan_profile=` (a ModelProfile or its JSON) or {instead}."
        )
    batch = next(iter(request_train_dataloader(trainer)))
    batch = trainer.strategy.batch_to_device(batch, device)
    original = next(module.parameters()).device
    module.to(device)
    try:
        return profile_module(module, batch)
    finally:
        module.to(original)


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
                profile = measure_profile(
                    module, trainer, device, "BFPPStrategy(partition='time')", "partition='parameters'"
                )
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


def _choose_here(
    config: PipelineConfig,
    module: LightningModule,
    trainer: Trainer,
    cluster: Cluster,
    profile: ModelProfile | None,
    device: torch.device,
) -> tuple[Candidate, str] | Exception:
    if profile is None:
        profile = measure_profile(module, trainer, device)
    batch = profile.microbatch_size
    space = SearchSpace(
        schedules=(config.schedule,),
        shardings=(config.sharding,),
        mesh_orders=(config.mesh_order,),
        stages_per_rank=(1, 2, 4, 8) if config.stages_per_rank == "auto" else (config.stages_per_rank,),
        num_microbatches=None if config.num_microbatches == "auto" else (config.num_microbatches,),
    )
    candidates = search_per_replica_batch(profile, cluster, batch, space)
    feasible = [c for c in candidates if c.infeasible is None]
    if not feasible:
        return RuntimeError(
            "BFPPStrategy(pipeline_parallel_size='auto'): no configuration fits; the planner says:\n"
            + format_table(candidates, top=0, infeasible=10)
        )
    return feasible[0], format_table(candidates, top=5, infeasible=3)


def choose(
    config: PipelineConfig,
    module: LightningModule,
    trainer: Trainer,
    cluster: Cluster,
    profile: ModelProfile | None,
    device: torch.device,
    is_global_zero: bool,
) -> tuple[Candidate, str]:
    """The fastest layout, decided on global rank 0 and identical on every rank, with the table behind it."""
    box: list[Any] = [None]
    if is_global_zero:
        try:
            box[0] = _choose_here(config, module, trainer, cluster, profile, device)
        except Exception as error:  # measured and planned on rank 0 only: share the failure, never hang
            box[0] = RuntimeError(
                f"BFPPStrategy(pipeline_parallel_size='auto'): planning on global rank 0 failed:"
                f" {type(error).__name__}: {error}"
            )
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise AgreedError(str(box[0]))
    return box[0]


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
) -> PipelineConfig:
    """``pipeline_parallel_size="auto"``: ``config`` with the layout the planner chose (the same on every rank)."""
    machine = load_cluster(cluster, world_size, processes_per_node, device)
    # the planner models the reductions the strategy will run
    machine = replace(machine, overlap_reductions=overlap_reductions)
    best, table = choose(config, module, trainer, machine, _profile(profile), device, is_global_zero)
    chosen = best.config
    info(f"BFPPStrategy(pipeline_parallel_size='auto') chose {chosen.describe()}:\n{table}")
    return replace(
        config,
        pipeline_parallel_size=chosen.pipeline_parallel_size,
        stages_per_rank=chosen.stages_per_rank,
        num_microbatches=chosen.num_microbatches,
        microbatch_group_size=chosen.microbatch_group_size,
    )


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
        meta = any(p.is_meta for p in module.parameters())
        if preferred == "time" and meta and profile is None:
            info(
                f"BFPPStrategy: `{type(module).__name__}` asks for partition='time', but it was created on the"
                " meta device and cannot be measured; partitioning by parameters (pass `plan_profile=` to"
                " balance by time)."
            )
        else:
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
