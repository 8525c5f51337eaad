"""Split a Lightning batch into micro-batches, whatever its structure.

Tensors (at any depth of tuples, lists and dicts) are cut into equal parts along dim 0; everything else
(strings, numbers, 0-d tensors) is given to every micro-batch unchanged. torch's own splitter handles the
model's positional/keyword inputs only; the whole batch must be split here because each micro-batch is
handed to the user's ``training_step`` as if it were a small batch.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_bfpp._compat import tree_flatten, tree_unflatten


def batch_size(batch: Any) -> int:
    """The batch dimension shared by every tensor of ``batch``; raises if there is none or they disagree."""
    leaves, _ = tree_flatten(batch)
    sizes = {leaf.shape[0] for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim() > 0}
    if not sizes:
        raise ValueError("BFPPStrategy: the batch holds no tensor with a batch dimension to split into micro-batches.")
    if len(sizes) > 1:
        raise ValueError(
            f"BFPPStrategy: the batch's tensors disagree on their first (batch) dimension: {sorted(sizes)};"
            " every tensor in the batch must have the batch size as dim 0."
        )
    (size,) = sizes
    return size


def split_microbatches(batch: Any, num_microbatches: int) -> list[Any]:
    """``num_microbatches`` batches of the same structure, each with ``1/num_microbatches`` of the rows."""
    size = batch_size(batch)
    leaves, spec = tree_flatten(batch)
    if size % num_microbatches:
        raise ValueError(
            f"BFPPStrategy: a batch of {size} samples cannot be split into num_microbatches={num_microbatches}"
            " equal micro-batches. Use a per-device batch size divisible by num_microbatches, and"
            " `drop_last=True` in the DataLoader so the last batch is not smaller."
        )
    parts = [
        leaf.chunk(num_microbatches) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else None for leaf in leaves
    ]
    return [
        tree_unflatten([leaf if part is None else part[i] for leaf, part in zip(leaves, parts, strict=True)], spec)
        for i in range(num_microbatches)
    ]


def batch_signature(batch: Any) -> tuple[Any, ...]:
    """Structure, shapes and dtypes of a batch: stages are built for one signature and reused while it holds."""
    leaves, spec = tree_flatten(batch)
    shapes = tuple(
        (tuple(leaf.shape), str(leaf.dtype)) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
        for leaf in leaves
    )
    return (str(spec), shapes)
