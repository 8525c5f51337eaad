"""Make what a step logs on the last stage the value every rank logs.

Only last-stage ranks run the part of a step that calls ``self.log``, once per micro-batch. This module
folds those calls into one value per name (with the call's own ``reduce_fx``: the mean of equal-sized
micro-batch means is the batch mean), sends names and values to the other ranks of the pipeline, reduces
over the data-parallel replicas with the same ``reduce_fx``, and replays the calls through Lightning on
every rank in the same order. Every logger, the progress bar and every monitoring callback then sees the
single-device value of the global batch, on every rank, and no rank waits for a collective another rank
never starts.

Per step this costs a broadcast of a small header and of the values over the pipeline group, plus a small
all-reduce (failures and the names' digest) and one all-gather of the values over the data-parallel group;
the names themselves are sent only when they change. It is also where a step that failed on the last stage
is raised on every rank (see :mod:`lightning_bfpp.agreement`).
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

from lightning_bfpp._lightning_compat import set_metric_step_value
from lightning_bfpp.agreement import AgreedError, StepFailure, raise_agreed
from lightning_bfpp.user_step import LoggedValue

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
        else:
            step_values = [r.value for r in group]  # type: ignore[misc]
        specs.append(LogSpec(name, op, tuple(sorted(options.items())), attribute))
        values.append(_combine(step_values, op))
    flat = torch.stack(values) if values else torch.zeros(0)
    return specs, flat


_LOSS_SPEC = LogSpec("<loss>", "mean", ())


def _attribute_of(module: LightningModule, metric: Metric) -> str | None:
    """The metric's attribute name in the module (looked up only when a step logs a metric object)."""
    return next((name for name, m in module.named_modules() if m is metric), None)


class LoggedValueSync:
    """Moves combined values from the pipeline's last rank to all ranks and reduces them over replicas.

    It is also the point after the schedule where every rank meets: a step that failed on a last-stage rank
    (its loss, logging or metric code) is raised here on every rank, with that rank's message.
    """

    def __init__(
        self,
        pipeline_group: dist.ProcessGroup | None,
        last_pipeline_rank: int,
        data_parallel_group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> None:
        self._pp_group = pipeline_group
        self._src = last_pipeline_rank
        self._dp_group = data_parallel_group
        self._device = device
        self._specs: list[LogSpec] = []
        self._digest = -1

    def share(
        self,
        specs: list[LogSpec] | None,
        values: torch.Tensor | None,
        loss: torch.Tensor | None,
        failure: StepFailure,
        step_name: str,
    ) -> tuple[list[LogSpec], torch.Tensor, torch.Tensor]:
        """Every rank gets the specs, the values and the step loss, reduced over data-parallel replicas.

        The last pipeline rank passes what it combined (or a ``failure``); the other ranks pass ``None``. The
        loss is averaged over replicas like a logged mean, so the returned loss is the global batch's.
        """
        packed = None
        if specs is not None:
            assert values is not None and loss is not None
            specs = [*specs, _LOSS_SPEC]
            packed = torch.cat([values.float().cpu(), loss.detach().float().cpu().reshape(1)])
        code = failure.code
        if self._pp_group is not None:
            specs, packed, code = self._broadcast(specs, packed, code)
        digest = self._digest if self._pp_group is not None else zlib.crc32(repr(specs).encode())
        if self._dp_group is not None:
            flags = torch.tensor([code, digest, -digest], dtype=torch.int64, device=self._device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._dp_group)
            code, high, low = (int(v) for v in flags.tolist())
            if not code and high != -low:
                raise AgreedError(
                    f"BFPPStrategy: data-parallel replicas logged different names or reductions in the same"
                    f" `{step_name}` ({self._describe(specs)} here). Log the same names with the same options on"
                    " every batch (e.g. log a value as NaN rather than skipping the call)."
                )
        if code:
            world = dist.get_world_size() if dist.is_initialized() else 1
            if world == 1:
                assert failure.error is not None
                raise failure.error
            raise_agreed(f"`{step_name}`", code, failure, None, self._device)
        assert specs is not None and packed is not None
        packed = packed.to(self._device)
        if self._dp_group is not None:
            packed = self._reduce(specs, packed)
        return specs[:-1], packed[:-1], packed[-1]

    @staticmethod
    def _describe(specs: Sequence[LogSpec] | None) -> str:
        return ", ".join(f"{s.name} ({s.op})" for s in specs or () if s is not _LOSS_SPEC) or "nothing logged"

    def _broadcast(
        self, specs: list[LogSpec] | None, values: torch.Tensor | None, code: int
    ) -> tuple[list[LogSpec] | None, torch.Tensor | None, int]:
        is_src = specs is not None or code != 0
        header = torch.zeros(3, dtype=torch.int64, device=self._device)
        if is_src:
            header[2] = code
            if specs is not None:
                assert values is not None
                header[0] = zlib.crc32(repr(specs).encode())
                header[1] = values.numel()
        dist.broadcast(header, group=self._pp_group, group_src=self._src)
        digest, count, code = (int(v) for v in header.tolist())
        if code:
            return None, None, code
        if digest != self._digest:
            box: list[Any] = [specs]
            dist.broadcast_object_list(box, group=self._pp_group, group_src=self._src, device=self._device)
            self._specs, self._digest = box[0], digest
        if specs is None:
            values = torch.zeros(count, dtype=torch.float32, device=self._device)
        assert values is not None
        values = values.to(device=self._device, dtype=torch.float32).contiguous()
        dist.broadcast(values, group=self._pp_group, group_src=self._src)
        return self._specs, values, 0

    def _reduce(self, specs: Sequence[LogSpec], values: torch.Tensor) -> torch.Tensor:
        """Reduce every value over the replicas with its own op, in one all-gather."""
        size = dist.get_world_size(self._dp_group)
        gathered = torch.empty(size * values.numel(), dtype=values.dtype, device=values.device)
        dist.all_gather_into_tensor(gathered, values.contiguous(), group=self._dp_group)
        per_replica = gathered.view(size, values.numel())
        reduce = {"mean": torch.mean, "sum": torch.sum, "max": torch.amax, "min": torch.amin}
        reduced = values.clone()
        for op, fn in reduce.items():
            index = [i for i, s in enumerate(specs) if s.op == op]
            if index:
                reduced[index] = fn(per_replica[:, index], dim=0)
        return reduced


def replay(module: LightningModule, specs: Sequence[LogSpec], values: torch.Tensor, *, metric_updated: bool) -> None:
    """Call ``module.log`` for each name with its combined value, as the step itself would have.

    A logged metric's state lives where it was updated (the last stage); ranks where it was not
    (``metric_updated=False``) log the same metric object with default states, which add nothing when
    Lightning's epoch-end ``compute()`` syncs states over all ranks (sum, cat, min and max states), and are
    marked updated so torchmetrics does not warn about a ``compute`` before ``update``.
    """
    for spec, value in zip(specs, values, strict=True):
        options = dict(spec.options)
        if spec.metric_attribute is not None:
            metric = module.get_submodule(spec.metric_attribute)
            set_metric_step_value(metric, value.clone(), mark_updated=not metric_updated)
            module.log(spec.name, metric, metric_attribute=spec.metric_attribute, sync_dist=False, **options)
        else:
            module.log(spec.name, value.clone(), sync_dist=False, **options)
