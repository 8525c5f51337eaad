"""Which layers form which stage, and which pipeline rank holds which stage. Pure: no torch.

A model's ``pipeline_layers()`` is cut into ``p·v`` contiguous stages. Stage ``s`` lives on pipeline rank
``s mod p`` (the looping placement of Lamy-Poirier's breadth-first pipeline, also torch's "loop" style), so
each rank holds stages ``r, r+p, r+2p, …`` and a micro-batch travels the ring of ranks ``v`` times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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


def stage_rank(stage: int, pipeline_parallel_size: int) -> int:
    """The pipeline rank that holds ``stage`` under the looping placement."""
    return stage % pipeline_parallel_size


def rank_stages(rank: int, pipeline_parallel_size: int, stages_per_rank: int) -> tuple[int, ...]:
    """The stages held by pipeline rank ``rank``, in execution order."""
    return tuple(rank + k * pipeline_parallel_size for k in range(stages_per_rank))


@dataclass(frozen=True)
class StagePlan:
    """The partition of named layers into stages, and the stages' placement on pipeline ranks.

    ``layer_names`` are the layers' fully-qualified names in the LightningModule, so everything downstream
    (checkpoints, logs, optimizer state) keeps the module's own names whatever the layout.
    """

    layer_names: tuple[str, ...]
    stage_layer_counts: tuple[int, ...]
    pipeline_parallel_size: int

    def __post_init__(self) -> None:
        if sum(self.stage_layer_counts) != len(self.layer_names):
            raise ValueError("stage_layer_counts must add up to the number of layers")
        if len(self.stage_layer_counts) % self.pipeline_parallel_size:
            raise ValueError("the number of stages must be a multiple of pipeline_parallel_size")
        if any(c < 1 for c in self.stage_layer_counts):
            raise ValueError("every stage needs at least one layer")

    @property
    def num_stages(self) -> int:
        return len(self.stage_layer_counts)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.pipeline_parallel_size

    def layer_range(self, stage: int) -> range:
        start = sum(self.stage_layer_counts[:stage])
        return range(start, start + self.stage_layer_counts[stage])

    def stage_layers(self, stage: int) -> tuple[str, ...]:
        return tuple(self.layer_names[i] for i in self.layer_range(stage))

    def rank_of(self, stage: int) -> int:
        return stage_rank(stage, self.pipeline_parallel_size)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return rank_stages(rank, self.pipeline_parallel_size, self.stages_per_rank)

    def layers_of(self, rank: int) -> tuple[str, ...]:
        return tuple(name for s in self.stages_of(rank) for name in self.stage_layers(s))

    def describe(self, layer_weights: Sequence[int] | None = None) -> str:
        """A table of stage → rank → layers (→ parameters), for logs and error messages."""
        lines = []
        for s in range(self.num_stages):
            names = self.stage_layers(s)
            span = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]}"
            line = f"stage {s:>3} on pipeline rank {self.rank_of(s):>3}: {len(names):>3} layers ({span})"
            if layer_weights is not None:
                weight = sum(layer_weights[i] for i in self.layer_range(s))
                line += f", {weight:,} parameters"
            lines.append(line)
        return "\n".join(lines)
