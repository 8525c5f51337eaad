"""The non-looped schedules: one stage per rank. Pure."""

from __future__ import annotations

from lightning_bfpp.plan.actions import B, Schedule
from lightning_bfpp.plan.schedules import register
from lightning_bfpp.plan.schedules.base import ScheduleKind, check_sizes, sweeps
from lightning_bfpp.plan.schedules.depth_first import interleaved_order


def gpipe(pipeline_parallel_size: int, stages_per_rank: int, num_microbatches: int) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward, one stage per rank.

    On a looped placement this order is breadth-first, so ``gpipe`` is kept to its own, non-looped case.
    """
    p, v, m = check_sizes(pipeline_parallel_size, stages_per_rank, num_microbatches)
    GPipe().check_stages_per_rank(v)
    return sweeps(p, 1, m, B)


def one_f_one_b(pipeline_parallel_size: int, stages_per_rank: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush, DAPPLE): ``p − r − 1`` warm-up forwards, then alternate one forward and one backward.

    Same bubble as GPipe, but a rank holds at most ``p − r`` micro-batches' activations instead of ``m``.
    """
    p, v, m = check_sizes(pipeline_parallel_size, stages_per_rank, num_microbatches)
    OneFOneB().check_stages_per_rank(v)
    return interleaved_order(p, 1, m, group_size=m, one_chunk=True)


class GPipe(ScheduleKind):
    name = "gpipe"
    summary = "every forward, then every backward; one stage per rank"
    stages_per_rank_choices = (1,)
    stages_per_rank_rule = "is a non-looped schedule: it needs stages_per_rank=1"

    def generate(self, p: int, v: int, m: int, *, microbatch_group_size: int | None = None) -> Schedule:
        return gpipe(p, v, m)


class OneFOneB(ScheduleKind):
    name = "1f1b"
    summary = "warm-up forwards, then one forward and one backward in turn; one stage per rank"
    stages_per_rank_choices = (1,)
    stages_per_rank_rule = "is a non-looped schedule: it needs stages_per_rank=1"

    def generate(self, p: int, v: int, m: int, *, microbatch_group_size: int | None = None) -> Schedule:
        return one_f_one_b(p, v, m)


register(GPipe())
register(OneFOneB())
