"""Zero bubble (Qi et al., ICLR 2024) in torch's two orders: interleaved ZB-H1 on the looping placement, and
ZB-V on the V placement. Pure.

Both split each backward into the input gradient ``I``, which the previous stage waits for, and the weight
gradient ``W``, which nobody waits for, and place the ``W``'s where a rank would otherwise idle. They are
written here as torch 2.13 writes them (``ScheduleInterleavedZeroBubble._calculate_single_rank_operations`` with
``_get_1f1b_rank_ops``, and ``ScheduleZBVZeroBubble._calculate_single_rank_operations``), action for action,
without torch's idle slots (``None``), which its runtime skips and which an action list here does not hold;
``tests/unit/test_schedule_zero_bubble.py`` compares both with torch's own lists. They are generated here
rather than taken from torch's classes because those build only over live ``PipelineStage`` objects and
lower sharding with their own three-stage window; here they are data, validated, lowered, simulated and run
like every other kind.

Under sharded data parallelism both switch stages at nearly every action, so a stage released after each visit
would be gathered again at the next: their lowering keeps each local stage gathered from its first visit to its
last (``keep``: the whole list), so ``full_shard`` gathers each stage once per step (``v`` gathers per rank, as
breadth-first for ``v ≤ 2``; ``2v − 2`` above) and holds all ``v`` of a rank's stages' weights from its first
backward on (breadth-first: at most ``prefetch_stages + 1``); each stage's ``REDUCE_GRAD`` follows its last
``W``, and its ``RESHARD`` the reduction. ``shard_grad_op`` and ``no_shard`` gather each stage once, as always.
"""

from __future__ import annotations

from collections import defaultdict

from lightning_bfpp.plan.actions import Action, F, I, Kind, Schedule, W
from lightning_bfpp.plan.placement import V
from lightning_bfpp.plan.schedules import register
from lightning_bfpp.plan.schedules.base import PlanView, ScheduleKind, check_sizes


def interleaved_zero_bubble(pipeline_parallel_size: int, stages_per_rank: int, num_microbatches: int) -> Schedule:
    """torch's ``ScheduleInterleavedZeroBubble`` (ZB-H1, "ZB1P"): per rank, warm-up forwards, then each step one
    forward and one input gradient, and from the ``r``-th step on one weight gradient of the oldest input
    gradient; then the remaining input and weight gradients.

    Micro-batches go in rounds of ``m / max(1, m // p)`` through each local stage (torch's
    ``microbatches_per_round``); rank ``r`` warms up with ``(v − 1)·round + (p − 1 − r)`` forwards. ``m`` must be a
    multiple of the number of rounds, ``max(1, m // p)``, as torch requires.
    """
    p, v, m = check_sizes(pipeline_parallel_size, stages_per_rank, num_microbatches)
    rounds = max(1, m // p)
    if m % rounds:
        raise ValueError(
            f"interleaved_zb runs micro-batches in rounds of m / max(1, m // p): num_microbatches={m} is not a"
            f" multiple of {rounds} rounds for pipeline_parallel_size={p}; choose a multiple of {rounds}."
        )
    per_round = m // rounds
    return {rank: _zb1p_rank(rank, p, v, m, per_round) for rank in range(p)}


def _zb1p_rank(rank: int, p: int, v: int, m: int, per_round: int) -> list[Action]:
    """One rank's list of :func:`interleaved_zero_bubble` (torch's ``_get_1f1b_rank_ops`` with zero bubble)."""
    warmup = min((v - 1) * per_round + (p - 1 - rank), m * v)
    steady = m * v - warmup

    def forward_stage(op: int) -> int:
        return ((op // per_round) % v) * p + rank

    def backward_stage(op: int) -> int:
        return (v - 1 - ((op - warmup) // per_round) % v) * p + rank

    counters: dict[tuple[int, Kind], int] = defaultdict(int)  # each stage's next micro-batch, per kind

    def next_action(stage: int, kind: Kind) -> Action:
        mb = counters[(stage, kind)]
        counters[(stage, kind)] += 1
        return Action(stage, kind, mb)

    actions: list[Action] = []
    backward_ops: list[int] = []
    weights_done = 0
    for op in range(warmup + steady + warmup):
        if op < warmup + steady:
            actions.append(next_action(forward_stage(op), F))
        if op < warmup:
            continue
        actions.append(next_action(backward_stage(op), I))
        backward_ops.append(op)
        if op - warmup >= rank:  # torch's num_1f1b_microbatches: rank r delays its first W by r steps
            actions.append(next_action(backward_stage(backward_ops[weights_done]), W))
            weights_done += 1
    while weights_done < len(backward_ops):
        actions.append(next_action(backward_stage(backward_ops[weights_done]), W))
        weights_done += 1
    return actions


def zbv_zero_bubble(pipeline_parallel_size: int, stages_per_rank: int, num_microbatches: int) -> Schedule:
    """torch's ``ScheduleZBVZeroBubble`` (ZB-V): two stages per rank in a V, rank ``r`` holding stage ``r`` (chunk
    0) and ``2p − 1 − r`` (chunk 1).

    Rank ``r`` warms up with ``2(p − r) − 1`` forwards of chunk 0, then ``r`` pairs of chunk 1 and chunk 0
    forwards, then ``p − r`` of chunk 1's forward, input and weight gradient; in the steady state it alternates
    chunk 0's forward, input and weight gradient with chunk 1's; the cool-down runs the remaining input
    gradients, the weight gradients after them. torch plans ``max(2p − 1, m)`` micro-batches and drops the
    actions of those beyond ``m``, as here, so any ``m`` runs (``m < 2p − 1`` with bubbles).
    """
    p, v, m = check_sizes(pipeline_parallel_size, stages_per_rank, num_microbatches)
    ZeroBubbleV().check_stages_per_rank(v)
    planned = max(2 * p - 1, m)
    schedule: Schedule = {}
    for rank in range(p):
        chunk0, chunk1 = rank, 2 * p - 1 - rank
        actions: list[Action] = []
        f0 = f1 = b0 = b1 = 0
        for _ in range(2 * (p - rank) - 1):
            actions.append(Action(chunk0, F, f0))
            f0 += 1
        for _ in range(rank):
            actions += [Action(chunk1, F, f1), Action(chunk0, F, f0)]
            f1 += 1
            f0 += 1
        for _ in range(p - rank):
            actions += [Action(chunk1, F, f1), Action(chunk1, I, b1), Action(chunk1, W, b1)]
            f1 += 1
            b1 += 1
        while f1 < f0 or f0 < planned:
            if f0 < planned:
                actions.append(Action(chunk0, F, f0))
                f0 += 1
            actions += [Action(chunk0, I, b0), Action(chunk0, W, b0)]
            b0 += 1
            actions += [Action(chunk1, F, f1), Action(chunk1, I, b1), Action(chunk1, W, b1)]
            f1 += 1
            b1 += 1
        w0, w1 = b0, b1
        for _ in range(rank):
            actions += [Action(chunk0, I, b0), Action(chunk1, I, b1)]
            b0 += 1
            b1 += 1
        for _ in range(p - rank):
            actions += [Action(chunk0, I, b0), Action(chunk0, W, w0)]
            b0 += 1
            w0 += 1
        actions += [Action(chunk1, W, mb) for mb in range(w1, b1)]
        actions += [Action(chunk0, W, mb) for mb in range(w0, b0)]
        schedule[rank] = [a for a in actions if a.microbatch is not None and a.microbatch < m]
    return schedule


class _ZeroBubble(ScheduleKind):
    splits_backward = True

    def keep(self, plan: PlanView) -> int | None:
        # every visit of the step: a stage stays gathered from its first action to its last (module docstring)
        return 3 * plan.stages_per_rank * plan.num_microbatches


class InterleavedZeroBubble(_ZeroBubble):
    name = "interleaved_zb"
    summary = (
        "torch's interleaved zero bubble (ZB-H1): one forward and one input gradient in turn, weight gradients"
        " in the waits"
    )

    def generate(self, p: int, v: int, m: int, *, microbatch_group_size: int | None = None) -> Schedule:
        return interleaved_zero_bubble(p, v, m)


class ZeroBubbleV(_ZeroBubble):
    name = "zbv"
    summary = "torch's ZB-V: zero bubble with two stages per rank in a V (first and last stage on rank 0)"
    placement = V
    stages_per_rank_choices = (2,)
    stages_per_rank_rule = "places exactly two stages per rank, in a V"
    fallback = None  # any micro-batch count runs

    def generate(self, p: int, v: int, m: int, *, microbatch_group_size: int | None = None) -> Schedule:
        return zbv_zero_bubble(p, v, m)


register(InterleavedZeroBubble())
register(ZeroBubbleV())
