"""One pipelined step: micro-batches in, the user's step out, on the right ranks.

:class:`Pipeline` owns this rank's stage modules and the schedules built over them. Per step it splits the
batch, gets the first stage's input from the user's step, runs the schedule through its executor
(:mod:`lightning_bfpp.engine.executors`), and on the last stage hands each micro-batch's output to the user's step.
The user's step comes as :class:`StepCode` callbacks (a LightningModule's step methods:
:class:`lightning_bfpp.adapter.user_step.LightningStep`), so this module imports no Lightning.
Training and evaluation use separate schedule objects (evaluating on the training schedule would reduce
and rescale gradients), each built once per batch shape: torch's stages fix their tensor shapes on first
use, so a new shape (typically the smaller last batch) gets stages of its own.
"""

from __future__ import annotations

import warnings
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_bfpp.engine._compat import PipeliningMetadataError, tree_flatten
from lightning_bfpp.engine.agreement import (
    StepFailure,
    agree_on_shape,
    rank_name,
)
from lightning_bfpp.engine.executors import Executor, StepRunner
from lightning_bfpp.engine.generation.steps import generation_call, generation_step
from lightning_bfpp.engine.loss import BatchGradients, item_sum
from lightning_bfpp.engine.microbatch import (
    batch_digest,
    batch_signature,
    batch_size,
    microbatch_count,
    split_microbatches,
)
from lightning_bfpp.engine.random_state import derive_seed, forked_random_states
from lightning_bfpp.engine.sharding import DATA_PARALLEL, PIPELINE_PARALLEL, tensor_parallel_mesh
from lightning_bfpp.engine.tied import TiedParameters
from lightning_bfpp.engine.trace import StepTracer
from lightning_bfpp.plan.actions import Schedule
from lightning_bfpp.plan.plan import Plan

# schedules kept per step kind and batch shape: each holds its stages' receive buffers for every micro-batch, so
# batches padded to their own length should come in a few lengths (e.g. `pad_to_multiple_of=8` in the collator)
_MAX_CACHED_SCHEDULES = 16


class StepCode(Protocol):
    """The user's step, as the pipeline calls it (for a LightningModule: :class:`lightning_bfpp.adapter.user_step.
    LightningStep`). ``capture`` runs it on the first stage up to the model call and returns that call's
    ``(args, kwargs)``, the pipeline's input; ``finish`` runs it on the last stage with the model call returning
    ``output`` (one micro-batch's pipeline output), its logged values going to ``recorder``; ``loss`` reads the
    loss from what it returned; ``running`` is entered while any of it runs. A step code that ``can_generate``
    also has ``capture_generation``, ``generate`` and ``finish_generated``: an evaluation step that calls the
    module's ``generate`` instead of the model (see :mod:`lightning_bfpp.engine.generation.steps`)."""

    def capture(self, step_name: str, microbatch: Any, step_args: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict]: ...

    def running(self) -> AbstractContextManager[Any]: ...

    def new_recorder(self) -> Any: ...

    def finish(
        self, step_name: str, microbatch: Any, step_args: tuple[Any, ...], output: Any, recorder: Any
    ) -> Any: ...

    def loss(self, step_output: Any, step_name: str) -> torch.Tensor: ...


@dataclass
class StepResult:
    """What one pipelined step produced on this rank (losses and outputs exist on last-stage ranks only)."""

    losses: list[torch.Tensor] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    # the step's logged values on the last stage (the step code's recorder)
    recorder: Any = None
    num_microbatches: int = 0
    step_name: str = ""
    # the user's step failed here: input capture (first stage), loss or logging (last stage)
    failure: StepFailure = field(default_factory=StepFailure)
    # the batch's shape and micro-batch count, digested and described; every rank of a pipeline must run the same
    batch_digest: int = 0
    batch_description: str = ""
    # a digest of the batch's contents (see microbatch.batch_digest): the pipeline's ranks must hold the same batch
    content_digest: torch.Tensor | None = None
    # last stage, training: each micro-batch's item count where the step returned `mean_over_items` (else None)
    item_counts: list[torch.Tensor | None] = field(default_factory=list)

    def loss_and_items(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This rank's share of the step loss: the micro-batches' mean loss, or for a :func:`mean_over_items`
        step the summed loss and the summed item count (divided by the global count once counts are shared)."""
        if not self.losses:
            return None, None
        if self.item_counts and all(c is not None for c in self.item_counts):
            return torch.stack(self.losses).sum(), torch.stack(self.item_counts).sum()  # type: ignore[arg-type]
        return torch.stack(self.losses).mean(), None


@dataclass
class _PreparedBatch:
    """A step's batch, split and (on the first stage) captured, before its schedule runs."""

    num_microbatches: int = 0
    microbatches: list[Any] = field(default_factory=list)
    signature: Any = None
    content: torch.Tensor | None = None
    seeds: list[int] = field(default_factory=list)
    inputs: tuple[list[Any], list[Any]] | None = None
    failure: StepFailure = field(default_factory=StepFailure)


@dataclass
class _ActiveStep:
    step_name: str
    microbatches: list[Any]
    step_args: tuple[Any, ...]
    train: bool
    loss_scale: float
    result: StepResult
    seeds: list[int]
    # the batch's scale alone (e.g. 1 / accumulate_grad_batches): a `mean_over_items` sum is not divided by m
    batch_scale: float = 1.0


class Pipeline:
    """This rank's stages of a LightningModule, and the schedules that run them."""

    def __init__(
        self,
        module: nn.Module,
        plan: Plan,
        stage_modules: Sequence[nn.Module],
        mesh: DeviceMesh,
        device: torch.device,
        *,
        base_seed: int = 0,
        executor: Executor,
        step_code: StepCode,
        agreement_timeout: float | None = None,
        tied: TiedParameters | None = None,
    ) -> None:
        self.module = module
        self.plan = plan
        self.stage_modules = list(stage_modules)
        self.mesh = mesh
        self.device = device
        self.num_microbatches = plan.num_microbatches
        self.pipeline_rank = mesh[PIPELINE_PARALLEL].get_local_rank()
        self.local_stages = plan.stages_of(self.pipeline_rank)
        self.holds_first_stage = 0 in self.local_stages
        self.holds_last_stage = plan.num_stages - 1 in self.local_stages
        self.data_parallel_size = mesh[DATA_PARALLEL].size()
        self.data_parallel_rank = mesh[DATA_PARALLEL].get_local_rank()
        self.rank_label = rank_name(pipeline_rank=self.pipeline_rank, data_parallel_rank=self.data_parallel_rank)
        # the global ranks that run this rank's batches (its pipeline), which must agree on every batch
        pipeline_group = mesh[PIPELINE_PARALLEL].get_group()
        self.pipeline_group = pipeline_group
        self.pipeline_ranks = dist.get_process_group_ranks(pipeline_group) if dist.is_initialized() else [0]
        # the global ranks of each data-parallel replica, which must run the same batches (its pipeline, and with
        # tensor parallelism every tensor rank's pipeline): the step's exchange checks them on every rank
        ranks = mesh.mesh
        dp_dim = mesh.mesh_dim_names.index(DATA_PARALLEL)  # type: ignore[union-attr]
        self.pipelines = ranks.movedim(dp_dim, 0).reshape(ranks.shape[dp_dim], -1).tolist()
        # with tensor parallelism, the tensor ranks of a stage hold the same outputs and losses: one speaks for all
        tensor = tensor_parallel_mesh(mesh)
        self.tensor_rank = tensor.get_local_rank() if tensor is not None else 0
        # None until the first training step shows whether the step normalises by item counts
        self.normalizes_items: bool | None = None
        # whether this accumulation window's batches are normalised by their item counts one by one
        self._per_batch_window: bool | None = None
        self.batch_gradients = BatchGradients([p for p in module.parameters() if p.requires_grad])
        # the random draws of a step before `self(...)` are seeded from this (see lightning_bfpp.engine.random_state)
        self.base_seed = base_seed
        # how this rank runs a step's actions: its stages on torch's runtime, or weight passing (executors.py)
        self.executor = executor
        # copies of parameters tied across stages, whose gradients are summed after a reducing backward
        self.tied = tied
        # how long the check before a new schedule waits for every rank (None: the process group's timeout)
        self.agreement_timeout = agreement_timeout
        # the user's step (input capture, loss and logging): the caller's, e.g. a LightningModule's step methods
        self.step_code = step_code
        # True while the user's step code runs here; collectives called then are refused (see user_step)
        self.running_user_code = False
        self._schedules: OrderedDict[tuple[Any, ...], StepRunner] = OrderedDict()
        self._active: _ActiveStep | None = None
        self._schedule_in_use: StepRunner | None = None
        self._warned_microbatches: set[tuple[int, int]] = set()
        # the kinds of step (training or not, reducing or not) a schedule was built for: the first is built by
        # every rank in the same step (see _agree_before_schedule)
        self._built_kinds: set[tuple[bool, bool]] = set()

    # -- plans -------------------------------------------------------------------------------------

    def lowered_schedule(self, train: bool, num_microbatches: int, *, reduce_grads: bool = True) -> Schedule:
        """The actions this rank's executor runs for a step of this kind and micro-batch count (the plan's, or for
        a smaller last batch the plan for that count: :meth:`lightning_bfpp.plan.plan.Plan.for_microbatches`)."""
        return self.plan.for_microbatches(num_microbatches).lowered(train=train, reduce_grads=reduce_grads)

    def _schedule_for(self, key: tuple[bool, int, Any, bool]) -> StepRunner:
        """The schedule for a step's kind, micro-batch count, batch shape and whether it reduces gradients:
        built once, kept in a least-recently-used cache."""
        train, num_microbatches, _, reduce_grads = key
        schedule = self._schedules.get(key)
        if schedule is not None:
            self._schedules.move_to_end(key)
        else:
            if len(self._schedules) >= _MAX_CACHED_SCHEDULES:
                self._schedules.popitem(last=False)
            plan = self.plan.for_microbatches(num_microbatches)
            lowered = plan.lowered(train=train, reduce_grads=reduce_grads)
            schedule = self.executor.build(plan, lowered, self.stage_modules, self._loss_fn, train=train)
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
        step_key: Sequence[int] = (),
        last_batch: bool = False,
        reduce_grads: bool = True,
        set_aside_grads: bool = False,
    ) -> StepResult:
        """Run ``module.<step_name>(microbatch, *step_args)`` through the pipeline for every micro-batch.

        ``loss_scale`` multiplies the batch's loss (e.g. ``1 / accumulate_grad_batches``); each micro-batch's
        loss is further divided by the number of micro-batches, so gradients are the batch mean's.
        ``step_key`` says where the step is (e.g. epoch and batch index): with the micro-batch index and the
        data-parallel rank it seeds the step's random draws, identically on the first and the last stage.
        ``last_batch`` marks the loader's last batch, which may be smaller (see :func:`microbatch_count`).
        ``reduce_grads=False`` (a batch of a gradient-accumulation window before its last) runs the schedule
        without its gradient reductions: FSDP2 keeps adding to the unsharded gradients until a step reduces.
        ``set_aside_grads`` takes the gradients accumulated so far off the parameters for the step (see
        :class:`lightning_bfpp.engine.loss.BatchGradients`; the caller finishes it once the item counts are shared).

        An error in the user's code on some ranks (input capture on the first stage, the loss and logging on
        the last) is raised on every rank as :class:`AgreedError` at the next point where all ranks meet: the
        check before a new schedule is built (over the pipeline's ranks), else the one collective after the
        schedule (the logged-value sync), which also compares the pipeline's batch shapes and contents
        (``StepResult.batch_digest``, ``StepResult.content_digest``). A step whose schedule is already built
        has no collective before it. Shapes may differ between replicas and between steps (batches padded to
        their own longest sequence): each pipeline builds a schedule per shape, without the other replicas.
        """
        if not train and getattr(self.step_code, "can_generate", False):
            call = generation_call(self, step_name, batch, step_args, step_key)
            if call is not None:  # the step calls `self.generate(...)`: see lightning_bfpp.engine.generation.steps
                return generation_step(self, step_name, batch, step_args, call, step_key)
        self._prefetch_first_stage()
        prepared = self._prepare(step_name, batch, step_args, step_key, last_batch)
        key = (train, prepared.num_microbatches, prepared.signature, reduce_grads or not train)
        runner = self._runner_agreed(step_name, key, prepared)
        inputs = self._inputs_for(runner, prepared)
        result = self._new_result(step_name, prepared)
        if train and set_aside_grads:
            self.batch_gradients.set_aside()
        self._active = _ActiveStep(
            step_name, prepared.microbatches, step_args, train, loss_scale / max(prepared.num_microbatches, 1),
            result, prepared.seeds, loss_scale,
        )  # fmt: skip
        self._execute(runner, step_name, inputs, prepared.num_microbatches, train=train, tracer=tracer)
        if train and reduce_grads and self.tied:
            # the tied copies' gradients are complete (reduced over replicas) only now: sum them over the tie,
            # once per optimizer step (an accumulation window's last batch), before clipping and the step
            self.tied.sum_gradients()
        if train and self.holds_last_stage:
            self._check_one_kind_of_loss(step_name, result)
        return result

    def _prepare(
        self, step_name: str, batch: Any, step_args: tuple[Any, ...], step_key: Sequence[int], last_batch: bool
    ) -> _PreparedBatch:
        """Split the batch, seed its micro-batches and, on the first stage, capture the pipeline's input from the
        user's step; a failure is recorded, to be raised on every rank where they meet (see :meth:`run`)."""
        prepared = _PreparedBatch()
        try:
            prepared.num_microbatches = self.microbatches_for(batch, last_batch=last_batch, step_name=step_name)
            prepared.microbatches = split_microbatches(batch, prepared.num_microbatches)
            prepared.signature = batch_signature(batch)
            prepared.content = batch_digest(batch)
            prepared.seeds = [
                derive_seed(self.base_seed, (*step_key, self.data_parallel_rank, i))
                for i in range(prepared.num_microbatches)
            ]
            if self.holds_first_stage:
                captured = []
                with self.user_code() as reseed:  # one fork for the loop: nothing else draws in between
                    for seed, mb in zip(prepared.seeds, prepared.microbatches, strict=True):
                        reseed(seed)
                        captured.append(self.step_code.capture(step_name, mb, step_args))
                prepared.inputs = ([args for args, _ in captured], [kwargs for _, kwargs in captured])
        except Exception as error:
            prepared.failure.record(error, self.rank_label)
        return prepared

    def _runner_agreed(self, step_name: str, key: tuple[bool, int, Any, bool], prepared: _PreparedBatch) -> StepRunner:
        """The runner for this step's kind and shape; a new one only after the ranks agreed (see
        :meth:`_agree_before_schedule`)."""
        cached = self._schedules.get(key)
        failed_first = prepared.failure.error is not None and self.holds_first_stage
        if cached is None or (failed_first and cached.last_inputs is None):
            # a schedule not built yet (first step, new batch shape): every rank checks before building one
            train, _, _, reduces = key
            kind = (train, reduces)
            self._agree_before_schedule(
                step_name, prepared.signature, prepared.num_microbatches, prepared.failure,
                everywhere=kind not in self._built_kinds,
            )  # fmt: skip
            self._built_kinds.add(kind)
        return self._schedule_for(key)

    def _inputs_for(self, runner: StepRunner, prepared: _PreparedBatch) -> tuple[list[Any], list[Any]] | None:
        """The first stage's inputs for this step: the captured ones; after a failed capture, those the runner last
        ran on. The capture failed here, but the other ranks are already in the schedule (checking first would cost
        a collective every step): it runs on old inputs, and the capture's error is raised on every rank after it,
        before any optimizer step."""
        if not self.holds_first_stage:
            return None
        if prepared.failure.error is None:
            runner.last_inputs = prepared.inputs
            return prepared.inputs
        return runner.last_inputs

    def _new_result(self, step_name: str, prepared: _PreparedBatch) -> StepResult:
        signature, num_microbatches = prepared.signature, prepared.num_microbatches
        result = StepResult(
            num_microbatches=num_microbatches,
            step_name=step_name,
            failure=prepared.failure,
            recorder=self.step_code.new_recorder(),
            batch_digest=zlib.crc32(repr((signature, num_microbatches)).encode()) & 0x7FFFFFFF,
            batch_description=(
                f"{self.rank_label} got {signature[1] if signature is not None else None} in {num_microbatches}"
            ),
            content_digest=prepared.content,
        )
        if self.holds_last_stage:
            result.losses = [torch.zeros(())] * num_microbatches
            result.outputs = [None] * num_microbatches
            result.item_counts = [None] * num_microbatches
        return result

    def _execute(
        self,
        runner: StepRunner,
        step_name: str,
        inputs: tuple[list[Any], list[Any]] | None,
        num_microbatches: int,
        *,
        train: bool,
        tracer: StepTracer | None,
    ) -> None:
        """Run the step's actions (the last stage calls :meth:`_loss_fn`), then wait for its gradient traffic."""
        self._schedule_in_use = runner
        targets = [torch.tensor(i) for i in range(num_microbatches)]
        arg_mbs, kwarg_mbs = inputs if inputs is not None else (None, None)
        try:
            with tracer.recording(runner) if tracer is not None else nullcontext():
                runner.run(arg_mbs, kwarg_mbs, targets)
        except PipeliningMetadataError as error:
            raise RuntimeError(shape_varies_message(error, step_name)) from error
        finally:
            self._active = None
            if train and self.executor.waits_at_end:
                # the gradients are complete only now, before clipping and the optimizer step
                start = tracer.now() if tracer is not None else 0.0
                self.executor.finish()
                if tracer is not None:  # what of the overlapped reductions was still left to wait for
                    tracer.add("reduce", start, tracer.now())

    def _check_one_kind_of_loss(self, step_name: str, result: StepResult) -> None:
        if result.failure.error is not None:
            return
        if len({count is not None for count in result.item_counts}) > 1:
            result.failure.record(
                RuntimeError(
                    f"BFPPStrategy: `{step_name}` returned `mean_over_items(...)` for some micro-batches and a"
                    " plain loss for others. Return the same kind of loss for every batch."
                ),
                self.rank_label,
            )

    def reduces_each_batch(self, *, window_start: bool) -> bool:
        """Whether this training batch reduces its gradients on its own, apart from what the accumulation window
        holds: for a ``mean_over_items`` step (or one not seen yet), to divide them by the batch's item count
        afterwards (:meth:`normalize_gradients`). Decided per window: a window's batches are either all
        reduced on their own or all accumulated."""
        if window_start or self._per_batch_window is None:
            self._per_batch_window = self.normalizes_items is not False
        return self._per_batch_window

    def normalize_gradients(self, items: float | None, replicas: int, *, accumulating: bool) -> None:
        """Divide a ``mean_over_items`` batch's gradients by its global item count (see lightning_bfpp.engine.loss).

        The step backpropagated each micro-batch's summed loss, and the data-parallel reduction divided the
        gradients by the number of replicas: ``replicas / items`` makes them the global batch's item mean.
        """
        if items is not None and not self._per_batch_window and accumulating:
            raise RuntimeError(
                "BFPPStrategy: `training_step` returned `mean_over_items(...)` after earlier steps returned a plain"
                " loss, inside a gradient-accumulation window. Return the same kind of loss for every batch."
            )
        if self.normalizes_items is None:
            self.normalizes_items = items is not None
        self.batch_gradients.finish(None if items is None else replicas / max(items, 1.0))

    def _prefetch_first_stage(self) -> None:
        """Start gathering the weights of this rank's first stage (the first one every schedule visits) now,
        so that the gather overlaps the step's host-side preparation: splitting the batch, capturing the
        model's input, the ranks' agreement. The schedule's own UNSHARD then finds it in flight and waits for
        it where the weights are needed. Only this one stage, so at most two stages are ever unsharded at
        once under ``full_shard``, as before.
        """
        if self.data_parallel_size == 1 or self.plan.prefetch_stages == 0:
            return
        self.executor.prefetch_first(self.stage_modules)

    @contextmanager
    def user_code(self) -> Iterator[Callable[[int], None]]:
        """Where the user's step code runs: forked random state, collectives refused. Yields ``reseed(seed)``,
        to call before each micro-batch's run (see :func:`forked_random_states`)."""
        with ExitStack() as stack:
            reseed = stack.enter_context(forked_random_states(self.device))
            stack.enter_context(self.step_code.running())
            self.running_user_code = True
            stack.callback(setattr, self, "running_user_code", False)
            yield reseed

    def _loss_fn(self, output: Any, microbatch_index: torch.Tensor) -> torch.Tensor:
        assert self._schedule_in_use is not None
        if self._schedule_in_use.inferring_metadata:
            # torch runs one forward/backward on placeholder data to learn shapes; user code must not see it
            return _placeholder_loss(output)
        active = self._active
        assert active is not None
        failure = active.result.failure
        if failure.error is not None:
            return _placeholder_loss(output)  # the step already failed here; finish the schedule, then raise
        i = int(microbatch_index)
        try:
            with self.user_code() as reseed:
                reseed(active.seeds[i])
                step_output = self.step_code.finish(
                    active.step_name, active.microbatches[i], active.step_args, output, active.result.recorder
                )
            if not active.train:
                active.result.outputs[i] = step_output
                return torch.zeros((), device=self.device)
            loss = self.step_code.loss(step_output, active.step_name)
        except Exception as error:
            # raising here would leave the other ranks waiting for this stage's gradients: let the schedule
            # finish on a zero loss, and raise on every rank once they meet (see logged_values.LoggedValueSync)
            failure.record(error, self.rank_label)
            return _placeholder_loss(output)
        items = item_sum(loss)
        if items is not None:
            # backpropagate the sum; the gradients are divided by the global item count after the step
            active.result.losses[i] = items.total.detach()
            active.result.item_counts[i] = items.count
            return items.total * active.batch_scale
        active.result.losses[i] = loss.detach()
        return loss * active.loss_scale

    def microbatches_for(self, batch: Any, *, last_batch: bool = False, step_name: str = "training_step") -> int:
        """How many micro-batches this batch is split into: ``num_microbatches``, except for a smaller last batch."""
        size = batch_size(batch)
        count = microbatch_count(size, self.num_microbatches, last_batch=last_batch)
        if count != self.num_microbatches and (size, count) not in self._warned_microbatches:
            self._warned_microbatches.add((size, count))
            warnings.warn(
                f"BFPPStrategy: the last batch of the {step_name.replace('_step', '')} loader has {size} samples,"
                f" which num_microbatches={self.num_microbatches} does not divide; it runs as {count} micro-batches"
                f" of {size // count}. The result is exact, only the pipeline is less busy for this batch"
                " (`drop_last=True` in the DataLoader avoids it).",
                stacklevel=2,
            )
        return count

    def _agree_before_schedule(
        self, step_name: str, signature: Any, num_microbatches: int, failure: StepFailure, *, everywhere: bool
    ) -> None:
        """One exchange before a schedule is built for a new kind of step or batch shape: did the batch split or
        the input capture fail, and do the ranks of each pipeline run the same shape?

        The first schedule of a kind of step (the first training step, the first validation step) is built by
        every rank in the same step, so ``everywhere`` they meet and an error is raised on every rank. A later new
        shape may be one replica's alone (batches padded to their own longest sequence; the schedule's shape
        inference runs without data-parallel collectives, see :class:`lightning_bfpp.engine.runtime.PlannedSchedule`):
        then only the pipeline's ranks meet, an error is raised on them as :class:`PipelineAgreedError`, and the
        failure watchdog stops the other replicas' processes.

        Ranks building their stages for different shapes would issue different transfers and hang; a capture
        error on the first stage would leave every other rank waiting for its activations. Steps that reuse a
        built schedule skip this (see :meth:`run`), so the ranks cannot all be relied on to come: if they do
        not within ``agreement_timeout`` seconds (a rank whose batch shape differs from its pipeline's), this
        rank raises, and the failure watchdog stops the others.
        """
        world = dist.get_world_size() if dist.is_initialized() else 1
        agree_on_shape(
            step_name,
            (signature, num_microbatches),
            failure,
            group=None if everywhere else self.pipeline_group,
            size=world if everywhere else len(self.pipeline_ranks),
            # row i of the exchange is global rank i (everywhere) or the pipeline's i-th rank
            pipelines=self.pipelines if everywhere else [list(range(len(self.pipeline_ranks)))],
            world_size=world,
            device=self.device,
            timeout=self.agreement_timeout,
            rank_label=self.rank_label,
            shape=f"{signature[1] if signature is not None else None} in {num_microbatches}",
        )


def shape_varies_message(error: BaseException, step_name: str) -> str:
    """torch's refusal of a stage input or output whose shape is not the one inferred for the batch, with why
    and what to do (torch checks every micro-batch against the first: see ``PipelineRuntime.run_microbatches``).
    """
    return (
        f"BFPPStrategy: {error}. A stage's input or output has another shape in one micro-batch than in the others"
        f" of the same batch (in `{step_name}`). Batches may change shape from step to step, but the pipeline"
        " sends the micro-batches of one batch in buffers of one shape, so every micro-batch must give the same"
        " shapes: pad in the DataLoader's collate function (to the batch's longest sequence, not each"
        " micro-batch's), and do not cut data-dependent lengths (e.g. trailing padding) inside a layer or in the"
        " step before `self(...)`."
    )


def _placeholder_loss(output: Any) -> torch.Tensor:
    leaves = [
        t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
    ]
    if not leaves:
        return torch.zeros((), requires_grad=True)
    return sum(t.sum() for t in leaves) * 0.0  # type: ignore[return-value]
