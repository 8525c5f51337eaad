"""Megatron-LM's interleaved 1F1B ("virtual pipeline"), the paper's depth-first baseline. Pure."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from lightning_bfpp.plan.actions import Action, B, F, Schedule
from lightning_bfpp.plan.placement import LOOP
from lightning_bfpp.plan.schedules import register
from lightning_bfpp.plan.schedules.base import ScheduleKind, check_sizes
from lightning_bfpp.plan.simulate import PlannerModel, register_planner_model

if TYPE_CHECKING:
    from lightning_bfpp.plan.cluster import Cluster
    from lightning_bfpp.plan.costs import ModelProfile
    from lightning_bfpp.plan.plan import Plan
    from lightning_bfpp.plan.space import SearchSpace


def depth_first(
    pipeline_parallel_size: int,
    stages_per_rank: int,
    num_microbatches: int,
    microbatch_group_size: int | None = None,
) -> Schedule:
    """Interleaved 1F1B in Megatron-LM's order (its "virtual pipeline"), the paper's depth-first baseline.

    Micro-batches go in groups of ``N = microbatch_group_size`` (Megatron's
    ``microbatch_group_size_per_vp_stage``): a rank runs a group through one local stage, then the same group
    through its next local stage, and so on; after ``2(p − r − 1) + (v − 1)·N`` warm-up forwards it alternates
    one forward and one backward. ``N = p`` (the default) is depth-first; larger ``N`` holds more
    micro-batches per stage visit, and ``N = m`` visits each stage once per direction during warm-up and
    cool-down, as breadth-first does (Llama 3 tunes ``N`` between the two). Requires ``p ≤ N ≤ m``.
    """
    p, v, m = check_sizes(pipeline_parallel_size, stages_per_rank, num_microbatches)
    n = p if microbatch_group_size is None else microbatch_group_size
    if m < p:
        raise ValueError(
            f"depth_first needs num_microbatches ≥ pipeline_parallel_size ({m} < {p}); raise num_microbatches"
            " or use schedule='breadth_first'."
        )
    if not p <= n <= m:
        raise ValueError(
            f"microbatch_group_size must lie in [pipeline_parallel_size, num_microbatches] = [{p}, {m}], got {n}."
        )
    if m % n and m % n < p:
        raise ValueError(
            f"microbatch_group_size={n} leaves a last group of {m % n} micro-batches, fewer than"
            f" pipeline_parallel_size={p}, which stalls the pipeline; choose a group size that divides"
            f" num_microbatches={m} or leaves at least {p}."
        )
    return interleaved_order(p, v, m, group_size=n)


def interleaved_order(p: int, v: int, m: int, *, group_size: int, one_chunk: bool = False) -> Schedule:
    """Megatron's 1F1B order over groups of ``group_size`` micro-batches, looping placement; ``one_chunk``: the
    non-interleaved warm-up of ``p − r − 1`` forwards (1F1B itself)."""
    schedule: Schedule = {}
    for rank in range(p):
        stages = LOOP.stages_of(rank, p, v)
        groups = [range(start, min(start + group_size, m)) for start in range(0, m, group_size)]
        forwards = [Action(stages[k], F, mb) for g in groups for k in range(v) for mb in g]
        backwards = [Action(stages[k], B, mb) for g in groups for k in reversed(range(v)) for mb in g]
        # Megatron's warm-up counts: non-interleaved 1F1B, and interleaved with groups of N
        warmup = min(m, p - rank - 1) if one_chunk else min(v * m, 2 * (p - rank - 1) + (v - 1) * group_size)
        actions = forwards[:warmup]
        for i in range(v * m - warmup):
            actions += [forwards[warmup + i], backwards[i]]
        actions += backwards[v * m - warmup :]
        schedule[rank] = actions
    return schedule


def group_sizes(p: int, m: int) -> list[int]:
    """The group sizes a search tries: ``p``, ``2p``, ``4p`` and ``m``, where valid."""
    return sorted({n for n in (p, 2 * p, 4 * p, m) if p <= n <= m and not (m % n and m % n < p)})


class DepthFirst(ScheduleKind):
    name = "depth_first"
    summary = "Megatron's interleaved 1F1B (groups of `microbatch_group_size` micro-batches per stage visit)"
    options = ("microbatch_group_size",)

    def generate(self, p: int, v: int, m: int, *, microbatch_group_size: int | None = None) -> Schedule:
        return depth_first(p, v, m, microbatch_group_size)


class DepthFirstModel(PlannerModel):
    """The activation pipelines' cost model; a search also varies the group size ``N``."""

    def search_fields(
        self, kind: ScheduleKind, p: int, dp: int, m: int, space: SearchSpace
    ) -> Iterator[dict[str, Any]]:
        sizes = [p] if space.group_sizes == "pipeline" else group_sizes(p, m)
        for fields in super().search_fields(kind, p, dp, m, space):
            for n in sizes or [None]:
                yield {**fields, "microbatch_group_size": n}

    def infeasible(self, plan: Plan, profile: ModelProfile, cluster: Cluster, space: SearchSpace) -> str | None:
        if plan.num_microbatches < plan.pipeline_parallel_size:
            return "depth_first needs m ≥ p"
        return super().infeasible(plan, profile, cluster, space)


register(DepthFirst())
register_planner_model(DepthFirst.name, DepthFirstModel())
