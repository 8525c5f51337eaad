"""Enumerate plans for a model, a machine and a global batch; simulate and rank them. Pure.

For every pipeline size ``p`` dividing the device count (``dp = devices / p``), every split of the
per-replica batch into ``m`` micro-batches, every registered schedule (:mod:`lightning_bfpp.plan.schedules`),
what its planner model varies (:class:`~lightning_bfpp.plan.simulate.PlannerModel`: stages per rank ``v`` with
``p·v`` at most the number of layers; depth-first's group sizes ``N``; a kind's plan options), every sharding and
mesh order, the plan is either marked infeasible with the reason (the model's, or the machine's), or simulated
with the model's cost model. Feasible plans are ranked by predicted step time: the
global batch is fixed, so that is throughput; a plan over the cluster's memory is infeasible, so with a memory
budget the first is the fastest that fits.

Besides the runtime's shardings, the default space holds ``sharding="hybrid_shard"`` (shard inside a node,
replicate across nodes; left out where a plan's data-parallel group lies inside one node, where it is
``full_shard``, unless ``full_shard`` is not a candidate). A schedule that fixes sharding itself (weight passing:
``PlannerModel.sharded`` false) gets one candidate per layout, whatever the space's shardings and mesh orders.
``hybrid_shard`` is infeasible where the strategy refuses it: data-parallel ranks spread unevenly over nodes, or
one per node. A kind's plan options other than its defaults (weight passing's node stagger, which the runtime
does not implement) are searched only where ``SearchSpace.options`` asks for them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from lightning_bfpp.plan.cluster import Cluster, global_rank, tensor_groups_as_devices
from lightning_bfpp.plan.config import SHARDINGS, config_rules
from lightning_bfpp.plan.costs import ModelProfile
from lightning_bfpp.plan.plan import HYBRID_SHARD, Plan
from lightning_bfpp.plan.schedules import get_schedule, schedule_names
from lightning_bfpp.plan.simulate import Prediction, planner_model, simulate
from lightning_bfpp.plan.space import SearchSpace

# what the planner models: every sharding, and every registered schedule (``PLAN_SCHEDULES``, read from the
# registry when asked for, not when this module is imported)
PLAN_SHARDINGS: tuple[str, ...] = SHARDINGS


def __getattr__(name: str) -> tuple[str, ...]:
    if name == "PLAN_SCHEDULES":
        return schedule_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class Candidate:
    """A plan the search considered: its prediction, or why it cannot run (a prediction over memory has both)."""

    config: Plan
    prediction: Prediction | None = None
    infeasible: str | None = None

    @property
    def plan(self) -> Plan:
        return self.config


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def configurations(
    profile: ModelProfile, cluster: Cluster, global_batch: int, space: SearchSpace
) -> Iterator[tuple[Plan, str | None]]:
    """Every plan of ``space``, with the reason it cannot run (or None)."""
    for t in space.tensor_parallel_sizes:
        if cluster.devices_per_node % t or cluster.num_devices % t:
            continue
        yield from _configurations(profile, tensor_groups_as_devices(cluster, t), global_batch, space, t)


def _configurations(
    profile: ModelProfile, cluster: Cluster, global_batch: int, space: SearchSpace, t: int
) -> Iterator[tuple[Plan, str | None]]:
    """The plans for tensor groups of ``t`` ranks, each one device of ``cluster``."""
    devices = cluster.num_devices
    mesh_orders = space.mesh_orders if cluster.num_nodes > 1 else ("data_pipeline",)
    kinds = [get_schedule(name) for name in space.schedules]
    for p in space.pipeline_sizes or _divisors(devices):
        if devices % p:
            continue
        dp = devices // p
        if global_batch % dp:
            continue
        per_replica = global_batch // dp
        ms = space.num_microbatches or [d for d in _divisors(per_replica) if d & (d - 1) == 0]
        for m in ms:
            if per_replica % m:
                continue
            size = per_replica // m
            for kind in kinds:
                if t > 1 and not config_rules(kind.name).tensor_parallel:
                    continue
                model = planner_model(kind.name)
                for fields in model.search_fields(kind, p, dp, m, space):
                    if not model.sharded:
                        plan = Plan(
                            kind.name, p, dp, num_microbatches=m, microbatch_size=size,
                            prefetch_stages=space.prefetch_stages, **fields,
                        )  # fmt: skip
                        yield plan, model.infeasible(plan, profile, cluster, space)
                        continue
                    for sharding in space.shardings:
                        if dp == 1 and sharding != space.shardings[0]:
                            continue  # without data parallelism every sharding runs the same: the first asked
                        # without a pipeline or without data parallelism both orders give the same ranks
                        for order in mesh_orders if p > 1 and dp > 1 else mesh_orders[:1]:
                            plan = Plan(
                                kind.name, p, dp, num_microbatches=m, microbatch_size=size, sharding=sharding,
                                mesh_order=order, tensor_parallel_size=t, prefetch_stages=space.prefetch_stages,
                                **fields,
                            )  # fmt: skip
                            reason = model.infeasible(plan, profile, cluster, space)
                            if sharding == HYBRID_SHARD:
                                hybrid = _hybrid_reason(cluster, p, dp, order)
                                if hybrid == _IN_ONE_NODE and "full_shard" in space.shardings:
                                    continue  # the data-parallel groups lie in one node: that is full_shard
                                reason = reason or hybrid
                            yield plan, reason


_IN_ONE_NODE = "hybrid_shard: each data-parallel group lies in one node (nothing to replicate)"


def _hybrid_reason(cluster: Cluster, p: int, dp: int, mesh_order: str) -> str | None:
    """Why ``hybrid_shard`` cannot split the data-parallel groups (as the strategy checks), or None."""
    per_node: set[int] = set()  # how many ranks of a data-parallel group share a node, over groups and nodes
    for r in range(p):
        nodes = Counter(global_rank(r, d, p, dp, mesh_order) // cluster.devices_per_node for d in range(dp))
        per_node |= set(nodes.values())
    if len(per_node) > 1:
        return "hybrid_shard: data-parallel ranks spread unevenly over nodes"
    (shard,) = per_node
    if shard == dp:
        return _IN_ONE_NODE
    if shard == 1:
        return "hybrid_shard: one rank of each data-parallel group per node (nothing to shard: no_shard)"
    return None


def search(
    profile: ModelProfile, cluster: Cluster, global_batch: int, space: SearchSpace | None = None
) -> list[Candidate]:
    """All candidates, feasible ones first, fastest first; infeasible ones carry the reason."""
    space = space or SearchSpace()
    candidates = []
    for config, reason in configurations(profile, cluster, global_batch, space):
        if reason is not None:
            candidates.append(Candidate(config, infeasible=reason))
            continue
        try:
            prediction = simulate(config, profile, cluster)
        except ValueError as error:
            candidates.append(Candidate(config, infeasible=str(error)))
            continue
        if prediction.peak_memory > cluster.memory_bytes:
            reason = f"memory: {format_size(prediction.peak_memory)} > {format_size(cluster.memory_bytes)}"
            candidates.append(Candidate(config, prediction, infeasible=reason))
        else:
            candidates.append(Candidate(config, prediction))
    return sorted(
        candidates,
        key=lambda c: (c.infeasible is not None, c.prediction.step_time if c.prediction else float("inf")),
    )


def format_size(nbytes: float) -> str:
    """``5.9 GiB``, ``12.0 MiB`` below a GiB, ``4.0 KiB`` below a MiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


def search_per_replica_batch(
    profile: ModelProfile, cluster: Cluster, per_replica_batch: int, space: SearchSpace | None = None
) -> list[Candidate]:
    """As :func:`search`, but with each replica's batch fixed (Lightning's ``batch_size`` is per process),
    so the global batch grows with the data-parallel size; ranked by throughput (samples per second)."""
    space = space or SearchSpace()
    candidates: list[Candidate] = []
    for t in space.tensor_parallel_sizes:
        if cluster.num_devices % t:
            continue
        groups = cluster.num_devices // t  # the ranks of a tensor group load the same batch: a replica's
        for p in space.pipeline_sizes or _divisors(groups):
            if groups % p:
                continue
            dp = groups // p
            sub = SearchSpace(**{**space.__dict__, "pipeline_sizes": (p,), "tensor_parallel_sizes": (t,)})
            candidates += search(profile, cluster, per_replica_batch * dp, sub)
    return sorted(
        candidates,
        key=lambda c: (c.infeasible is not None, -c.prediction.throughput if c.prediction else 0.0),
    )


def format_table(candidates: Sequence[Candidate], top: int = 20, infeasible: int = 5) -> str:
    """A markdown table of the ``top`` feasible candidates and the first ``infeasible`` others; a column ``t``
    (tensor group size) appears when any candidate splits its layers over a tensor group."""
    tensor = any(c.config.tensor_parallel_size > 1 for c in candidates)
    header = (
        f"| # | schedule | p | dp |{' t |' if tensor else ''} v | m × mbs | N | sharding | mesh | step (s) |"
        " samples/s | bubble | peak memory (GiB) | comm/device (GiB) | |"
    )
    lines = [header, "|" + "---|" * (15 + tensor)]
    feasible = [c for c in candidates if c.infeasible is None][:top]
    rejected = [c for c in candidates if c.infeasible is not None][:infeasible]
    for i, c in enumerate([*feasible, *rejected], start=1):
        cfg, pred = c.config, c.prediction
        fixed = not planner_model(cfg.schedule).sharded  # weight passing: chunk owners instead of sharding
        options = cfg.options.describe() if cfg.options is not None else ""
        cells = [
            str(i) if c.infeasible is None else "–",
            cfg.schedule + (f" ({options})" if options else ""),
            str(cfg.pipeline_parallel_size),
            str(cfg.data_parallel_size),
            *([str(cfg.tensor_parallel_size)] if tensor else []),
            str(cfg.stages_per_rank),
            f"{cfg.num_microbatches} × {cfg.microbatch_size}",
            str(cfg.microbatch_group_size or ""),
            "chunk owners" if fixed else cfg.sharding,
            "" if fixed else cfg.mesh_order,
            f"{pred.step_time:.3f}" if pred else "",
            f"{pred.throughput:,.1f}" if pred else "",
            f"{pred.bubble_fraction:.1%}" if pred else "",
            f"{pred.peak_memory / 2**30:.1f}" if pred else "",
            f"{pred.comm_bytes / 2**30:.2f}" if pred else "",
            f"infeasible: {c.infeasible}" if c.infeasible else "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
