"""The machines a plan runs on: devices, nodes, memory, links; and what collectives cost on them. Pure.

Collectives use the ring model: an all-gather or reduce-scatter of ``B`` bytes (the full tensor) over
``n`` ranks moves ``(n − 1)/n · B`` bytes through each rank's slowest link in ``n − 1`` steps; an
all-reduce twice that. A group whose ranks all share a node uses the intra-node bandwidth, one that spans
nodes the inter-node bandwidth. Which groups stay inside a node depends on the mesh order: with
``"data_pipeline"`` (the default) the ranks of one pipeline are consecutive, so pipelines stay inside a
node and data-parallel groups cross nodes; ``"pipeline_data"`` keeps data-parallel groups inside a node.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from lightning_bfpp.config import MESH_ORDERS


@dataclass(frozen=True)
class Cluster:
    num_devices: int
    devices_per_node: int
    memory_bytes: int
    intra_node_bandwidth: float  # bytes/s per device, for collectives (ring bus bandwidth)
    inter_node_bandwidth: float  # bytes/s per device, for collectives
    latency_s: float = 10e-6  # per message, and per ring step of a collective
    # point-to-point bandwidth relative to the collective bandwidth of the same link (1 on NCCL-like fabrics)
    p2p_bandwidth_ratio: float = 1.0
    # fixed software cost per collective call (tiny with NCCL, milliseconds with gloo on CPU)
    collective_overhead_s: float = 0.0
    # fixed host cost per executed schedule action and per step (Python runtime, kernel launches);
    # negligible at scale, measurable on small CPU runs (see lightning_bfpp.plan.calibrate)
    action_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    # whether gradient reductions overlap later compute: BFPPStrategy's overlap_reductions (on by default on
    # CUDA); torch's own REDUCE_GRAD, used on gloo by default, makes every later compute wait for them
    overlap_reductions: bool = False

    @property
    def num_nodes(self) -> int:
        return -(-self.num_devices // self.devices_per_node)

    def to_json(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @staticmethod
    def from_json(path: Path) -> Cluster:
        return Cluster(**json.loads(Path(path).read_text()))


def global_rank(pipeline_rank: int, data_rank: int, p: int, dp: int, mesh_order: str) -> int:
    if mesh_order == "data_pipeline":
        return data_rank * p + pipeline_rank
    if mesh_order == "pipeline_data":
        return pipeline_rank * dp + data_rank
    raise ValueError(f"unknown mesh order {mesh_order!r}; choose one of {', '.join(MESH_ORDERS)}")


def _bandwidth(cluster: Cluster, ranks: list[int]) -> float:
    nodes = {r // cluster.devices_per_node for r in ranks}
    return cluster.intra_node_bandwidth if len(nodes) == 1 else cluster.inter_node_bandwidth


@dataclass(frozen=True)
class Links:
    """Costs of one pipeline replica's transfers under a layout (the replicas are symmetric)."""

    p2p_bandwidth: tuple[float, ...]  # from pipeline rank r to r + 1 (mod p)
    data_parallel_bandwidth: tuple[float, ...]  # per pipeline rank
    dp: int
    latency_s: float
    collective_overhead_s: float = 0.0

    def p2p_s(self, src_rank: int, nbytes: int) -> float:
        return self.latency_s + nbytes / self.p2p_bandwidth[src_rank]

    def all_gather_s(self, rank: int, nbytes: int) -> float:
        if self.dp == 1:
            return 0.0
        n = self.dp
        ring = (n - 1) * self.latency_s + (n - 1) / n * nbytes / self.data_parallel_bandwidth[rank]
        return self.collective_overhead_s + ring

    reduce_scatter_s = all_gather_s

    def all_reduce_s(self, rank: int, nbytes: int) -> float:
        return 2 * self.all_gather_s(rank, nbytes)


def links(cluster: Cluster, p: int, dp: int, mesh_order: str) -> Links:
    p2p = []
    for r in range(p):
        nxt = (r + 1) % p
        ranks = [global_rank(r, 0, p, dp, mesh_order), global_rank(nxt, 0, p, dp, mesh_order)]
        p2p.append(_bandwidth(cluster, ranks) * cluster.p2p_bandwidth_ratio)
    data = [_bandwidth(cluster, [global_rank(r, d, p, dp, mesh_order) for d in range(dp)]) for r in range(p)]
    return Links(tuple(p2p), tuple(data), dp, cluster.latency_s, cluster.collective_overhead_s)
