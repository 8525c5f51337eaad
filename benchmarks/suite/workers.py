"""One function per implementation; each runs in every process of a job and returns that rank's record.

All of them train the same model (:func:`benchmarks.suite.models.model_parts`) on the same global batch, split
into stages the same way (``balance_by_weight`` over parameter counts, as ``BFPPStrategy`` does), with the
same loss and optimizer, and mark their steps with the same :class:`~benchmarks.suite.instrument.StepClock`:

- ``bfpp``: ``BFPPStrategy`` through a Lightning ``Trainer`` (what a user runs);
- ``bfpp_hand``: the schedule bfpp generates and lowers (its :class:`lightning_bfpp.plan.Plan`), sharded per stage by
  ``lightning_bfpp.engine.sharding.shard_stage`` and executed by
  ``lightning_bfpp.engine.runtime.PlannedSchedule``, driven
  by a plain loop: Lightning's share of the step is the difference with ``bfpp``;
- ``torch``: ``torch.distributed.pipelining``'s own schedule classes over the same stages (placed as each class
  places them: looping, or in a V for ``ScheduleZBVZeroBubble``), with FSDP2 applied directly when there is
  data parallelism: ``fully_shard(stage, reshard_after_forward=False)``, torchtitan's
  choice under pipelining, so that the runtime's UNSHARD / RESHARD actions decide, or FSDP2's default
  (``True``: every micro-batch's forward gathers the stage again);
- ``fsdp``: Lightning's ``ModelParallelStrategy`` (FSDP2 per layer, no pipeline), each rank on its share of the
  global batch;
- ``independent``: processes without any communication, each training the whole model on one micro-batch per
  step: the machine's capacity for this model, measured in the same run;
- ``stage_compute``: each pipeline rank's own stages, forward and backward over the step's micro-batches and
  one optimizer step, with no neighbour (a later stage's inputs and an earlier stage's output gradients are
  made beforehand): what the pipeline's compute costs on these cores without its communication and bubble,
  with every micro-batch's activations alive as bfpp holds them or one micro-batch's at a time;
- ``collectives``: bfpp's weight gathers and gradient reductions of a step alone (:mod:`benchmarks.suite.collectives`).

With ``Job.trace`` bfpp through Lightning writes its steps' timelines there (``BFPPStrategy(trace=...)``), and the
hand-driven and torch workers return their timed steps' spans in their records (see :class:`_Spans`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict
from threading import Barrier
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as pp_schedules
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage

from benchmarks.suite import collectives
from benchmarks.suite.instrument import MEMORY, StepClock
from benchmarks.suite.models import ModelParts, lightning_module, model_parts, train_loader
from benchmarks.suite.spec import SINGLE_STAGE_SCHEDULES, V_SCHEDULES, Job
from lightning_bfpp import BFPPStrategy
from lightning_bfpp.engine.runtime import PlannedSchedule, build_stages
from lightning_bfpp.engine.sharding import DATA_PARALLEL, PIPELINE_PARALLEL, shard_stage
from lightning_bfpp.engine.trace import StepTracer
from lightning_bfpp.plan import Plan, get_schedule
from lightning_bfpp.plan.partition import balance_by_weight
from lightning_bfpp.plan.placement import LOOP, V

CPU = torch.device("cpu")


def run(job: Job, rank: int, barrier: Barrier | None) -> dict[str, Any]:
    """Run ``job`` as process ``rank`` and return what this rank measured."""
    if job.kind == "independent":
        return _independent(job, barrier)
    if job.kind == "stage_compute":
        return _stage_compute(job, rank, barrier)
    workers: dict[str, Callable[[Job, int], dict[str, Any]]] = {
        "bfpp": _bfpp_lightning,
        "fsdp": _fsdp_lightning,
        "bfpp_hand": _bfpp_by_hand,
        "torch": _torch_schedule,
        "collectives": collectives.run,
    }
    return workers[job.kind](job, rank)


# -- through Lightning ----------------------------------------------------------------------------------------


class _LightningClock(L.Callback):
    """Marks every step's start and the last step's end (a step's interval includes the optimizer and the loading
    of the next batch), and the hooks between: ``BFPPStrategy.training_step`` calls ``on_before_zero_grad`` before
    its pipeline runs and ``on_after_backward`` after it, before the step's logged-value sync."""

    def __init__(self, clock: StepClock, total_steps: int) -> None:
        self.clock = clock
        self.total_steps = total_steps

    def on_train_batch_start(self, *args: Any) -> None:
        self.clock.mark()

    def on_before_zero_grad(self, *args: Any) -> None:
        self.clock.phase("zero_grad")

    def on_after_backward(self, *args: Any) -> None:
        self.clock.phase("after_backward")

    def on_before_optimizer_step(self, *args: Any) -> None:
        self.clock.phase("optimizer")

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.clock.phase("end")
        if trainer.global_step >= self.total_steps:
            self.clock.mark()


def _trainer(job: Job, strategy: Any, clock: StepClock) -> L.Trainer:
    total = job.warmup + job.steps
    return L.Trainer(
        accelerator="cpu", devices=job.processes, strategy=strategy, max_steps=total,
        callbacks=[_LightningClock(clock, total)], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip


def _bfpp_lightning(job: Job, rank: int) -> dict[str, Any]:
    clock = StepClock(job.warmup)
    strategy = BFPPStrategy(
        pipeline_parallel_size=job.p, stages_per_rank=job.v or "auto", num_microbatches=job.m, schedule=job.schedule,
        sharding=job.sharding, overlap_reductions=job.overlap_reductions, prefetch_stages=job.prefetch_stages,
        trace=job.trace or None, trace_steps=job.warmup + job.steps, cluster=job.cluster or None,
    )  # fmt: skip
    trainer = _trainer(job, strategy, clock)
    trainer.fit(lightning_module(job), train_loader(job, job.m * job.microbatch_size, job.dp))
    record = clock.result()
    if job.planned:  # what the planner chose, and the step it predicted for it
        assert strategy.plan is not None and strategy.planned is not None and strategy.planned.prediction
        record["plan"] = {
            "schedule": strategy.plan.schedule,
            "v": strategy.plan.stages_per_rank,
            "describe": strategy.plan.describe(),
            "predicted_s": strategy.planned.prediction.step_time,
        }
    return record


def _fsdp_lightning(job: Job, rank: int) -> dict[str, Any]:
    clock = StepClock(job.warmup)
    strategy = ModelParallelStrategy(data_parallel_size=job.processes, tensor_parallel_size=1)
    trainer = _trainer(job, strategy, clock)
    trainer.fit(lightning_module(job), train_loader(job, job.m * job.microbatch_size, job.processes))
    return clock.result()


# -- driven by hand ------------------------------------------------------------------------------------------


def _cut(parts: ModelParts, num_stages: int) -> list[nn.Module]:
    """Every stage of the model, cut as ``BFPPStrategy`` cuts it (parameter counts balanced)."""
    counts = balance_by_weight([sum(p.numel() for p in layer.parameters()) for layer in parts.layers], num_stages)
    starts = [sum(counts[:s]) for s in range(num_stages + 1)]
    return [nn.Sequential(*parts.layers[starts[s] : starts[s + 1]]) for s in range(num_stages)]


class _Stages:
    """This rank's part of the job: mesh, stage modules (unsharded), and where the pipeline starts and ends."""

    def __init__(self, job: Job, parts: ModelParts, rank: int) -> None:
        dist.init_process_group("gloo", rank=rank, world_size=job.processes)
        self.mesh: DeviceMesh = init_device_mesh(
            "cpu", (job.dp, job.p), mesh_dim_names=(DATA_PARALLEL, PIPELINE_PARALLEL)
        )
        self.pipeline_rank = self.mesh[PIPELINE_PARALLEL].get_local_rank()
        self.data_parallel_rank = self.mesh[DATA_PARALLEL].get_local_rank()
        self.num_stages = job.p * job.v
        self.indices = stage_indices(job, self.pipeline_rank)
        stages = _cut(parts, self.num_stages)
        self.modules: list[nn.Module] = [stages[s] for s in self.indices]
        parts.layers.clear()  # drop the other ranks' layers
        self.first = 0 in self.indices
        self.last = self.num_stages - 1 in self.indices


def stage_indices(job: Job, pipeline_rank: int) -> list[int]:
    """The stages ``pipeline_rank`` holds: as bfpp's schedule kind places them, or for torch's schedules looping
    (``r, r + p, …``), or for its V schedules ``r`` and ``2p − 1 − r`` (``ScheduleZBVZeroBubble`` maps stages so,
    and needs exactly two per rank)."""
    if job.kind == "torch" and job.schedule in V_SCHEDULES:
        if job.v != 2:
            raise ValueError(f"torch's {job.schedule} places exactly 2 stages per rank in a V; the job has v={job.v}")
        return list(V.stages_of(pipeline_rank, job.p, 2))
    if job.kind in ("bfpp", "bfpp_hand"):
        return list(get_schedule(job.schedule).placement.stages_of(pipeline_rank, job.p, job.v))
    return list(LOOP.stages_of(pipeline_rank, job.p, job.v))


class _Spans:
    """The timed steps' spans when ``job.trace``: ``lightning_bfpp.engine.trace.StepTracer`` hooks on torch's runtime.

    The tracer's clock is left unset (no ``start_step``, whose barrier would line the ranks up and change the
    timing): its times are then ``time.perf_counter()``, the monotonic clock every process of the machine
    shares, and the step marks use it too.
    """

    def __init__(self, job: Job, rank: int) -> None:
        self.tracer = StepTracer(rank, CPU) if job.trace else None
        self.warmup = job.warmup

    def recording(self, step: int, schedule: Any) -> AbstractContextManager[None]:
        if self.tracer is None or step < self.warmup:
            return nullcontext()
        if isinstance(schedule, PlannedSchedule):
            return self.tracer.recording(schedule)
        return self.tracer.recording_torch(schedule)  # one of torch's own schedule classes

    def optimizer(self, step: int, start: float) -> None:
        if self.tracer is not None and step >= self.warmup:
            self.tracer.add("optimizer", start, self.tracer.now())

    def result(self, record: dict[str, Any]) -> dict[str, Any]:
        if self.tracer is not None:
            record["spans"] = [asdict(span) for span in self.tracer.spans]
        return record


def _batches(job: Job, parts: ModelParts, replica: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rows = job.m * job.microbatch_size
    return [parts.make_batch(rows, seed=1000 * step + replica) for step in range(job.warmup + job.steps)]


def _bfpp_by_hand(job: Job, rank: int) -> dict[str, Any]:
    parts = model_parts(job)
    here = _Stages(job, parts, rank)
    exchange = job.dp > 1 and job.sharding != "none"  # "none": replicas that never exchange gradients
    mesh = here.mesh[DATA_PARALLEL]
    modules = [shard_stage(module, mesh, job.sharding) if exchange else module for module in here.modules]
    plan = Plan(job.schedule, job.p, job.dp, job.v, job.m, sharding=job.sharding, prefetch_stages=job.prefetch_stages)

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return parts.loss(output, target) / job.m  # bfpp scales each micro-batch's loss, torch's grads (same thing)

    stages = build_stages(modules, here.indices, here.num_stages, CPU, here.mesh[PIPELINE_PARALLEL].get_group())
    schedule = PlannedSchedule(
        stages,
        plan.lowered() if exchange else plan.compute,  # as Pipeline.lowered_schedule does
        job.m,
        loss_fn,
        stage_to_rank=plan.stage_to_rank(),
        backward=True,
        early_receives=job.early_receives,
    )
    optimizer = parts.optimizer([p for module in modules for p in module.parameters()])
    clock, spans = StepClock(job.warmup), _Spans(job, rank)
    for step, (inputs, targets) in enumerate(_batches(job, parts, here.data_parallel_rank)):
        clock.mark()
        args = [(x,) for x in inputs.chunk(job.m)] if here.first else None
        kwargs: list[dict[str, Any]] | None = [{} for _ in range(job.m)] if here.first else None
        with spans.recording(step, schedule):
            schedule.run(args, kwargs, list(targets.chunk(job.m)))
        if job.step_sync:
            _gradient_norm_all_reduce(optimizer)
        start = time.perf_counter()
        clock.phase("optimizer")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.phase("end")
        spans.optimizer(step, start)
    clock.mark()
    _finish()
    return spans.result(clock.result())


def _torch_schedule(job: Job, rank: int) -> dict[str, Any]:
    parts = model_parts(job)
    here = _Stages(job, parts, rank)
    modules: Sequence[nn.Module] = here.modules
    if job.dp > 1:
        mesh, reshard = here.mesh[DATA_PARALLEL], job.reshard_after_forward
        modules = [fully_shard(module, mesh=mesh, reshard_after_forward=reshard) for module in modules]
    group = here.mesh[PIPELINE_PARALLEL].get_group()
    stages = [
        PipelineStage(module, s, here.num_stages, CPU, group=group)
        for module, s in zip(modules, here.indices, strict=True)
    ]
    schedule_class = getattr(pp_schedules, f"Schedule{job.schedule}")
    if job.schedule in SINGLE_STAGE_SCHEDULES:
        schedule = schedule_class(stages[0], n_microbatches=job.m, loss_fn=parts.loss)
    else:
        schedule = schedule_class(stages, n_microbatches=job.m, loss_fn=parts.loss)
    optimizer = parts.optimizer([p for module in modules for p in module.parameters()])
    clock, spans = StepClock(job.warmup), _Spans(job, rank)
    for step, (inputs, targets) in enumerate(_batches(job, parts, here.data_parallel_rank)):
        clock.mark()
        args = (inputs,) if here.first else ()
        with spans.recording(step, schedule):
            schedule.step(*args, target=targets if here.last else None)
        if job.step_sync:
            _gradient_norm_all_reduce(optimizer)
        start = time.perf_counter()
        clock.phase("optimizer")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.phase("end")
        spans.optimizer(step, start)
    clock.mark()
    _finish()
    return spans.result(clock.result())


def _gradient_norm_all_reduce(optimizer: torch.optim.Optimizer) -> None:
    """What clipping by the whole model's norm communicates (torchtitan's ``clip_grad_norm_`` with a pipeline): the
    local gradients' squared norm, summed over every rank."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    total = torch.stack([g.detach().float().pow(2).sum() for g in local]).sum() if local else torch.zeros(())
    dist.all_reduce(total)


def _independent(job: Job, barrier: Barrier | None) -> dict[str, Any]:
    parts = model_parts(job)
    model = nn.Sequential(*parts.layers)
    optimizer = parts.optimizer(list(model.parameters()))
    batches = [parts.make_batch(job.microbatch_size, seed=step) for step in range(job.warmup + job.steps)]
    if barrier is not None:
        barrier.wait()  # the processes train at the same time: that is the capacity being measured
    clock = StepClock(job.warmup)
    for inputs, targets in batches:
        clock.mark()
        parts.loss(model(inputs), targets).backward()
        MEMORY.sample()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    clock.mark()
    return clock.result()


def _stage_compute(job: Job, rank: int, barrier: Barrier | None) -> dict[str, Any]:
    parts = model_parts(job)
    num_stages = job.p * job.v
    stages = _cut(parts, num_stages)
    mine = LOOP.stages_of(rank, job.p, job.v)
    last = num_stages - 1
    steps: list[list[dict[str, Any]]] = []  # per step, per micro-batch: each of this rank's stages' input
    for inputs, targets in _batches(job, parts, 0):
        micro = []
        for x, target in zip(inputs.chunk(job.m), targets.chunk(job.m), strict=True):
            feeds: dict[Any, Any] = {"target": target}
            with torch.no_grad():
                for s in range(num_stages):
                    if s in mine:
                        feeds[s] = x if s == 0 else x.clone().requires_grad_()
                    x = stages[s](x)
            micro.append(feeds)
        steps.append(micro)
    modules = {s: stages[s] for s in mine}
    stages.clear()
    with torch.no_grad():  # an earlier stage's output gradient: the shape of its output
        out_grads = {s: torch.randn_like(modules[s](steps[0][0][s])) * 1e-3 for s in mine if s != last}
    optimizer = parts.optimizer([p for module in modules.values() for p in module.parameters()])

    def forward(s: int, feeds: dict[Any, Any]) -> torch.Tensor:
        out = modules[s](feeds[s])
        return parts.loss(out, feeds["target"]) / job.m if s == last else out

    def backward(s: int, out: torch.Tensor) -> None:
        out.backward() if s == last else out.backward(out_grads[s])

    if barrier is not None:
        barrier.wait()  # both ranks compute at the same time, as in the pipeline
    clock = StepClock(job.warmup)
    for micro in steps:
        clock.mark()
        if job.schedule == "one_at_a_time":
            for feeds in micro:
                outs = {s: forward(s, feeds) for s in mine}
                for s in reversed(mine):
                    backward(s, outs[s])
        else:  # breadth-first: every micro-batch through a stage before the next stage
            held = {s: [forward(s, feeds) for feeds in micro] for s in mine}
            for s in reversed(mine):
                for out in held.pop(s):
                    backward(s, out)
        MEMORY.sample()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for feeds in micro:  # a received input's gradient is sent on, not kept
            for s in mine:
                if s:
                    feeds[s].grad = None
    clock.mark()
    return clock.result()


def _finish() -> None:
    dist.barrier()  # nobody leaves while a neighbour still waits for its last transfer
    dist.destroy_process_group()
