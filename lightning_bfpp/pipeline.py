"""One pipelined step of a LightningModule: micro-batches in, the user's step out, on the right ranks.

:class:`Pipeline` owns this rank's stage modules and the torch schedules built over them. Per step it
splits the batch, gets the first stage's input from the user's step (:mod:`lightning_bfpp.user_step`), runs
the schedule, and on the last stage calls the user's step with ``self(...)`` returning the pipeline output.
Training and evaluation use separate schedule objects (evaluating on the training schedule would reduce
and rescale gradients), each built once per batch shape: torch's stages fix their tensor shapes on first
use, so a new shape (typically the smaller last batch) gets stages of its own.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_bfpp._compat import tree_flatten
from lightning_bfpp.microbatch import batch_signature, batch_size, split_microbatches
from lightning_bfpp.partition import StagePlan
from lightning_bfpp.runtime import PlannedSchedule, build_stages
from lightning_bfpp.schedule import Schedule, breadth_first, forward_only, generate, lower, validate
from lightning_bfpp.sharding import DATA_PARALLEL, PIPELINE_PARALLEL
from lightning_bfpp.trace import StepTracer
from lightning_bfpp.user_step import LogRecorder, capture_model_input, model_returns, step_loss

_MAX_CACHED_SCHEDULES = 8


@dataclass
class StepResult:
    """What one pipelined step produced on this rank (losses and outputs exist on last-stage ranks only)."""

    losses: list[torch.Tensor] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    recorder: LogRecorder = field(default_factory=LogRecorder)
    num_microbatches: int = 0
    step_name: str = ""


@dataclass
class _ActiveStep:
    step: Callable[..., Any]
    step_name: str
    microbatches: list[Any]
    step_args: tuple[Any, ...]
    train: bool
    loss_scale: float
    result: StepResult


class Pipeline:
    """This rank's stages of a LightningModule, and the schedules that run them."""

    def __init__(
        self,
        module: LightningModule,
        stage_plan: StagePlan,
        stage_modules: Sequence[nn.Module],
        mesh: DeviceMesh,
        device: torch.device,
        *,
        schedule: str,
        sharding: str,
        num_microbatches: int,
        microbatch_group_size: int | None = None,
    ) -> None:
        self.module = module
        self.plan = stage_plan
        self.stage_modules = list(stage_modules)
        self.mesh = mesh
        self.device = device
        self.schedule_name = schedule
        self.sharding = sharding
        self.num_microbatches = num_microbatches
        self.microbatch_group_size = microbatch_group_size
        self.pipeline_rank = mesh[PIPELINE_PARALLEL].get_local_rank()
        self.local_stages = stage_plan.stages_of(self.pipeline_rank)
        self.holds_first_stage = 0 in self.local_stages
        self.holds_last_stage = stage_plan.num_stages - 1 in self.local_stages
        self.data_parallel_size = mesh[DATA_PARALLEL].size()
        self._schedules: dict[tuple[Any, ...], PlannedSchedule] = {}
        self._active: _ActiveStep | None = None
        self._schedule_in_use: PlannedSchedule | None = None
        self._warned_microbatches: set[int] = set()

    # -- plans -------------------------------------------------------------------------------------

    def compute_schedule(self, train: bool, num_microbatches: int) -> Schedule:
        p, v = self.plan.pipeline_parallel_size, self.plan.stages_per_rank
        if train and num_microbatches == self.num_microbatches:
            compute = generate(self.schedule_name, p, v, num_microbatches, self.microbatch_group_size)
        elif train:
            # a smaller batch split into fewer micro-batches: keep the schedule if it allows that count, else
            # run this batch breadth-first (the order changes nothing in the result, only the timing)
            try:
                compute = generate(self.schedule_name, p, v, num_microbatches)
            except ValueError:
                compute = breadth_first(p, v, num_microbatches)
        else:
            compute = forward_only(p, v, num_microbatches)
        validate(compute, p, v, num_microbatches, backward=train)
        return compute

    def lowered_schedule(self, train: bool, num_microbatches: int) -> Schedule:
        return lower(self.compute_schedule(train, num_microbatches), self.sharding, num_microbatches)

    def _schedule_for(self, train: bool, num_microbatches: int, signature: Any) -> PlannedSchedule:
        key = (train, num_microbatches, signature)
        schedule = self._schedules.get(key)
        if schedule is None:
            if len(self._schedules) >= _MAX_CACHED_SCHEDULES:
                self._schedules.pop(next(iter(self._schedules)))
            stages = build_stages(
                self.stage_modules,
                self.local_stages,
                self.plan.num_stages,
                self.device,
                self.mesh[PIPELINE_PARALLEL].get_group(),
            )
            schedule = PlannedSchedule(
                stages,
                self.lowered_schedule(train, num_microbatches),
                num_microbatches,
                self._loss_fn,
                pipeline_parallel_size=self.plan.pipeline_parallel_size,
                backward=train,
            )
            self._schedules[key] = schedule
        return schedule

    # -- a step ------------------------------------------------------------------------------------

    def run(
        self,
        step_name: str,
        batch: Any,
        step_args: tuple[Any, ...],
        *,
        train: bool,
        loss_scale: float = 1.0,
        tracer: StepTracer | None = None,
    ) -> StepResult:
        """Run ``module.<step_name>(microbatch, *step_args)`` through the pipeline for every micro-batch.

        ``loss_scale`` multiplies the batch's loss (e.g. ``1 / accumulate_grad_batches``); each micro-batch's
        loss is further divided by the number of micro-batches, so gradients are the batch mean's.
        """
        step = getattr(self.module, step_name)
        num_microbatches = self._microbatches_for(batch)
        microbatches = split_microbatches(batch, num_microbatches)
        signature = batch_signature(batch)
        self._check_replicas_agree(signature, num_microbatches)
        schedule = self._schedule_for(train, num_microbatches, signature)
        arg_mbs = kwarg_mbs = None
        if self.holds_first_stage:
            captured = [capture_model_input(self.module, step, step_name, mb, *step_args) for mb in microbatches]
            arg_mbs = [args for args, _ in captured]
            kwarg_mbs = [kwargs for _, kwargs in captured]
        result = StepResult(num_microbatches=num_microbatches, step_name=step_name)
        if self.holds_last_stage:
            result.losses = [torch.zeros(())] * num_microbatches
            result.outputs = [None] * num_microbatches
        scale = loss_scale / num_microbatches
        self._active = _ActiveStep(step, step_name, microbatches, step_args, train, scale, result)
        self._schedule_in_use = schedule
        targets = [torch.tensor(i) for i in range(num_microbatches)]
        try:
            with tracer.recording(schedule) if tracer is not None else nullcontext():
                schedule.run(arg_mbs, kwarg_mbs, targets)
        finally:
            self._active = None
        return result

    def _loss_fn(self, output: Any, microbatch_index: torch.Tensor) -> torch.Tensor:
        assert self._schedule_in_use is not None
        if self._schedule_in_use.inferring_metadata:
            # torch runs one forward/backward on placeholder data to learn shapes; user code must not see it
            return _placeholder_loss(output)
        active = self._active
        assert active is not None
        i = int(microbatch_index)
        with model_returns(self.module, output) as model_was_called, active.result.recorder.recording(self.module):
            step_output = active.step(active.microbatches[i], *active.step_args)
        if not model_was_called():
            raise RuntimeError(
                f"BFPPStrategy: `{active.step_name}` did not call `self(...)` on the last pipeline stage; its"
                " result must come from the pipeline's output, which `self(...)` returns."
            )
        if active.train:
            loss = step_loss(step_output, active.step_name)
            active.result.losses[i] = loss.detach()
            return loss * active.loss_scale
        active.result.outputs[i] = step_output
        return torch.zeros((), device=self.device)

    def _microbatches_for(self, batch: Any) -> int:
        m = self.num_microbatches
        size = batch_size(batch)
        if size % m == 0:
            return m
        usable = max(d for d in range(1, min(m, size) + 1) if size % d == 0)
        if usable not in self._warned_microbatches:
            self._warned_microbatches.add(usable)
            warnings.warn(
                f"BFPPStrategy: a batch of {size} samples is not divisible by num_microbatches={m}; running it"
                f" as {usable} micro-batches of {size // usable}. The result is exact, but the pipeline"
                " is less busy; use batch sizes divisible by num_microbatches (and drop_last=True).",
                stacklevel=2,
            )
        return usable

    def _check_replicas_agree(self, signature: Any, num_microbatches: int) -> None:
        """Raise on every rank if data-parallel replicas got batches of different shapes this step.

        Replicas building their stages for different shapes would issue different collectives and hang;
        one all-reduce of a digest per step turns that into an error.
        """
        if self.data_parallel_size == 1:
            return
        digest = zlib.crc32(repr((signature, num_microbatches)).encode()) & 0x7FFFFFFF
        both = torch.tensor([digest, -digest], dtype=torch.int64, device=self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.mesh[DATA_PARALLEL].get_group())
        if int(both[0]) != -int(both[1]):
            raise RuntimeError(
                "BFPPStrategy: data-parallel replicas received batches of different shapes in the same step."
                " Every replica must see the same batch shapes (same batch size and, for sequences, the same"
                f" padded length); this rank's batch is {signature[1]}."
            )


def _placeholder_loss(output: Any) -> torch.Tensor:
    leaves = [
        t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
    ]
    if not leaves:
        return torch.zeros((), requires_grad=True)
    return sum(t.sum() for t in leaves) * 0.0  # type: ignore[return-value]
