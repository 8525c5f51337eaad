"""Whether two nested values (tensors, lists, tuples, dicts, plain values) are the same, for the checks that ranks
hold one value: predictions shared by a replica's ranks, loader states saved by every replica."""

from __future__ import annotations

import math
from collections.abc import Set
from typing import Any

import torch


def same_values(a: Any, b: Any, *, ignored_keys: Set[str] = frozenset()) -> bool:
    """Whether ``a`` and ``b`` are equal in type, structure and content (NaN equal to NaN), leaving out the dict
    entries named in ``ignored_keys`` at any depth."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            return False
        equal = a == b
        if a.is_floating_point() or a.is_complex():
            equal |= a.isnan() & b.isnan()
        return bool(equal.all())
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_values(x, y, ignored_keys=ignored_keys) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        keys = a.keys() - ignored_keys
        return keys == b.keys() - ignored_keys and all(same_values(a[k], b[k], ignored_keys=ignored_keys) for k in keys)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    try:
        return bool(a == b)
    except Exception:  # e.g. an array's elementwise comparison: not a value known to be equal
        return False
