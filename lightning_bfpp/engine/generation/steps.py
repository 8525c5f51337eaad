"""An evaluation step that generates: ``self.generate(...)`` in ``validation_step``, ``test_step`` or ``predict_step``.

A step's code runs on the first stage up to its model call and on the last stage whole (see
:mod:`lightning_bfpp.engine.pipeline`). A step that calls ``self.generate(...)`` instead of ``self(...)`` runs the
same way around a generation call: the first stage runs the step on the whole batch up to ``self.generate(...)``
and hands that call (its prompts and options) to every rank of the pipeline, in one broadcast (for a module that
can generate, every evaluation step makes it, saying whether the step generates); every rank then takes part in
the call (:func:`~lightning_bfpp.engine.generation.pipelined.generate_in_pipeline`); and the last stage runs the
step whole, its ``self.generate(...)`` returning the result. The batch is not cut into micro-batches: the call's
groups of sequences keep the pipeline busy instead. Sampling draws from the step's seed (the one its first
micro-batch would have), the same on every rank of the pipeline and different for each data-parallel replica.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_bfpp.engine.agreement import PipelineAgreedError, describe
from lightning_bfpp.engine.microbatch import batch_digest, batch_signature
from lightning_bfpp.engine.random_state import derive_seed

if TYPE_CHECKING:
    from lightning_bfpp.engine.pipeline import Pipeline, StepResult


def step_seed(pipeline: Pipeline, step_key: Sequence[int]) -> int:
    return derive_seed(pipeline.base_seed, (*step_key, pipeline.data_parallel_rank, 0))


def generation_call(
    pipeline: Pipeline, step_name: str, batch: Any, step_args: tuple[Any, ...], step_key: Sequence[int]
) -> Any | None:
    """The step's ``self.generate(...)`` call on every rank of the pipeline (None: the step calls ``self(...)``). A
    failure of the step's code before the call is raised on every rank of the pipeline."""
    found: list[Any] = [None]
    if pipeline.holds_first_stage:
        try:
            with pipeline.user_code() as reseed:
                reseed(step_seed(pipeline, step_key))
                found[0] = ("call", pipeline.step_code.capture_generation(step_name, batch, step_args))
        except Exception as error:
            found[0] = ("failed", f"{pipeline.rank_label}: {describe(error)}")
    if pipeline.plan.pipeline_parallel_size > 1:
        first = pipeline.pipeline_ranks[pipeline.plan.rank_of(0)]
        if found[0] is not None and found[0][0] == "call" and found[0][1] is not None:
            found[0] = ("call", _moved(found[0][1], torch.device("cpu")))  # pickled: no device in it
        dist.broadcast_object_list(found, src=first, group=pipeline.pipeline_group, device=pipeline.device)
    kind, value = found[0]
    if kind == "failed":
        raise PipelineAgreedError(f"BFPPStrategy: `{step_name}` failed before its model call on {value}")
    return None if value is None else _moved(value, pipeline.device)


def _moved(value: Any, device: torch.device) -> Any:
    """``value``'s tensors (in tuples, lists, dicts and a call's arguments) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_moved(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    if hasattr(value, "args") and hasattr(value, "kwargs"):
        return type(value)(_moved(value.args, device), _moved(value.kwargs, device))
    return value


def generation_step(
    pipeline: Pipeline,
    step_name: str,
    batch: Any,
    step_args: tuple[Any, ...],
    call: Any,
    step_key: Sequence[int],
) -> StepResult:
    """Run ``call`` on every rank, then the step on the last stage with its result; the step's result as a
    pipelined step's (one micro-batch: the whole batch)."""
    from lightning_bfpp.engine.pipeline import StepResult

    seed = step_seed(pipeline, step_key)
    output = pipeline.step_code.generate(call, seed)
    signature = batch_signature(batch)
    result = StepResult(
        num_microbatches=1,
        step_name=step_name,
        recorder=pipeline.step_code.new_recorder(),
        batch_digest=zlib.crc32(repr((signature, 1)).encode()) & 0x7FFFFFFF,
        batch_description=f"{pipeline.rank_label} got {signature[1] if signature is not None else None} in 1",
        content_digest=batch_digest(batch),
    )
    if pipeline.holds_last_stage:
        result.losses, result.outputs, result.item_counts = [torch.zeros(())], [None], [None]
        try:
            with pipeline.user_code() as reseed:
                reseed(seed)
                result.outputs[0] = pipeline.step_code.finish_generated(
                    step_name, batch, step_args, output, result.recorder
                )
        except Exception as error:  # raised on every rank where they meet, as a pipelined step's
            result.failure.record(error, pipeline.rank_label)
    return result
