"""Enumerate configurations for a model, a machine and a global batch; simulate and rank them. Pure.

For every pipeline size ``p`` dividing the device count (``dp = devices / p``), every split of the
per-replica batch into ``m`` micro-batches, every ``v`` with ``p·v`` at most the number of layers, every
schedule (and, for depth-first, every valid group size ``N``), sharding and mesh order, the configuration
is either marked infeasible with the reason, or simulated (:mod:`lightning_bfpp.plan.simulate`). Feasible
configurations are ranked by predicted step time: the global batch is fixed, so that is throughput.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from lightning_bfpp.config import SHARDINGS
from lightning_bfpp.plan.cluster import MESH_ORDERS, Cluster
from lightning_bfpp.plan.costs import ModelProfile
from lightning_bfpp.plan.simulate import PlanConfig, Prediction, simulate
from lightning_bfpp.schedule import SCHEDULES


@dataclass(frozen=True)
class SearchSpace:
    schedules: tuple[str, ...] = SCHEDULES
    shardings: tuple[str, ...] = SHARDINGS
    mesh_orders: tuple[str, ...] = MESH_ORDERS
    pipeline_sizes: tuple[int, ...] | None = None  # None: every divisor of the device count
    stages_per_rank: tuple[int, ...] = (1, 2, 4, 8)
    num_microbatches: tuple[int, ...] | None = None  # None: powers of two dividing the per-replica batch
    # depth-first group sizes: "all" valid N in {p, 2p, 4p, m}, or "pipeline" (N = p, Megatron's default)
    group_sizes: str = "all"
    max_actions_per_rank: int = 4096  # keeps each simulation fast; larger configurations are skipped


@dataclass
class Candidate:
    config: PlanConfig
    prediction: Prediction | None = None
    infeasible: str | None = None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _group_sizes(p: int, m: int) -> list[int | None]:
    sizes = {n for n in (p, 2 * p, 4 * p, m) if p <= n <= m and not (m % n and m % n < p)}
    return sorted(sizes)  # type: ignore[return-value]


def configurations(
    profile: ModelProfile, cluster: Cluster, global_batch: int, space: SearchSpace
) -> Iterator[tuple[PlanConfig, str | None]]:
    """Every configuration of ``space``, with the reason it cannot run (or None)."""
    devices = cluster.num_devices
    mesh_orders = space.mesh_orders if cluster.num_nodes > 1 else ("data_pipeline",)
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
            for v in space.stages_per_rank:
                for schedule in space.schedules:
                    if schedule in ("gpipe", "1f1b") and v != 1:
                        continue
                    groups: list[int | None] = [None]
                    if schedule == "depth_first":
                        groups = [p] if space.group_sizes == "pipeline" else _group_sizes(p, m)
                    for group in groups:
                        for sharding in space.shardings:
                            if dp == 1 and sharding != "full_shard":
                                continue  # without data parallelism the three coincide
                            for order in mesh_orders:
                                config = PlanConfig(schedule, p, dp, v, m, per_replica // m, sharding, group, order)
                                yield config, _reason(config, profile, space)


def _reason(config: PlanConfig, profile: ModelProfile, space: SearchSpace) -> str | None:
    if config.num_stages > profile.num_layers:
        return f"{config.num_stages} stages > {profile.num_layers} layers"
    if config.schedule == "depth_first" and config.num_microbatches < config.pipeline_parallel_size:
        return "depth_first needs m ≥ p"
    if 2 * config.stages_per_rank * config.num_microbatches > space.max_actions_per_rank:
        return "too many actions to simulate"
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
            reason = f"memory: {prediction.peak_memory / 2**30:.1f} GiB > {cluster.memory_bytes / 2**30:.1f} GiB"
            candidates.append(Candidate(config, prediction, infeasible=reason))
        else:
            candidates.append(Candidate(config, prediction))
    return sorted(
        candidates,
        key=lambda c: (c.infeasible is not None, c.prediction.step_time if c.prediction else float("inf")),
    )


def search_per_replica_batch(
    profile: ModelProfile, cluster: Cluster, per_replica_batch: int, space: SearchSpace | None = None
) -> list[Candidate]:
    """As :func:`search`, but with each replica's batch fixed (Lightning's ``batch_size`` is per process),
    so the global batch grows with the data-parallel size; ranked by throughput (samples per second)."""
    space = space or SearchSpace()
    candidates: list[Candidate] = []
    for p in space.pipeline_sizes or _divisors(cluster.num_devices):
        if cluster.num_devices % p:
            continue
        dp = cluster.num_devices // p
        sub = SearchSpace(**{**space.__dict__, "pipeline_sizes": (p,)})
        candidates += search(profile, cluster, per_replica_batch * dp, sub)
    return sorted(
        candidates,
        key=lambda c: (c.infeasible is not None, -c.prediction.throughput if c.prediction else 0.0),
    )


def format_table(candidates: Sequence[Candidate], top: int = 20, infeasible: int = 5) -> str:
    header = (
        "| # | schedule | p | dp | v | m × mbs | N | sharding | mesh | step (s) | samples/s | bubble |"
        " peak memory (GiB) | comm/device (GiB) | |"
    )
    lines = [header, "|" + "---|" * 15]
    feasible = [c for c in candidates if c.infeasible is None][:top]
    rejected = [c for c in candidates if c.infeasible is not None][:infeasible]
    for i, c in enumerate([*feasible, *rejected], start=1):
        cfg, pred = c.config, c.prediction
        cells = [
            str(i) if c.infeasible is None else "–",
            cfg.schedule,
            str(cfg.pipeline_parallel_size),
            str(cfg.data_parallel_size),
            str(cfg.stages_per_rank),
            f"{cfg.num_microbatches} × {cfg.microbatch_size}",
            str(cfg.microbatch_group_size or ""),
            cfg.sharding,
            cfg.mesh_order,
            f"{pred.step_time:.3f}" if pred else "",
            f"{pred.throughput:,.1f}" if pred else "",
            f"{pred.bubble_fraction:.1%}" if pred else "",
            f"{pred.peak_memory / 2**30:.1f}" if pred else "",
            f"{pred.comm_bytes / 2**30:.2f}" if pred else "",
            f"infeasible: {c.infeasible}" if c.infeasible else "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
