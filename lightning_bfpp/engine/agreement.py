"""Turn an error on some ranks into the same error on every rank, instead of a hang.

In a pipeline, most checks and most user code run on a subset of ranks: the first stage captures the model's
input, the last stage runs the loss and the logging, global rank 0 plans and writes metadata. An exception
there leaves the other ranks waiting in their next collective. Wherever such an error can happen, the ranks
meet in one agreement after it: every rank says whether it failed, and if one did, every rank raises
:class:`AgreedError` with the failing rank's message. The failing rank's own exception is chained to it.
Agreed errors are raised everywhere at the same point, so the processes stay in step (and the failure
watchdog, :mod:`lightning_bfpp.engine.failures`, leaves them alone).

The ways to meet, all here: :func:`agree` runs a check on every rank and compares the outcomes (setup);
:func:`raise_on_every_rank` / :func:`gather_outcomes` share an error some ranks already have, with a payload
(checkpoints); :func:`raise_agreed` / :func:`agree_on_failure` turn a step's failure code, exchanged with the
step's own tensors, into the same error on every rank (the pipeline's step and its pre-schedule check).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class AgreedError(RuntimeError):
    """Raised on every rank because one rank failed at a point where all ranks compare notes."""


class PipelineAgreedError(AgreedError):
    """Raised on the ranks of one pipeline, which agreed on it; the other replicas' ranks are not there and
    must be stopped by the failure watchdog (see :mod:`lightning_bfpp.engine.failures`)."""


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def rank_name(rank: int | None = None, **coordinates: int) -> str:
    """``"rank 3 (pipeline rank 1, data-parallel rank 1)"``: the global rank and, if given, its mesh coordinates."""
    rank = dist.get_rank() if rank is None and dist.is_initialized() else (rank or 0)
    extra = ", ".join(
        f"{name.replace('data_parallel', 'data-parallel').replace('_', ' ')} {value}"
        for name, value in coordinates.items()
    )
    return f"rank {rank}" + (f" ({extra})" if extra else "")


def agree(fn: Callable[[], T], what: str, group: dist.ProcessGroup | None = None) -> T:
    """Run ``fn`` on every rank of ``group``; if it raised anywhere, raise :class:`AgreedError` everywhere.

    ``fn`` must not itself run collectives (a rank that failed before one would leave the others in it).
    Costs one ``all_gather_object``: meant for setup and other once-per-run points, not per step.
    """
    result: Any = None
    error: BaseException | None = None
    try:
        result = fn()
    except Exception as exc:  # BaseExceptions (KeyboardInterrupt, SystemExit) stop the process as usual
        error = exc
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return result
    label = rank_name()
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, None if error is None else (label, describe(error)), group=group)
    failures = [g for g in gathered if g is not None]
    if failures:
        raise AgreedError(failure_message(what, failures, len(gathered))) from error
    return result


# -- an error some ranks already have, shared with a payload ----------------------------------------------------

Shared = tuple[str | None, str] | None  # (context, text) of a rank's error, None where it did not fail


def as_shared(error: BaseException | None, context: str) -> Shared:
    """A rank's error as it travels to the others: (context, text); an :class:`AgreedError`'s text is a whole
    message already (no context added)."""
    if error is None:
        return None
    if isinstance(error, AgreedError):
        return None, str(error)
    return context, describe(error)


def gather_outcomes(error: BaseException | None, context: str, payload: Any = None) -> list[tuple[Shared, Any]]:
    """A collective: every rank's (shared error, ``payload``), in global rank order. Costs one
    ``all_gather_object``; for once-per-call points (checkpoints), not per step. One process: its own."""
    entry = (as_shared(error, context), payload)
    if not (dist.is_available() and dist.is_initialized()):
        return [entry]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, entry)
    return gathered


def raise_shared(shared: list[Shared], error: BaseException | None, exception: type[AgreedError] = AgreedError) -> None:
    """Raise the same ``exception`` on every rank from every rank's :func:`as_shared` entry, if any failed: the
    first failing rank's context and error, the other failing ranks named."""
    failed = [(rank, entry) for rank, entry in enumerate(shared) if entry is not None]
    if not failed:
        return
    first_rank, (context, text) = failed[0]
    prefix = f"{context}: " if context else ""
    if len(failed) == len(shared) and all(entry == failed[0][1] for _, entry in failed):
        message = prefix + text  # the same on every rank: nothing rank-specific to say
    else:
        others = [rank for rank, _ in failed[1:]]
        also = f" (and on rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})" if others else ""
        message = f"{prefix}rank {first_rank} failed{also}: {text}"
    raise exception(message) from error


def raise_on_every_rank(error: BaseException | None, context: str, exception: type[AgreedError] = AgreedError) -> None:
    """A collective: if any rank passes an error, every rank raises one ``exception`` naming that rank.

    An error raised on some ranks only leaves the others waiting in their next collective until the process
    group times out; sharing each rank's outcome first makes every rank stop with the same message (the
    failing rank's ``context`` and error). Without a process group (one process) it raises the error wrapped
    the same way.
    """
    raise_shared([entry for entry, _ in gather_outcomes(error, context)], error, exception)


def failure_message(what: str, failures: list[tuple[str, str]], world_size: int | None = None) -> str:
    label, cause = failures[0]
    if world_size is not None and len(failures) == world_size and len({c for _, c in failures}) == 1:
        return f"BFPPStrategy: {what} failed on every rank: {cause}"
    more = f" (and {len(failures) - 1} more rank(s) failed too)" if len(failures) > 1 else ""
    return f"BFPPStrategy: {what} failed on {label}{more}: {cause}"


def different_batch_shapes(step_name: str, here: str) -> str:
    """The message for a pipeline's ranks that ran one step on batches of different shapes (``here``: this
    rank's)."""
    return (
        f"BFPPStrategy: the ranks of one pipeline received batches of different shapes in the same"
        f" `{step_name}`; {here} micro-batches. {SAME_BATCH_FIX}"
    )


def different_batches(step_name: str, here: str) -> str:
    """The message for a pipeline's ranks whose batches have the same shapes but different contents."""
    return (
        f"BFPPStrategy: the ranks of one pipeline loaded different batches in the same `{step_name}` ({here});"
        " the first stage's input and the last stage's target would come from different samples. " + SAME_BATCH_FIX
    )


SAME_BATCH_FIX = (
    "Every process of a pipeline loads the batch itself, and they must load the same one. Likely causes: data"
    " or augmentations drawn at random in each process without a common seed (call"
    " `lightning.seed_everything(seed)` on every process before building the data, or draw the randomness in"
    " the DataLoader's `collate_fn` or `Dataset.__getitem__` from a generator seeded by the sample index), a"
    " sampler or dataset seeded per process (e.g. with the global rank; seed by the data-parallel rank, which"
    " `trainer.strategy.distributed_sampler_kwargs` gives), or a loader that is not deterministic (an"
    " IterableDataset read from a shared queue)."
)


class StepFailure:
    """One step's outcome on this rank: the first error, with where it happened, or nothing.

    Encoded as a small integer for the per-step all-reduce (``global rank + 1``, 0 for success); the message
    travels only when some rank failed.
    """

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.label = ""

    def record(self, error: BaseException, label: str) -> None:
        if self.error is None:
            self.error, self.label = error, label

    @property
    def code(self) -> int:
        return 0 if self.error is None else dist.get_rank() + 1

    def message(self) -> tuple[str, str]:
        assert self.error is not None
        return self.label, describe(self.error)


def raise_agreed(
    what: str, code: int, local: StepFailure, group: dist.ProcessGroup | None, device: torch.device
) -> None:
    """After an all-reduce (MAX) of :attr:`StepFailure.code` showed ``code != 0``: fetch the message from the
    failing global rank ``code - 1`` and raise it on every rank of ``group``."""
    source = code - 1
    box: list[Any] = [local.message() if dist.get_rank() == source else None]
    dist.broadcast_object_list(box, src=source, group=group, device=device)
    everywhere = group is None or dist.get_world_size(group) == dist.get_world_size()
    raise (AgreedError if everywhere else PipelineAgreedError)(failure_message(what, [box[0]])) from local.error


def agree_on_failure(what: str, failure: StepFailure, device: torch.device) -> None:
    """One all-reduce over all ranks of whether ``failure`` holds an error anywhere; if so, raise it everywhere."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if failure.error is not None:
            raise failure.error
        return
    flag = torch.tensor([failure.code], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    code = int(flag.item())
    if code:
        raise_agreed(what, code, failure, None, device)


def agree_on_shape(
    step_name: str,
    key: Any,
    failure: StepFailure,
    *,
    group: dist.ProcessGroup | None,
    size: int,
    pipelines: list[list[int]],
    world_size: int,
    device: torch.device,
    timeout: float | None,
    rank_label: str,
    shape: str,
) -> None:
    """The exchange before a schedule is built for a new batch shape (see ``Pipeline._agree_before_schedule``).

    Every rank of ``group`` (``size`` ranks) sends its failure code and a digest of ``key`` (the batch's shape
    signature; ``shape`` says it in words, "<shape> in <m>"). A failure anywhere is raised everywhere
    (:func:`raise_agreed`); ranks of one pipeline (rows ``pipelines`` of the exchange) with different shapes are
    refused, as :class:`PipelineAgreedError` over a pipeline's group alone. Ranks that do not come within
    ``timeout`` seconds (a rank whose batch shape differs from its pipeline's, the others running a seen shape)
    make this rank raise.
    """
    if size == 1:
        if failure.error is not None:
            raise failure.error
        return
    digest = zlib.crc32(repr(key).encode()) & 0x7FFFFFFF
    flags = torch.tensor([failure.code, digest], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(flags) for _ in range(size)]
    work = dist.all_gather(gathered, flags, group=group, async_op=True)
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as error:
        raise RuntimeError(
            f"BFPPStrategy: {rank_label} waited {timeout:.0f} s for the other ranks to check a new batch shape"
            f" ({shape} micro-batches) before `{step_name}`, while they ran a step with a shape they had seen"
            " before. The ranks of a pipeline must load the same batches: give them the same data order and the"
            " same collate function."
        ) from (failure.error or error)
    rows = torch.stack(gathered).cpu()
    code = int(rows[:, 0].max())
    if code:
        raise_agreed(f"`{step_name}`", code, failure, group, device)
    if any(len({int(rows[r, 1]) for r in ranks}) > 1 for ranks in pipelines):
        error_type = AgreedError if size == world_size else PipelineAgreedError
        raise error_type(different_batch_shapes(step_name, f"{rank_label} got {shape}"))
