"""What a measured pipeline step waited on: its critical path through the ranks' spans, and a replay. Pure.

The spans are :class:`lightning_bfpp.plan.timeline.Span` records of one step on every rank, on one clock (see
``workers._Spans``). A compute span (a stage's forward or backward of a micro-batch) starts after two things:
the previous compute on its rank, and, for a stage whose input comes from another rank, the producing span
there (the previous stage's forward, the next stage's backward). Walking back from the step's last compute
span, always to whichever of the two ended later, gives the critical path; its length splits into compute,
*hops* (a producer's end to the consumer's start on another rank: the send, the transfer, the wake-up) and
*gaps* (host time between two consecutive compute spans of one rank: the runtime's bookkeeping, posting
transfers, autograd). :func:`replay` runs the same per-rank orders with chosen costs, to tell what the order
itself does under a given hop latency.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from lightning_bfpp.plan.timeline import COMPUTE, Span

Op = tuple[str, int, int]  # (kind: "forward" | "backward", stage, micro-batch)


@dataclass
class Path:
    """One step's critical path: where its length went."""

    length: float = 0.0  # the step's first compute start (rank 0's step start) to its last compute end
    lead: float = 0.0  # rank 0's step start to the first compute on the path
    compute: float = 0.0
    computes: int = 0
    hop_latencies: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)  # the path's compute spans, first to last


def op_of(span: Span) -> Op:
    assert span.stage is not None and span.microbatch is not None
    return span.kind, span.stage, span.microbatch


def producer(op: Op, num_stages: int) -> Op | None:
    """The compute whose output ``op`` consumes (its own forward, for the last stage's backward)."""
    kind, stage, mb = op
    if kind == "forward":
        return ("forward", stage - 1, mb) if stage > 0 else None
    return ("backward", stage + 1, mb) if stage < num_stages - 1 else ("forward", stage, mb)


def critical_path(spans: Iterable[Span], num_stages: int, step_start: float) -> Path:
    """The critical path of one step's compute spans (every rank's), from ``step_start`` on rank 0's clock."""
    compute = sorted((s for s in spans if s.kind in COMPUTE), key=lambda s: s.start)
    by_op = {op_of(s): s for s in compute}
    previous: dict[Op, Span | None] = {}
    last_on_rank: dict[int, Span] = {}
    for span in compute:
        previous[op_of(span)] = last_on_rank.get(span.rank)
        last_on_rank[span.rank] = span
    path = Path()
    here: Span | None = max(compute, key=lambda s: s.end)
    path.length = here.end - step_start
    while here is not None:
        op = op_of(here)
        path.ops.append(op)
        path.compute += here.duration
        path.computes += 1
        source = producer(op, num_stages)
        remote = by_op.get(source) if source is not None else None
        if remote is not None and remote.rank == here.rank:
            remote = None  # the same rank's chain covers it
        local = previous[op]
        if remote is not None and (local is None or remote.end > local.end):
            path.hop_latencies.append(here.start - remote.end)
            here = remote
        elif local is not None:
            path.gaps.append(here.start - local.end)
            here = local
        else:
            path.lead = here.start - step_start
            here = None
    path.ops.reverse()
    return path


def orders(spans: Iterable[Span]) -> dict[int, list[Op]]:
    """Each rank's compute in the order it ran."""
    by_rank: dict[int, list[Span]] = {}
    for span in sorted((s for s in spans if s.kind in COMPUTE), key=lambda s: s.start):
        by_rank.setdefault(span.rank, []).append(span)
    return {rank: [op_of(s) for s in ranked] for rank, ranked in by_rank.items()}


def replay(
    rank_orders: Mapping[int, Sequence[Op]],
    num_stages: int,
    forward: float,
    backward: float,
    hop: float = 0.0,
    gap: float = 0.0,
) -> float:
    """The step time of these per-rank orders with per-stage ``forward`` / ``backward`` times, ``hop`` from a
    producer's end to a consumer on another rank, and ``gap`` of host time after every compute."""
    rank_of = {op: rank for rank, ops in rank_orders.items() for op in ops}
    done: dict[Op, float] = {}
    free = dict.fromkeys(rank_orders, 0.0)
    cursor = dict.fromkeys(rank_orders, 0)
    remaining = sum(len(ops) for ops in rank_orders.values())
    while remaining:
        progress = False
        for rank, ops in rank_orders.items():
            while cursor[rank] < len(ops):
                op = ops[cursor[rank]]
                source = producer(op, num_stages)
                if source is not None and source not in done:
                    break
                ready = free[rank]
                if source is not None:
                    ready = max(ready, done[source] + (hop if rank_of[source] != rank else 0.0))
                done[op] = ready + (forward if op[0] == "forward" else backward)
                free[rank] = done[op] + gap
                cursor[rank] += 1
                remaining -= 1
                progress = True
        if not progress:
            raise ValueError("the orders deadlock")
    return max(done.values())


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0
