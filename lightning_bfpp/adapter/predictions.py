"""Predictions: one device's batch outputs from micro-batch outputs, and replicas' batches in dataset order.

One device runs ``predict_step`` once per batch; the pipeline runs it once per micro-batch, on the last stage.
:func:`merge_microbatches` rebuilds the batch's output where that is exact. Values with one entry per sample
(tensors whose dim 0 is the micro-batch size, lists as long as it) are concatenated; dicts, tuples and
namedtuples are merged field by field; any other value (a 0-d tensor, a number, a string, None, a tensor or
list of another length) has no per-sample structure and is returned once when every micro-batch returned the
same one. A batch-level value that differs between micro-batches (a mean, a loss) is not the batch's and is
refused. One that depends on the batch's size only (a count, a sum of ones) is equal in every micro-batch but
still differs from one device's: return such values per sample.

With several data-parallel replicas each sees a strided share of the dataset (``DistributedSampler``);
:func:`in_dataset_order` turns the replicas' batches, with the dataset indices Lightning recorded for them,
back into the batches one device would have produced, by the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_bfpp.adapter import _lightning_compat as lc
from lightning_bfpp.engine.agreement import agree_on_failure
from lightning_bfpp.engine.microbatch import batch_size
from lightning_bfpp.engine.same_values import same_values

_REMEDY = (
    "Return per-sample values instead (tensors with the batch as dim 0, lists with one item per sample), or"
    " compute the batch-level value from them in `on_predict_epoch_end`."
)


def merge_microbatches(outputs: Sequence[Any], microbatch_size: int) -> Any:
    """The batch's ``predict_step`` output as one device returns it, from its micro-batches' outputs.

    ``microbatch_size`` is the number of samples in each micro-batch: the length of a per-sample dimension.
    Raises ValueError where the batch's output cannot be rebuilt exactly.
    """
    if len(outputs) == 1:
        return outputs[0]
    return _merge(list(outputs), microbatch_size, "output")


def _merge(values: list[Any], size: int, where: str) -> Any:
    first = values[0]
    kind = type(first)
    if any(type(v) is not kind for v in values):
        types = sorted({type(v).__name__ for v in values})
        raise _refusal(where, f"values of different types ({', '.join(types)})", len(values), size)
    if isinstance(first, torch.Tensor) and all(v.dim() > 0 and v.shape[0] == size for v in values):
        return torch.cat(values)
    if isinstance(first, list) and all(len(v) == size for v in values):
        return [item for value in values for item in value]
    if isinstance(first, tuple) and all(len(v) == len(first) for v in values):
        names = getattr(first, "_fields", None)
        fields = [
            _merge([v[i] for v in values], size, f"{where}.{names[i]}" if names else f"{where}[{i}]")
            for i in range(len(first))
        ]
        return kind(*fields) if names else tuple(fields)
    if isinstance(first, dict) and all(v.keys() == first.keys() for v in values):
        return _like(first, {k: _merge([v[k] for v in values], size, f"{where}[{k!r}]") for k in first})
    if all(same_values(first, v) for v in values[1:]):
        return first
    raise _refusal(where, _describe(first), len(values), size)


def _refusal(where: str, what: str, count: int, size: int) -> ValueError:
    return ValueError(
        f"BFPPStrategy: `predict_step` returned {what} at `{where}` that differs between the batch's {count}"
        f" micro-batches and has no per-sample dimension (dim 0 or length {size}, the micro-batch's size). One"
        " device runs `predict_step` once on the whole batch; the pipeline runs it once per micro-batch, so a"
        f" batch-level value (a mean, a loss) is computed on part of the batch and cannot be rebuilt. {_REMEDY}"
    )


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "a 0-d tensor" if value.dim() == 0 else f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (list, tuple, dict)):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"a {type(value).__name__}"


def _like(template: dict[Any, Any], fields: dict[Any, Any]) -> dict[Any, Any]:
    """``fields`` as a mapping of ``template``'s type where that type can be built from a dict."""
    if type(template) is dict:
        return fields
    try:
        return type(template)(fields)
    except TypeError:
        return fields


class _NotReorderable(Exception):
    """An output whose per-sample items cannot be regrouped into one device's batches."""


class _Item:
    """One sample's entry of a per-sample list (a list is rebuilt, never stacked)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class _BatchLevel:
    """A value without per-sample structure, the same for every sample of its batch."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _split(output: Any, size: int, batch_level: list[Any]) -> list[Any]:
    """Per-sample items of a batch output of ``size`` samples; its batch-level values are appended to
    ``batch_level`` and stand as :class:`_BatchLevel` in every item."""
    if isinstance(output, torch.Tensor) and output.dim() > 0 and output.shape[0] == size:
        return list(output)
    if isinstance(output, list) and len(output) == size:
        return [_Item(item) for item in output]
    if isinstance(output, tuple) and output:
        fields = [_split(field, size, batch_level) for field in output]
        if hasattr(output, "_fields"):
            return [type(output)(*parts) for parts in zip(*fields, strict=True)]
        return [tuple(parts) for parts in zip(*fields, strict=True)]
    if isinstance(output, dict) and output:
        fields = {key: _split(value, size, batch_level) for key, value in output.items()}
        return [_like(output, {key: fields[key][i] for key in output}) for i in range(size)]
    batch_level.append(output)
    return [_BatchLevel(output)] * size


def _join(items: Sequence[Any]) -> Any:
    """A batch output from per-sample items of the same structure."""
    first = items[0]
    if any(type(item) is not type(first) for item in items):
        raise _NotReorderable
    if isinstance(first, torch.Tensor):
        return torch.stack(list(items))
    if isinstance(first, _Item):
        return [item.value for item in items]
    if isinstance(first, _BatchLevel):
        return first.value  # the same in every batch (checked in in_dataset_order)
    if isinstance(first, tuple):
        if any(len(item) != len(first) for item in items):
            raise _NotReorderable
        fields = [_join([item[i] for item in items]) for i in range(len(first))]
        return type(first)(*fields) if hasattr(first, "_fields") else tuple(fields)
    if isinstance(first, dict):
        if any(item.keys() != first.keys() for item in items):
            raise _NotReorderable
        return _like(first, {key: _join([item[key] for item in items]) for key in first})
    raise _NotReorderable


def in_dataset_order(
    replicas: Sequence[tuple[Sequence[Sequence[int]], Sequence[Any]]], batch_size: int
) -> list[Any] | None:
    """Batches of ``batch_size`` in dataset order from each replica's (batch indices, batch outputs).

    Per-sample values are regrouped by dataset index; samples that ``DistributedSampler`` repeated to even out
    the replicas appear once. A batch-level value is kept in every batch when all batches of all replicas
    returned the same one. Returns None when one device's batches cannot be rebuilt: an output without
    per-sample values, or with batch-level values that differ between batches.
    """
    by_index: dict[int, Any] = {}
    shared: list[Any] | None = None
    for batch_indices, outputs in replicas:
        for indices, output in zip(batch_indices, outputs, strict=True):
            batch_level: list[Any] = []
            items = _split(output, len(indices), batch_level)
            if shared is None:
                shared = batch_level
            elif not same_values(shared, batch_level):
                return None
            if all(isinstance(item, _BatchLevel) for item in items):
                return None  # nothing per sample to put in order
            for index, item in zip(indices, items, strict=True):
                by_index.setdefault(int(index), item)
    ordered = [by_index[i] for i in sorted(by_index)]
    try:
        return [_join(ordered[i : i + batch_size]) for i in range(0, len(ordered), batch_size)]
    except _NotReorderable:
        return None


def batch_predictions(result: Any, batch: Any, pipeline: Any, device: torch.device, group: Any) -> Any:
    """The batch's predictions as one device returns them, on every rank of the pipeline that computed them
    (``result`` is the pipelined ``predict_step``'s :class:`~lightning_bfpp.engine.pipeline.StepResult`; ``group``
    the pipeline's process group, None for one rank)."""
    merged: list[Any] = [None]
    if pipeline.holds_last_stage and result.failure.error is None:
        try:
            merged = [merge_microbatches(result.outputs, batch_size(batch) // result.num_microbatches)]
        except Exception as error:
            result.failure.record(error, pipeline.rank_label)
    # the point after the schedule where every rank meets: a failed predict_step is raised everywhere
    agree_on_failure("`predict_step`", result.failure, device)
    if group is not None:
        last = dist.get_world_size(group) - 1
        dist.broadcast_object_list(merged, group=group, group_src=last, device=device)
    return merged[0]


def gather_in_dataset_order(trainer: Any, group: Any, data_parallel_rank: int, warn: Any) -> None:
    """On data-parallel rank 0 (of pipeline rank 0), replace ``trainer.predict``'s returned predictions by every
    replica's, in dataset order; a collective over the data-parallel ``group``."""
    dataloaders = trainer.predict_dataloaders
    if not isinstance(dataloaders, (list, tuple)):
        dataloaders = [dataloaders] if dataloaders is not None else []
    replicas = dist.get_world_size(group)
    for dataloader_idx, dataloader in enumerate(dataloaders):
        results = lc.prediction_lists(trainer)
        if dataloader_idx >= len(results):
            break
        indices = lc.seen_batch_indices(dataloader)
        gathered: list[Any] = [None] * replicas if data_parallel_rank == 0 else []
        share = (indices, results[dataloader_idx])
        dist.gather_object(share, gathered if data_parallel_rank == 0 else None, group=group, group_dst=0)
        if data_parallel_rank != 0:
            continue
        ordered = None
        if all(indices is not None for indices, _ in gathered):
            batch_sampler = getattr(dataloader, "batch_sampler", None)
            ordered = in_dataset_order(gathered, getattr(batch_sampler, "batch_size", None) or 1)
        if ordered is None:
            warn(
                "BFPPStrategy: the predictions have no per-sample values (tensors or lists whose first"
                " dimension is the batch), or hold batch-level values that differ between batches, so they"
                " cannot be put back into one device's batches: `trainer.predict` returns this replica's"
                " share only, as with DDP."
            )
            continue
        results[dataloader_idx][:] = ordered
