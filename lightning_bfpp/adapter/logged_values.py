"""Make what a step logs on the last stage the value every rank logs.

Only last-stage ranks run the part of a step that calls ``self.log``, once per micro-batch. This module
folds those calls into one value per name (with the call's own ``reduce_fx``: the mean of equal-sized
micro-batch means is the batch mean), sends names and values to every rank, reduces over the data-parallel
replicas with the same ``reduce_fx``, and replays the calls through Lightning on every rank in the same
order. Every logger, the progress bar and every monitoring callback then sees the single-device value of
the global batch, on every rank, and no rank waits for a collective another rank never starts.

Per step this costs one small exchange over all ranks (the step's only collective outside the pipeline);
the names themselves are sent only when they change. It is also where a step that failed on some ranks is
raised on every rank (see :mod:`lightning_bfpp.engine.agreement`).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torchmetrics import Metric

from lightning_bfpp.adapter._lightning_compat import set_metric_step_value
from lightning_bfpp.adapter.user_step import LoggedValue
from lightning_bfpp.engine.agreement import (
    AgreedError,
    StepFailure,
    different_batch_shapes,
    different_batches,
    raise_agreed,
)

_REDUCE_OPS: dict[Any, str] = {
    "mean": "mean",
    "avg": "mean",
    torch.mean: "mean",
    "sum": "sum",
    torch.sum: "sum",
    "max": "max",
    torch.max: "max",
    "min": "min",
    torch.min: "min",
}


@dataclass(frozen=True)
class LogSpec:
    """What is needed to replay one name's ``self.log`` call on another rank (the value travels apart)."""

    name: str
    op: str
    options: tuple[tuple[str, Any], ...]
    metric_attribute: str | None = None

    @property
    def width(self) -> int:
        """Slots the value takes in the exchanged row: a ``mean_over_items`` value travels as (sum, count)."""
        return 2 if self.op == "items" else 1


def reduce_op(reduce_fx: Any, name: str) -> str:
    try:
        return _REDUCE_OPS[reduce_fx]
    except (KeyError, TypeError):
        raise ValueError(
            f"`self.log({name!r}, ..., reduce_fx={reduce_fx!r})`: under BFPPStrategy a logged value is combined"
            " over micro-batches and data-parallel replicas, which needs reduce_fx 'mean', 'sum', 'max' or"
            " 'min'."
        ) from None


def _combine(values: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    stacked = torch.stack([v.float() for v in values])
    return {"mean": stacked.mean, "sum": stacked.sum, "max": stacked.max, "min": stacked.min}[op]()


def combine_microbatches(
    records: Sequence[LoggedValue], module: LightningModule, *, on_step_by_default: bool = True
) -> tuple[list[LogSpec], torch.Tensor]:
    """One spec and one value per logged name, in order of first logging, over a step's micro-batches.

    A logged torchmetrics ``Metric`` contributes its per-micro-batch ``forward`` value (the step value
    Lightning shows); its state, and so its epoch value, accumulates in the metric itself.
    """
    grouped: dict[str, list[LoggedValue]] = {}
    for record in records:
        grouped.setdefault(record.name, []).append(record)
    specs: list[LogSpec] = []
    values: list[torch.Tensor] = []
    for name, group in grouped.items():
        first = group[0]
        options = {k: v for k, v in first.options.items() if k not in ("sync_dist", "sync_dist_group")}
        op = reduce_op(options["reduce_fx"], name)
        attribute = None
        if isinstance(first.value, Metric):
            attribute = options.pop("metric_attribute") or _attribute_of(module, first.value)
            if attribute is None:
                raise ValueError(
                    f"`self.log({name!r}, metric)`: the metric is not an attribute of the LightningModule;"
                    " assign it in `__init__` so every rank holds the same metric."
                )
            caches = [r.metric_step_value for r in group]
            on_step = options["on_step"] if options["on_step"] is not None else on_step_by_default
            if any(c is None for c in caches):
                if on_step:
                    raise ValueError(
                        f"`self.log({name!r}, metric)` logs a metric per step, but its forward was not called in"
                        " this step; call `metric(preds, target)` (not only `update`) before logging it, or log"
                        " it with `on_step=False`."
                    )
                caches = [torch.tensor(float("nan"))] * len(caches)  # no step value; the epoch value is computed
            step_values = [torch.as_tensor(c).detach() for c in caches]
        elif op == "mean" and all(r.items is not None for r in group):
            # `mean_over_items` values: one sum over one count, as one device computes it on the whole batch
            totals = torch.stack([r.items[0].double() for r in group]).sum()  # type: ignore[index]
            counts = torch.stack([r.items[1].double() for r in group]).sum()  # type: ignore[index]
            specs.append(LogSpec(name, "items", tuple(sorted(options.items())), attribute))
            values.extend([totals, counts])
            continue
        else:
            step_values = [r.value for r in group]  # type: ignore[misc]
        specs.append(LogSpec(name, op, tuple(sorted(options.items())), attribute))
        values.append(_combine(step_values, op))
    flat = torch.stack([v.double().cpu() for v in values]) if values else torch.zeros(0, dtype=torch.float64)
    return specs, flat


_LOSS_SPEC = LogSpec("<loss>", "mean", ())
_ITEMS_LOSS_SPEC = LogSpec("<loss>", "items", ())


def _attribute_of(module: LightningModule, metric: Metric) -> str | None:
    """The metric's attribute name in the module (looked up only when a step logs a metric object)."""
    return next((name for name, m in module.named_modules() if m is metric), None)


# failure code, batch shape digest, holds values, names digest, number of values, stop requested, content digest
_HEADER = 7


@dataclass
class SharedStep:
    """What every rank knows after a step's exchange."""

    specs: list[LogSpec]
    values: torch.Tensor  # one per spec, reduced over micro-batches and replicas
    loss: torch.Tensor  # the global batch's loss
    # the global batch's item count when the step returned `mean_over_items` (else None), and the number of
    # data-parallel replicas (last-stage ranks) it was summed over
    loss_items: float | None = None
    replicas: int = 1


_INITIAL_CAPACITY = 8


class LoggedValueSync:
    """The one collective of a step: every rank's outcome and the last stages' logged values, to every rank.

    One exchange over all ranks of a small fixed-size row per rank: the rank's failure code, the digest of
    its batch shape, whether it received SIGTERM (what Lightning's own per-batch broadcast would carry), and
    on last-stage ranks the digest of the logged names and the values (plus the loss).
    From it every rank raises the same error if a rank failed (the user's loss or logging on the last stage,
    the input capture on the first) or the ranks ran different batch shapes, and reduces the replicas' values
    with each name's ``reduce_fx``. The names themselves travel only when they change, and the row grows
    (on every rank alike: all see the counts) when more values are logged than it holds.

    The exchange is an all-to-all of each rank's row to every rank, not an all-gather, for the rank that
    arrives last, which is where it matters (the pipeline's first rank, whose last backward ends the step and
    whose next forward starts the next one). gloo gathers over a ring: after the last rank arrives, its row
    still takes ``world − 1`` hops, each waiting for the next process to be scheduled. Its all-to-all posts
    every pair's transfer at once, one hop. Measured with 4 gloo processes on 2 cores, the last of them
    arriving 4 ms after the others (``python benchmarks/step_sync.py``, three runs): 0.66–0.68 ms in the call
    against 1.33–1.47 ms (median), 1.1–3.6 ms against 4.7–5.6 ms (90th percentile). NCCL's all-to-all is
    likewise a single round of point-to-point transfers.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._world = dist.get_world_size() if dist.is_initialized() else 1
        self._capacity = _INITIAL_CAPACITY
        self._specs: list[LogSpec] = []
        self._digest = -1.0
        # some rank asked to stop (received SIGTERM), or to save and requeue (SLURM's requeue signal), by the last
        # step: every rank knows it alike
        self.stop_agreed = self.requeue_agreed = False

    def share_step(self, result: Any, module: LightningModule, pipeline: Any, *, stop_requested: int = 0) -> SharedStep:
        """Share a pipelined step's outcome (a :class:`~lightning_bfpp.engine.pipeline.StepResult`) and replay its
        logs on every rank; the returned loss is averaged like the logged values (for a ``mean_over_items``
        step, with the global item count).

        Also where a step that failed on a last-stage rank is raised on every rank, and where the ranks of each
        pipeline are checked to have run the same batch.
        """
        specs = values = None
        loss, items = result.loss_and_items()
        # the last stage's tensor ranks hold the same values: tensor rank 0's count once per replica
        speaks = pipeline.holds_last_stage and pipeline.tensor_rank == 0
        if not speaks:
            loss = items = None
        if speaks and result.failure.error is None:
            try:
                specs, values = combine_microbatches(
                    result.recorder.records, module, on_step_by_default=result.step_name == "training_step"
                )
                loss = torch.zeros(()) if loss is None else loss
            except Exception as error:
                result.failure.record(error, pipeline.rank_label)
                specs = values = None
        shared = self.share(
            specs,
            values,
            loss,
            result.failure,
            result.step_name,
            result.batch_digest,
            result.batch_description,
            stop_requested=stop_requested,
            loss_items=items,
            content_digest=result.content_digest,
            pipelines=pipeline.pipelines,
        )
        replay(module, shared.specs, shared.values, metric_updated=pipeline.holds_last_stage)
        return shared

    def share(
        self,
        specs: list[LogSpec] | None,
        values: torch.Tensor | None,
        loss: torch.Tensor | None,
        failure: StepFailure,
        step_name: str,
        batch_digest: int = 0,
        batch_description: str = "",
        stop_requested: int = 0,
        *,
        loss_items: torch.Tensor | None = None,
        content_digest: torch.Tensor | None = None,
        pipelines: Sequence[Sequence[int]] | None = None,
    ) -> SharedStep:
        """Every rank gets the specs, the values and the step loss, reduced over data-parallel replicas.

        Last-stage ranks pass what they combined (or nothing, with a ``failure``); the other ranks pass
        ``None``. The loss is averaged over replicas like a logged mean, so the returned loss is the global
        batch's; with ``loss_items`` (a ``mean_over_items`` step: ``loss`` is then this replica's summed loss)
        it is the sum over replicas divided by the summed count, which is returned too. The ranks of each
        pipeline (``pipelines``: every pipeline's global ranks; default one of all ranks) must have run the same
        ``batch_digest`` and ``content_digest``; pipelines may differ from each other. A mismatch anywhere is
        raised on every rank.
        """
        packed = None
        digest = 0.0
        if specs is not None:
            assert values is not None and loss is not None
            if loss_items is None:
                specs = [*specs, _LOSS_SPEC]
                loss_slots = [loss.detach().double().cpu().reshape(1)]
            else:
                specs = [*specs, _ITEMS_LOSS_SPEC]
                loss_slots = [loss.detach().double().cpu().reshape(1), loss_items.double().cpu().reshape(1)]
            packed = torch.cat([values.double().cpu(), *loss_slots])
            digest = float(zlib.crc32(repr(specs).encode()))
        rows = self._gather(failure.code, batch_digest, packed, digest, stop_requested, content_digest)
        requests = rows[:, 5].long()  # bits: 1 stop, 2 requeue (adapter._lightning_compat.STOP, REQUEUE)
        self.stop_agreed, self.requeue_agreed = bool((requests & 1).any()), bool((requests & 2).any())
        code = int(rows[:, 0].max())
        if code:
            if self._world == 1:
                assert failure.error is not None
                raise failure.error
            raise_agreed(f"`{step_name}`", code, failure, None, self._device)
        for ranks in pipelines if pipelines is not None else [range(self._world)]:
            group = rows[list(ranks)]
            if bool((group[:, 1] != group[0, 1]).any()):
                raise AgreedError(different_batch_shapes(step_name, batch_description))
            if bool((group[:, 6] != group[0, 6]).any()):
                other = next(r for r, v in zip(ranks, group[:, 6].tolist(), strict=True) if v != float(group[0, 6]))
                here = f"global ranks {ranks[0]} and {other} hold batches of the same shapes with other contents"
                raise AgreedError(different_batches(step_name, here))
        last = rows[rows[:, 2] == 1]
        if bool((last[:, 3] != last[0, 3]).any()):
            raise AgreedError(
                f"BFPPStrategy: data-parallel replicas logged different names or reductions in the same"
                f" `{step_name}` ({self._describe(specs)} here). Log the same names with the same options on"
                " every batch (e.g. log a value as NaN rather than skipping the call)."
            )
        if float(last[0, 3]) != self._digest:  # the names changed: fetch them from the first last-stage rank
            box: list[Any] = [specs]
            if self._world > 1:
                source = int((rows[:, 2] == 1).nonzero()[0])
                dist.broadcast_object_list(box, src=source, device=self._device)
            self._specs, self._digest = box[0], float(last[0, 3])
        count = int(last[0, 4])
        per_replica = last[:, _HEADER : _HEADER + count]
        reduced = self._reduce(self._specs, per_replica).float().to(self._device)
        loss_items = None
        if self._specs[-1].op == "items":
            loss_items = float(per_replica[:, -1].sum())
        return SharedStep(self._specs[:-1], reduced[:-1], reduced[-1], loss_items, int(last.shape[0]))

    def _gather(
        self,
        code: int,
        batch_digest: int,
        packed: torch.Tensor | None,
        digest: float,
        stop: int,
        content_digest: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """All ranks' rows, ``[world, header + capacity]`` in float64 (exact for the integer fields)."""
        count = 0 if packed is None else packed.numel()
        while True:
            row = torch.zeros(_HEADER + self._capacity, dtype=torch.float64)
            header = [code, batch_digest, packed is not None, digest, count, stop, 0]
            row[:_HEADER] = torch.tensor(header, dtype=torch.float64)
            if packed is not None:
                row[_HEADER : _HEADER + min(count, self._capacity)] = packed[: self._capacity]
            row = row.to(self._device)
            if content_digest is not None:  # stays on its device: no synchronisation to read it
                row[6] = content_digest.to(device=self._device, dtype=torch.float64)
            if self._world == 1:
                rows = row[None].cpu()
            else:
                gathered = torch.empty(self._world * row.numel(), dtype=row.dtype, device=self._device)
                dist.all_to_all_single(gathered, row.repeat(self._world))  # an all-gather in one hop (see above)
                rows = gathered.view(self._world, -1).cpu()
            needed = int(rows[:, 4].max())
            if needed <= self._capacity or bool(rows[:, 0].any()):
                return rows
            # more values than the row holds: every rank saw the count, so every rank grows it and gathers again
            self._capacity = 1 << (needed - 1).bit_length()

    @staticmethod
    def _describe(specs: Sequence[LogSpec] | None) -> str:
        return ", ".join(f"{s.name} ({s.op})" for s in specs or () if s is not _LOSS_SPEC) or "nothing logged"

    @staticmethod
    def _reduce(specs: Sequence[LogSpec], per_replica: torch.Tensor) -> torch.Tensor:
        """Reduce every value over the replicas (rows) with its own op: one value per spec, in float64.

        A ``mean_over_items`` value is its summed sums over its summed counts (0 when there are no items).
        """
        reduce = {"mean": torch.mean, "sum": torch.sum, "max": torch.amax, "min": torch.amin}
        reduced = torch.empty(len(specs), dtype=torch.float64)
        slot = 0
        for i, spec in enumerate(specs):
            if spec.op == "items":
                total, count = per_replica[:, slot].sum(), per_replica[:, slot + 1].sum()
                reduced[i] = total / count.clamp(min=1.0)
            else:
                reduced[i] = reduce[spec.op](per_replica[:, slot], dim=0)
            slot += spec.width
        return reduced


class _ReducedOverReplicas:
    """The ``sync_dist_group`` of replayed values: already combined over every micro-batch and replica, the same
    on every rank. Lightning's sync (``BFPPStrategy.reduce``) returns them as they are."""

    def __repr__(self) -> str:
        return "REDUCED_OVER_REPLICAS"


REDUCED_OVER_REPLICAS = _ReducedOverReplicas()


def replay(module: LightningModule, specs: Sequence[LogSpec], values: torch.Tensor, *, metric_updated: bool) -> None:
    """Call ``module.log`` for each name with its combined value, as the step itself would have.

    A logged metric's state lives where it was updated (the last stage); ranks where it was not
    (``metric_updated=False``) log the same metric object with default states, which add nothing when
    Lightning's epoch-end ``compute()`` syncs states over all ranks (sum, cat, min and max states), and are
    marked updated so torchmetrics does not warn about a ``compute`` before ``update``. Tensor values are logged
    with ``sync_dist=True`` over :data:`REDUCED_OVER_REPLICAS`: nothing is reduced again, and Lightning does not
    advise ``sync_dist=True`` for epoch-level values that are already the whole batch's.
    """
    for spec, value in zip(specs, values, strict=True):
        options = dict(spec.options)
        if spec.metric_attribute is not None:
            metric = module.get_submodule(spec.metric_attribute)
            set_metric_step_value(metric, value.clone(), mark_updated=not metric_updated)
            module.log(spec.name, metric, metric_attribute=spec.metric_attribute, sync_dist=False, **options)
        else:
            module.log(spec.name, value.clone(), sync_dist=True, sync_dist_group=REDUCED_OVER_REPLICAS, **options)
