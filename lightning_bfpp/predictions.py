"""Predictions: merge micro-batch outputs into batch outputs, and put replicas' batches in dataset order.

``predict_step`` runs per micro-batch on the last stage; its outputs are merged back into one output per
batch (tensors concatenated along dim 0, lists concatenated, tuples and dicts merged field by field). With
several data-parallel replicas each sees a strided share of the dataset (``DistributedSampler``);
:func:`in_dataset_order` turns the replicas' batches, with the dataset indices Lightning recorded for them,
back into the batches one device would have produced.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def merge_microbatches(outputs: Sequence[Any]) -> Any:
    """One batch output from micro-batch outputs of the same structure."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return torch.stack(list(outputs))
        return torch.cat(list(outputs))
    if isinstance(first, list):
        return [item for out in outputs for item in out]
    if isinstance(first, tuple):
        merged = [merge_microbatches([out[i] for out in outputs]) for i in range(len(first))]
        return type(first)(*merged) if hasattr(first, "_fields") else tuple(merged)
    if isinstance(first, dict):
        return {key: merge_microbatches([out[key] for out in outputs]) for key in first}
    if first is None:
        return None
    return list(outputs)


def _split(output: Any, size: int) -> list[Any] | None:
    """Per-sample items of a batch output, or None if it has no batch dimension of ``size``."""
    if isinstance(output, torch.Tensor):
        return list(output) if output.dim() > 0 and output.shape[0] == size else None
    if isinstance(output, list):
        return list(output) if len(output) == size else None
    if isinstance(output, dict):
        parts = {k: _split(v, size) for k, v in output.items()}
        if any(p is None for p in parts.values()):
            return None
        return [{k: parts[k][i] for k in output} for i in range(size)]  # type: ignore[index]
    if isinstance(output, tuple):
        fields = [_split(v, size) for v in output]
        if any(f is None for f in fields):
            return None
        return [tuple(f[i] for f in fields) for i in range(size)]  # type: ignore[index]
    return None


def _join(items: Sequence[Any]) -> Any:
    first = items[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(list(items))
    if isinstance(first, dict):
        return {k: _join([it[k] for it in items]) for k in first}
    if isinstance(first, tuple):
        return tuple(_join([it[i] for it in items]) for i in range(len(first)))
    return list(items)


def in_dataset_order(
    replicas: Sequence[tuple[Sequence[Sequence[int]], Sequence[Any]]], batch_size: int
) -> list[Any] | None:
    """Batches of ``batch_size`` in dataset order from each replica's (batch indices, batch outputs).

    Samples that ``DistributedSampler`` repeated to even out the replicas appear once. Returns None when an
    output has no per-sample structure to reorder (e.g. one scalar per batch).
    """
    by_index: dict[int, Any] = {}
    for batch_indices, outputs in replicas:
        for indices, output in zip(batch_indices, outputs, strict=True):
            items = _split(output, len(indices))
            if items is None:
                return None
            for index, item in zip(indices, items, strict=True):
                by_index.setdefault(int(index), item)
    ordered = [by_index[i] for i in sorted(by_index)]
    return [_join(ordered[i : i + batch_size]) for i in range(0, len(ordered), batch_size)]
