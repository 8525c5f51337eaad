"""Which layers form which stage. Pure: no torch.

A model's ``pipeline_layers()`` is cut into ``p·v`` contiguous, non-empty stages; which rank holds which stage
is the schedule's placement (:mod:`lightning_bfpp.plan.placement`).
"""

from __future__ import annotations

from collections.abc import Sequence


def uniform_counts(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Layer counts per stage that differ by at most one, the larger stages first."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot cut {num_layers} layers into {num_stages} non-empty stages")
    base, extra = divmod(num_layers, num_stages)
    return tuple(base + (1 if s < extra else 0) for s in range(num_stages))


def balance_by_weight(weights: Sequence[int], num_stages: int) -> tuple[int, ...]:
    """Cut ``weights`` into ``num_stages`` non-empty contiguous runs, minimising the heaviest run.

    Ties on the heaviest run are broken by the smaller sum of squared run weights, so the remaining stages
    are as even as the heaviest one allows. Each layer counts its weight plus one, so that layers without
    parameters (activations, reshapes) are still spread instead of piling up on one stage.

    Exact dynamic programme over cut points, ``O(num_stages · n²)``; ``n`` is the number of layers, a few
    hundred at most, so this is instant.
    """
    n = len(weights)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot cut {n} layers into {num_stages} non-empty stages")
    if any(w < 0 for w in weights):
        raise ValueError("layer weights must be non-negative")
    cost = [w + 1 for w in weights]
    prefix = [0]
    for c in cost:
        prefix.append(prefix[-1] + c)

    inf = (float("inf"), float("inf"))
    # best[k][i]: (heaviest run, sum of squares) for the first i layers in k runs; cut[k][i]: last run start.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0, 0)
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                prev = best[k - 1][j]
                if prev == inf:
                    continue
                run = prefix[i] - prefix[j]
                cand = (max(prev[0], run), prev[1] + run * run)
                if cand < best[k][i]:
                    best[k][i] = cand
                    cut[k][i] = j
    counts: list[int] = []
    i = n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return tuple(reversed(counts))
