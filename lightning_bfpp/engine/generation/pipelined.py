"""A ``generate`` call on a built pipeline, and on one process: the ring's setting around it.

Around :func:`~lightning_bfpp.engine.generation.ring.run_ring` a call on a pipeline does what touches more than one
rank, each once per call: it checks every layer can decode (agreed over all ranks, on the first call), has the
executor make the local stages' weights whole for the call (FSDP2's gathers over the data-parallel group, weight
passing's fetches; :meth:`~lightning_bfpp.engine.executors.Executor.generation_weights`), gives the tensor ranks of
a stage one random state for sampling, runs the ring in evaluation mode without gradients (modes restored after),
and hands the last stage's result to every rank of the pipeline.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from lightning_bfpp.engine.agreement import StepFailure, agree_on_failure
from lightning_bfpp.engine.generation.messages import Mailbox
from lightning_bfpp.engine.generation.ring import (
    DecodingLayer,
    Generated,
    RingStats,
    Stopping,
    TokenChooser,
    decoding_layers,
    run_ring,
)
from lightning_bfpp.engine.sharding import tensor_parallel_mesh

if TYPE_CHECKING:
    from lightning_bfpp.engine.pipeline import Pipeline


# the pipelines whose layers every rank has checked can decode (agreed once per pipeline)
_CHECKED: weakref.WeakSet[Pipeline] = weakref.WeakSet()
# the seed a step's `generate` call samples from (see lightning_bfpp.engine.generation.steps); None outside a step
_STEP_SEED: ContextVar[int | None] = ContextVar("bfpp_generation_step_seed", default=None)


@contextmanager
def sampling_seed(seed: int) -> Iterator[None]:
    """Inside the block a ``generate`` call samples from ``seed`` (a step's own), not from the process's generator."""
    token = _STEP_SEED.set(seed)
    try:
        yield
    finally:
        _STEP_SEED.reset(token)


def sampling_generator(device: torch.device) -> torch.Generator:
    """The generator a ``generate`` call samples from: seeded with the step's seed inside a step; elsewhere starting
    where this process's default generator is (``torch.manual_seed(s)`` just before the call gives what
    ``torch.multinomial`` would draw), drawing in its place, so the process's own stream is left as it was."""
    generator = torch.Generator(device=device)
    seed = _STEP_SEED.get()
    if seed is not None:
        return generator.manual_seed(seed)
    generator.set_state(torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state())
    return generator


@contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    """``module`` in evaluation mode inside the block (no dropout); every submodule's own mode back afterwards."""
    modes = [(sub, sub.training) for sub in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for sub, training in modes:
            sub.training = training


def _same_random_state(generator: torch.Generator | None, pipeline: Pipeline) -> None:
    """Give every tensor rank of this stage tensor rank 0's sampling state: they sample from the same logits and
    must choose the same tokens."""
    tensor = tensor_parallel_mesh(pipeline.mesh)
    if generator is None or tensor is None or tensor.size() == 1:
        return
    state = generator.get_state().to(pipeline.device)
    dist.broadcast(state, group_src=0, group=tensor.get_group())
    generator.set_state(state.cpu())


def _shared_result(result: Generated | None, pipeline: Pipeline, last: int, record: bool) -> Generated:
    """The last stage's result on every rank of the pipeline (two or three broadcasts over it)."""
    group = pipeline.pipeline_group
    if pipeline.plan.pipeline_parallel_size == 1:
        assert result is not None
        return result
    device = pipeline.device
    src = pipeline.pipeline_ranks[last]
    shape = torch.zeros(4, dtype=torch.int64, device=device)
    if result is not None:
        vocabulary = result.logits[0].shape[-1] if result.logits else 0
        shape = torch.tensor([*result.sequences.shape, len(result.logits), vocabulary], device=device)
    dist.broadcast(shape, src=src, group=group)
    rows, length, steps, vocabulary = shape.tolist()
    sequences = result.sequences if result is not None else torch.empty(rows, length, dtype=torch.long, device=device)
    dist.broadcast(sequences, src=src, group=group)
    logits: list[torch.Tensor] = []
    if record and steps:
        stacked = (
            torch.stack(result.logits)
            if result is not None
            else torch.empty(steps, rows, vocabulary, dtype=torch.float32, device=device)
        )
        dist.broadcast(stacked, src=src, group=group)
        logits = list(stacked.unbind(0))
    return Generated(sequences, logits)


def _checked_stages(pipeline: Pipeline) -> dict[int, list[DecodingLayer]]:
    """This rank's stages as decoding layers; a layer that cannot decode is refused on every rank at once (the
    check is agreed once per pipeline, before any other collective of the call)."""
    stages: dict[int, list[DecodingLayer]] = {}
    failure = StepFailure()
    try:
        for stage, stage_module in zip(pipeline.local_stages, pipeline.stage_modules, strict=True):
            stages[stage] = decoding_layers(list(stage_module.layers), pipeline.plan.stage_layers(stage))
    except TypeError as error:
        failure.record(error, pipeline.rank_label)
    if pipeline not in _CHECKED:
        agree_on_failure("generating through the pipeline", failure, pipeline.device)
        _CHECKED.add(pipeline)
    elif failure.error is not None:
        raise failure.error
    return stages


def generate_in_pipeline(
    pipeline: Pipeline,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    chooser_for: Callable[[slice], TokenChooser],
    stopping: Stopping,
    *,
    num_groups: int | None = None,
    generator: torch.Generator | None = None,
    record_logits: bool = False,
) -> Generated:
    """Decode ``input_ids`` through ``pipeline``: a collective of every rank (each pipeline passes the same
    prompts on all of its ranks; data-parallel replicas pass their own, any number, zero included). ``num_groups``:
    the groups in flight (default: the pipeline's ranks). ``generator``: the sampling state ``chooser_for``'s
    choosers draw from, made the same on every tensor rank of the last stage. Returns the result on every rank."""
    plan = pipeline.plan
    stages = _checked_stages(pipeline)
    ring = plan.pipeline_parallel_size
    me = pipeline.pipeline_rank
    mailbox = Mailbox(pipeline.pipeline_ranks, me, pipeline.pipeline_group, pipeline.device) if ring > 1 else None
    input_ids = input_ids.to(pipeline.device)
    attention_mask = attention_mask.to(pipeline.device)
    _same_random_state(generator, pipeline)
    with (
        torch.inference_mode(False),
        torch.no_grad(),
        evaluating(pipeline.module),
        pipeline.executor.generation_weights(pipeline.stage_modules),
    ):
        stats = RingStats(measure=True)
        result = run_ring(
            stages, plan.num_stages, plan.rank_of, me, ring, mailbox, input_ids, attention_mask, chooser_for,
            stopping, num_groups or ring, record_logits=record_logits, stats=stats,
        )  # fmt: skip
    pipeline.generation_stats = stats  # type: ignore[attr-defined]  # the last call's, for the curious and the tests
    return _shared_result(result, pipeline, plan.rank_of(plan.num_stages - 1), record_logits)


def generate_locally(
    module: nn.Module,
    layers: Sequence[nn.Module],
    names: Sequence[str],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    chooser_for: Callable[[slice], TokenChooser],
    stopping: Stopping,
    *,
    num_groups: int = 1,
    record_logits: bool = False,
) -> Generated:
    """Decode on one process, every layer in one stage (a module under another strategy, or outside a Trainer):
    the same ring, of one position, so the same code decides every token as under the pipeline."""
    stages = {0: decoding_layers(layers, names)}
    device = next((t.device for t in (*module.parameters(), *module.buffers())), input_ids.device)
    with torch.inference_mode(False), torch.no_grad(), evaluating(module):
        result = run_ring(
            stages, 1, lambda stage: 0, 0, 1, None, input_ids.to(device), attention_mask.to(device), chooser_for,
            stopping, num_groups, record_logits=record_logits,
        )  # fmt: skip
    assert result is not None
    return result
