"""How a rank executes a step's lowered action list: the interface a pipeline
(:class:`~lightning_bfpp.engine.pipeline.Pipeline`) runs, one implementation per runner a schedule kind names
(:attr:`lightning_bfpp.plan.schedules.base.ScheduleKind.runner`).

- :class:`StageExecutor` (the ``"stages"`` runner): the rank's stages exchange activations with the other pipeline
  ranks through torch's pipeline runtime (``PipelineStage``s, :class:`~lightning_bfpp.engine.runtime.PlannedSchedule`);
  FSDP2 gathers and reduces each stage over the data-parallel group, optionally overlapped
  (:mod:`lightning_bfpp.engine.reductions`).
- :class:`lightning_bfpp.engine.runners.weight_passing.WeightPassingExecutor` (the ``"weight_passing"`` runner): every
  rank runs every chunk of layers on its own micro-batches, and the chunks' weights and gradients travel instead.

The pipeline asks an executor for a runner per step kind and shape (:meth:`Executor.build`), to start the first
weights moving before the step (:meth:`Executor.prefetch_first`), and to wait for the step's gradient traffic
(:meth:`Executor.finish`); the strategy connects it once every rank has built it and closes it at the end, and
asks it which ranks a model's gradients and a step's outputs are spread over. Nothing outside the executors
tells them apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_bfpp.engine.reductions import GradientReductions
from lightning_bfpp.engine.runtime import PlannedSchedule, build_stages
from lightning_bfpp.engine.sharding import PIPELINE_PARALLEL
from lightning_bfpp.plan.actions import Schedule
from lightning_bfpp.plan.plan import Plan

__all__ = ["Executor", "StageExecutor", "StepRunner"]

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


class StepRunner(Protocol):
    """What runs one step of a kind and batch shape (:class:`~lightning_bfpp.engine.runtime.PlannedSchedule`, or
    weight passing's runner)."""

    inferring_metadata: bool
    # the first stage's inputs of the last step that captured them (see Pipeline.run)
    last_inputs: tuple[list[Any], list[Any]] | None

    def run(
        self, arg_mbs: list[tuple[Any, ...]] | None, kwarg_mbs: list[dict[str, Any]] | None, targets: list[torch.Tensor]
    ) -> None: ...

    def hooked(
        self,
        *,
        action_range: Callable[[Callable[[str], Any]], Callable[[str], Any]],
        p2p_wait: Callable[[Callable[..., Any]], Callable[..., Any]],
        weight_wait: Callable[[Callable[..., Any]], Callable[..., Any]],
    ) -> AbstractContextManager[None]:
        """Route the runner's action ranges and waits through a tracer's wrappers (lightning_bfpp.engine.trace)."""
        ...


class Executor(Protocol):
    def build(
        self, plan: Plan, lowered: Schedule, stage_modules: Sequence[nn.Module], loss_fn: LossFn, *, train: bool
    ) -> StepRunner:
        """What runs one step of ``plan`` (its kind, micro-batch count) over ``lowered``, this shape's actions."""
        ...

    def prefetch_first(self, stage_modules: Sequence[nn.Module]) -> None:
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

    @property
    def gradient_group(self) -> Any:
        """The ranks a model's gradients are spread over, beyond data-parallel sharding (for its norm); None: here."""
        ...

    @property
    def output_group(self) -> Any:
        """The ranks that run one data-parallel replica's step (a batch's outputs are on its last stage's rank)."""
        ...

    def generation_weights(self, stage_modules: Sequence[nn.Module]) -> AbstractContextManager[None]:
        """Inside the block every local stage's weights are whole and stay so: gathered once for a whole
        ``generate`` call (a collective over the ranks that share them), released at its end."""
        ...


class StageExecutor:
    """A rank's stages on torch's pipeline runtime; ``reductions``: each stage's gradient reduction overlapped
    with the remaining backward (None: FSDP2's own, blocking). ``sharded``: the stages' weights are sharded (so the
    first stage's gather can start before the step)."""

    def __init__(
        self,
        mesh: DeviceMesh,
        device: torch.device,
        reductions: GradientReductions | None = None,
        *,
        sharded: bool = True,
    ) -> None:
        self.mesh = mesh
        self.device = device
        self.reductions = reductions
        self.sharded = sharded
        self._pipeline_group = mesh[PIPELINE_PARALLEL].get_group() if dist.is_initialized() else None
        self._pipeline_size = mesh[PIPELINE_PARALLEL].size()

    def build(
        self, plan: Plan, lowered: Schedule, stage_modules: Sequence[nn.Module], loss_fn: LossFn, *, train: bool
    ) -> PlannedSchedule:
        local = plan.stages_of(self.mesh[PIPELINE_PARALLEL].get_local_rank())
        stages = build_stages(stage_modules, local, plan.num_stages, self.device, self._pipeline_group)
        return PlannedSchedule(
            stages,
            lowered,
            plan.num_microbatches,
            loss_fn,
            stage_to_rank=plan.stage_to_rank(),
            backward=train,
            reductions=self.reductions,
        )

    def prefetch_first(self, stage_modules: Sequence[nn.Module]) -> None:
        if self.sharded:
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

    @property
    def gradient_group(self) -> Any:
        return self._pipeline_group if self._pipeline_size > 1 else None

    @property
    def output_group(self) -> Any:
        return self.gradient_group

    @contextmanager
    def generation_weights(self, stage_modules: Sequence[nn.Module]) -> Iterator[None]:
        """FSDP2's ``unshard()`` of every local stage (one all-gather each, over the data-parallel group: every
        replica calls it together), ``reshard()`` after; stages without data parallelism are whole already."""
        units = [stage for stage in stage_modules if callable(getattr(stage, "unshard", None))]
        for unit in units:
            unit.unshard()  # type: ignore[operator]
        try:
            yield
        finally:
            for unit in units:
                unit.reshard()  # type: ignore[operator]
