"""How a rank executes a step's lowered action list: the one interface a pipeline
(:class:`~lightning_bfpp.engine.pipeline.Pipeline`) runs, which pipelines of stages and weight passing both
implement.

- :class:`StageExecutor`: the rank's stages exchange activations with the other pipeline ranks through torch's
  pipeline runtime (``PipelineStage``s, :class:`~lightning_bfpp.engine.runtime.PlannedSchedule`); FSDP2 gathers and
  reduces each stage over the data-parallel group, optionally overlapped (:mod:`lightning_bfpp.engine.reductions`).
- :class:`WeightPassingExecutor`: every rank runs every chunk of layers on its own micro-batches, and the
  chunks' weights and gradients travel instead (:mod:`lightning_bfpp.engine.weight_passing`).

The pipeline asks an executor for a schedule per step kind and shape (:meth:`build`), to start the first
weights moving before the step (:meth:`prefetch_first`), and to wait for the step's gradient traffic
(:meth:`finish`); the strategy connects it once every rank has built it and closes it at the end. Nothing
outside this module tells the two apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_bfpp.engine.reductions import GradientReductions
from lightning_bfpp.engine.runtime import PlannedSchedule, build_stages
from lightning_bfpp.engine.sharding import PIPELINE_PARALLEL
from lightning_bfpp.engine.weight_passing import ChunkTransfers, WeightPassingRunner, topology_groups
from lightning_bfpp.plan.schedule import Schedule

__all__ = ["BuildRequest", "Executor", "StageExecutor", "WeightPassingExecutor"]


@dataclasses.dataclass(frozen=True)
class BuildRequest:
    """What a step's schedule is built for: this rank's stage modules and their stage indices, the lowered
    action lists, the micro-batch count, the loss callback the last stage calls, and whether it runs backward."""

    stage_modules: Sequence[nn.Module]
    local_stages: Sequence[int]
    num_stages: int
    lowered: Schedule
    num_microbatches: int
    loss_fn: Callable[..., torch.Tensor]
    train: bool


class Executor(Protocol):
    def build(self, request: BuildRequest) -> PlannedSchedule | WeightPassingRunner:
        """What runs one step of this kind and shape: ``run(arg_mbs, kwarg_mbs, targets)``."""
        ...

    def prefetch_first(self, stage_modules: Sequence[nn.Module], sharding: str) -> None:
        """Start bringing the first visited weights before the step's host-side preparation."""
        ...

    def connect(self) -> None:
        """Collectives once every rank has built its executor (groups of its own)."""
        ...

    @property
    def waits_at_end(self) -> bool:
        """Whether gradient traffic may still be under way when the schedule ends (:meth:`finish` waits for it)."""
        ...

    def finish(self) -> None:
        """Wait for the step's gradient traffic: the gradients are complete afterwards."""
        ...

    def close(self) -> None: ...


class StageExecutor:
    """A rank's stages on torch's pipeline runtime; ``reductions``: each stage's gradient reduction overlapped
    with the remaining backward (None: FSDP2's own, blocking)."""

    def __init__(
        self,
        mesh: DeviceMesh,
        device: torch.device,
        pipeline_parallel_size: int,
        reductions: GradientReductions | None = None,
    ) -> None:
        self.mesh = mesh
        self.device = device
        self.pipeline_parallel_size = pipeline_parallel_size
        self.reductions = reductions

    def build(self, request: BuildRequest) -> PlannedSchedule:
        r = request
        group = self.mesh[PIPELINE_PARALLEL].get_group()
        stages = build_stages(r.stage_modules, r.local_stages, r.num_stages, self.device, group)
        return PlannedSchedule(
            stages,
            r.lowered,
            r.num_microbatches,
            r.loss_fn,
            pipeline_parallel_size=self.pipeline_parallel_size,
            backward=r.train,
            reductions=self.reductions,
        )

    def prefetch_first(self, stage_modules: Sequence[nn.Module], sharding: str) -> None:
        if sharding != "no_shard":
            stage_modules[0].unshard(async_op=True)  # type: ignore[operator]

    def connect(self) -> None:
        pass

    @property
    def waits_at_end(self) -> bool:
        return self.reductions is not None  # FSDP2's own reductions block inside the schedule

    def finish(self) -> None:
        if self.reductions is not None:
            self.reductions.finish()

    def close(self) -> None:
        if self.reductions is not None:
            self.reductions.close()


class WeightPassingExecutor:
    """Every chunk on every rank, weights and gradients travelling (see :mod:`lightning_bfpp.engine.weight_passing`)."""

    def __init__(self, transfers: ChunkTransfers, device: torch.device) -> None:
        self.transfers = transfers
        self.device = device

    def build(self, request: BuildRequest) -> WeightPassingRunner:
        # one rank's list: weight passing lowers the same actions for every rank (see Pipeline.lowered_schedule)
        r = request
        return WeightPassingRunner(
            r.stage_modules,
            r.lowered[0],
            r.num_microbatches,
            r.loss_fn,
            self.transfers,
            backward=r.train,
            device=self.device,
        )

    def prefetch_first(self, stage_modules: Sequence[nn.Module], sharding: str) -> None:
        self.transfers.fetch(0)  # the first chunk, the first visit of every schedule

    def connect(self) -> None:
        topology = self.transfers.topology
        # fetches and reductions each on groups of their own
        self.transfers.connect(topology_groups(topology), topology_groups(topology))

    @property
    def waits_at_end(self) -> bool:
        return True

    def finish(self) -> None:
        self.transfers.finish()

    def close(self) -> None:
        self.transfers.close()
