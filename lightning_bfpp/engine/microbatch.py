"""Split a Lightning batch into micro-batches, whatever its structure.

Tensors (at any depth of tuples, lists and dicts) are cut into equal parts along dim 0; everything else
(strings, numbers, 0-d tensors) is given to every micro-batch unchanged. torch's own splitter handles the
model's positional/keyword inputs only; the whole batch must be split here because each micro-batch is
handed to the user's ``training_step`` as if it were a small batch.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_bfpp.engine._compat import tree_flatten, tree_unflatten


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


def microbatch_count(size: int, num_microbatches: int, *, last_batch: bool = False) -> int:
    """The number of equal micro-batches a batch of ``size`` samples runs as.

    ``num_microbatches`` when it divides ``size``. A loader's smaller last batch runs as the largest count
    below ``num_microbatches`` that divides it (exact, only less pipelined). Any other batch is refused: the
    micro-batch count decides the schedule and the loss weighting, and must not change silently.
    """
    if size % num_microbatches == 0:
        return num_microbatches
    if last_batch:
        return max(d for d in range(1, min(num_microbatches, size) + 1) if size % d == 0)
    if size < num_microbatches:
        raise ValueError(
            f"BFPPStrategy: a batch of {size} samples is smaller than num_microbatches={num_microbatches}: every"
            " micro-batch needs at least one sample. Use a per-device batch size of at least"
            f" {num_microbatches} (a multiple of it), or num_microbatches <= {size}."
        )
    valid_counts = [d for d in range(1, size + 1) if size % d == 0]
    lower = size - size % num_microbatches
    sizes = ", ".join(str(b) for b in (lower, lower + num_microbatches) if b > 0)
    raise ValueError(
        f"BFPPStrategy: a batch of {size} samples cannot be split into num_microbatches={num_microbatches} equal"
        f" micro-batches. Use a per-device batch size divisible by {num_microbatches} (e.g. {sizes}), or a"
        f" num_microbatches that divides {size} (one of {valid_counts}). Only a loader's last batch may be"
        " smaller; it then runs with fewer micro-batches."
    )


def split_microbatches(batch: Any, num_microbatches: int) -> list[Any]:
    """``num_microbatches`` batches of the same structure, each with ``1/num_microbatches`` of the rows.

    Tensors are cut along dim 0; so is a list of plain values as long as the batch (what a DataLoader's
    default collate makes of strings: one per sample), so each micro-batch keeps its own samples' values.
    Other values (numbers, 0-d tensors, shorter lists) reach every micro-batch unchanged.
    """
    size = batch_size(batch)
    if size % num_microbatches:
        raise ValueError(
            f"BFPPStrategy: a batch of {size} samples cannot be split into num_microbatches={num_microbatches}"
            " equal micro-batches. Use a per-device batch size divisible by num_microbatches, and"
            " `drop_last=True` in the DataLoader so the last batch is not smaller."
        )
    leaves, spec = tree_flatten(batch, is_leaf=lambda node: _is_per_sample_list(node, size))
    step = size // num_microbatches
    parts = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            parts.append(leaf.chunk(num_microbatches))
        elif _is_per_sample_list(leaf, size):
            parts.append([leaf[i * step : (i + 1) * step] for i in range(num_microbatches)])
        else:
            parts.append(None)
    return [
        tree_unflatten([leaf if part is None else part[i] for leaf, part in zip(leaves, parts, strict=True)], spec)
        for i in range(num_microbatches)
    ]


def _is_per_sample_list(node: Any, size: int) -> bool:
    return (
        isinstance(node, list)
        and len(node) == size
        and all(isinstance(item, (str, bytes, int, float, bool)) or item is None for item in node)
    )


def batch_signature(batch: Any) -> tuple[Any, ...]:
    """Structure, shapes and dtypes of a batch: stages are built for one signature and reused while it holds."""
    leaves, spec = tree_flatten(batch)
    shapes = tuple(
        (tuple(leaf.shape), str(leaf.dtype)) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
        for leaf in leaves
    )
    return (str(spec), shapes)


_DIGEST_WEIGHTS: dict[tuple[int, str], torch.Tensor] = {}
_AS_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def batch_digest(batch: Any) -> torch.Tensor | None:
    """A 52-bit digest of the batch's tensor contents, as a 0-d int64 tensor on the tensors' device.

    The ranks of one pipeline must run the same batch (the first stage's input and the last stage's target);
    comparing digests in the step's existing collective catches data drawn differently in each process. Each
    tensor's bits, read as integers, are weighted by their position and summed with integer wrap-around,
    which is associative: the same batch gives the same digest on any device and in any summation order,
    without copying the batch to the host (no synchronisation on an accelerator). 52 bits so that the value
    travels exactly in the collective's float64 row. None when the batch has no tensor.
    """
    total: torch.Tensor | None = None
    leaves, _ = tree_flatten(batch)
    for k, leaf in enumerate(t for t in leaves if isinstance(t, torch.Tensor) and t.numel() > 0):
        flat = leaf.detach().reshape(-1)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        if flat.dtype == torch.bool:
            flat = flat.to(torch.uint8)
        bits = flat.view(_AS_BITS[flat.element_size()]).to(torch.int64)
        key = (bits.numel(), str(bits.device))
        weights = _DIGEST_WEIGHTS.get(key)
        if weights is None:
            # position weights: odd multiples of a large odd constant, distinct for every position
            weights = (torch.arange(bits.numel(), dtype=torch.int64, device=bits.device) * 2 + 1) * 0x9E3779B1
            if len(_DIGEST_WEIGHTS) > 64:
                _DIGEST_WEIGHTS.clear()
            _DIGEST_WEIGHTS[key] = weights
        value = (bits * weights).sum() * (2 * k + 3)
        total = value if total is None else total + value.to(total.device)
    return None if total is None else total & ((1 << 52) - 1)
