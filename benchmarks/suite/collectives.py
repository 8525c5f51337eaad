"""bfpp's data-parallel communication of one step, alone: the ``collectives`` kind of job.

Each rank issues the weight gathers and gradient reductions its lowered breadth-first schedule holds
(``lightning_bfpp.plan.Plan.lowered``: an all-gather per ``UNSHARD``, a reduce-scatter per ``REDUCE_GRAD``), in
the schedule's order, with a stage's sizes (its layers' fp32 weights, sharded over the data-parallel group)
and on the same data-parallel groups of the same (data × pipeline) mesh as the pipelined job, but with no
compute, no pipeline transfers and no FSDP2 around them (no copy into or out of the flat buffers, which
FSDP2 adds). ``job.schedule`` says how: ``"waited"`` (each collective synchronous, one after the other) or
``"async"`` (all issued at once, then waited for). The record holds the step marks (host CPU time included)
and, in waited mode, each timed collective's duration by kind.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from benchmarks.suite.instrument import StepClock
from benchmarks.suite.spec import Job
from lightning_bfpp.engine.sharding import DATA_PARALLEL, PIPELINE_PARALLEL
from lightning_bfpp.plan import Plan
from lightning_bfpp.plan.actions import REDUCE_GRAD, UNSHARD

MODES = ("waited", "async")


def step_plan(job: Job, pipeline_rank: int) -> list[str]:
    """This pipeline rank's collectives of one step, in order: ``"gather"`` or ``"reduce"``."""
    plan = Plan(
        "breadth_first", job.p, job.dp, job.v, job.m, sharding=job.sharding, prefetch_stages=job.prefetch_stages
    )
    lowered = plan.lowered()
    kinds = {UNSHARD: "gather", REDUCE_GRAD: "reduce"}
    return [kinds[a.kind] for a in lowered[pipeline_rank] if a.kind in kinds]


def run(job: Job, rank: int) -> dict[str, Any]:
    """Issue ``step_plan`` every step as ``job.schedule`` says; return this rank's marks and collective times."""
    if job.schedule not in MODES:
        raise ValueError(f"collectives: schedule must be one of {MODES}, got {job.schedule!r}")
    dist.init_process_group("gloo", rank=rank, world_size=job.processes)
    mesh = init_device_mesh("cpu", (job.dp, job.p), mesh_dim_names=(DATA_PARALLEL, PIPELINE_PARALLEL))
    group = mesh[DATA_PARALLEL].get_group()
    plan = step_plan(job, mesh[PIPELINE_PARALLEL].get_local_rank())
    # every stage holds layers / (p·v) layers (equal weights balance to equal counts); FSDP2 shards each on dim 0
    stage_numel = job.emulated.layers // (job.p * job.v) * job.emulated.param_numel
    shard_numel = math.ceil(stage_numel / job.dp)
    full, shard = torch.zeros(shard_numel * job.dp), torch.zeros(shard_numel)
    gradient, reduced = torch.ones(shard_numel * job.dp), torch.zeros(shard_numel)

    def issue(kind: str, async_op: bool) -> Any:
        if kind == "gather":
            return dist.all_gather_into_tensor(full, shard, group=group, async_op=async_op)
        return dist.reduce_scatter_tensor(reduced, gradient, group=group, async_op=async_op)

    clock = StepClock(job.warmup)
    durations: dict[str, list[float]] = {"gather": [], "reduce": []}
    for step in range(job.warmup + job.steps):
        clock.mark()
        if job.schedule == "async":
            for work in [issue(kind, async_op=True) for kind in plan]:
                work.wait()
            continue
        for kind in plan:
            start = time.perf_counter()
            issue(kind, async_op=False)
            if step >= job.warmup:
                durations[kind].append(time.perf_counter() - start)
    clock.mark()
    dist.barrier()
    dist.destroy_process_group()
    return {**clock.result(), "collective_s": durations, "plan": plan}
