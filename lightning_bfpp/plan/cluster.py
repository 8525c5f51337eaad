"""The machines a plan runs on: devices, nodes, memory, links; and what collectives cost on them. Pure.

Collectives use the ring model: an all-gather or reduce-scatter of ``B`` bytes (the full tensor) over
``n`` ranks moves ``(n − 1)/n · B`` bytes through each rank's slowest link in ``n − 1`` steps; an
all-reduce twice that. A group whose ranks all share a node uses the intra-node bandwidth, one that spans
nodes the inter-node bandwidth, ``inter_node_bandwidth`` being each device's share when every device of a
node communicates across nodes at once. A spanning group with ``g`` members on each node crosses each node's
links once per ring (its members pass the data on among themselves inside the node) while the node's
``S/g`` such groups cross side by side, so it gets ``g · inter_node_bandwidth``: one group over every device
(``pipeline_parallel_size=1``) gets the whole node's, as NCCL's bus bandwidth across nodes does; groups with
one member per node (hybrid sharding's replicate groups, pipelines inside a node) get one device's share.
Which groups stay inside a node depends on the mesh order: with
``"data_pipeline"`` (the default) the ranks of one pipeline are consecutive, so pipelines stay inside a
node and data-parallel groups cross nodes; ``"pipeline_data"`` keeps data-parallel groups inside a node.

Hybrid sharding (``"hybrid_shard"``, FSDP2's HSDP) splits a data-parallel group of ``n`` ranks into shard
groups of the ``n_s`` members on one node and replicate groups of the ``n_r = n / n_s`` nodes it spans.
Gathering a stage of ``B`` bytes is an all-gather inside the node; reducing its gradients a reduce-scatter
inside the node, then an all-reduce of the ``B / n_s`` shard across nodes::

    gather = ring(n_s, B, intra)
    reduce = ring(n_s, B, intra) + 2 · ring(n_r, B / n_s, inter)
    ring(n, B, bw) = overhead + (n − 1) · latency + (n − 1)/n · B / bw        (0 when n = 1)

so a node sends ``n_s · 2 · (n_r − 1)/n_r · B / n_s = 2 · B · (n_r − 1)/n_r`` across nodes per step, whatever the
number of micro-batches, and each rank holds ``B / n_s`` of the weights, gradients and optimizer state
(``n_r`` times full sharding's ``B / n``).

Weight passing moves whole chunks along *rails* (the devices with one local rank, one per node), one device
of a node at a time: it uses ``rail_bandwidth``, what one device reaches across nodes while the others of
its node are quiet (a node's whole NIC where the devices share one; the device's own NIC on a rail-optimised
fabric). Collectives, where every device of a node sends at once, use ``inter_node_bandwidth``.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from lightning_bfpp.plan.mesh import MESH_ORDERS


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
    # negligible at scale, measurable on small CPU runs (see lightning_bfpp.measure.calibrate)
    action_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    # whether gradient reductions overlap later compute: BFPPStrategy's overlap_reductions (on by default on
    # CUDA); torch's own REDUCE_GRAD, used on gloo by default, makes every later compute wait for them
    overlap_reductions: bool = False
    # bytes/s one device moves across nodes while its node's other devices do not (weight passing's rail
    # transfers); None: inter_node_bandwidth (one NIC per device, no more for one device than for all)
    inter_node_rail_bandwidth: float | None = None
    # a reduce-scatter's and an all-reduce's bus bandwidth relative to an all-gather's on the same link: below 1
    # where the summation is host work (gloo on CPU, about 0.5 for reduce-scatters); ``plan calibrate`` measures
    # all three
    reduce_bandwidth_ratio: float = 1.0
    all_reduce_bandwidth_ratio: float = 1.0
    # fixed cost of a tensor group's all-reduce, which comes right after each member's own compute and so also
    # pays for members arriving apart (``plan calibrate`` measures it so); None: ``collective_overhead_s``
    tensor_collective_overhead_s: float | None = None
    # host cost per action on a stage under data parallelism, on top of ``action_overhead_s``: FSDP2's hooks and
    # copies run in every forward and backward of such a stage (``plan calibrate`` measures it on two sharded layouts
    # that differ only in actions)
    data_parallel_action_overhead_s: float = 0.0
    # how many times longer the step's first gather and its last gradient reduction take than one group's alone:
    # every rank issues them at about the same moment, beside the step's host work (its preparation, its
    # optimizer update), so on a host whose processes share cores (gloo on CPU) every group's copies and sums
    # and that host work compete for them (at 16 MiB on 4 processes on 2 cores: the gather 2.1–3.0×, the
    # reduction 1.6–1.8× in one calibration); about 1 on accelerators. ``plan calibrate`` measures both as a step
    # issues them (:func:`contended_slowdown`)
    first_gather_slowdown: float = 1.0
    last_reduce_slowdown: float = 1.0

    @property
    def num_nodes(self) -> int:
        return -(-self.num_devices // self.devices_per_node)

    @property
    def rail_bandwidth(self) -> float:
        """Point-to-point bytes/s of one device across nodes while the rest of its node is quiet."""
        single = self.inter_node_bandwidth if self.inter_node_rail_bandwidth is None else self.inter_node_rail_bandwidth
        return single * self.p2p_bandwidth_ratio

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


def tensor_all_reduce_s(cluster: Cluster, size: int, nbytes: int) -> float:
    """A ring all-reduce of ``nbytes`` over a tensor group of ``size`` consecutive ranks (inside a node), at the
    all-reduce's own measured bandwidth (``all_reduce_bandwidth_ratio``)."""
    if size <= 1:
        return 0.0
    steps = 2 * (size - 1)
    moved = steps / size * nbytes / (cluster.intra_node_bandwidth * cluster.all_reduce_bandwidth_ratio)
    fixed = cluster.tensor_collective_overhead_s
    return (cluster.collective_overhead_s if fixed is None else fixed) + steps * cluster.latency_s + moved


def tensor_groups_as_devices(cluster: Cluster, size: int) -> Cluster:
    """The cluster seen by the pipeline and data-parallel layout when each tensor group of ``size`` ranks acts
    as one device: ``num_devices / size`` of them, ``devices_per_node / size`` per node. Bandwidths and memory
    stay per device: each tensor rank sends its own copy of an activation on its own link, and gathers and
    reduces its own shard of the weights."""
    if size == 1:
        return cluster
    if cluster.devices_per_node % size or cluster.num_devices % size:
        raise ValueError(
            f"tensor_parallel_size={size} must divide the devices of a node ({cluster.devices_per_node}) and the"
            f" cluster ({cluster.num_devices})"
        )
    return replace(cluster, num_devices=cluster.num_devices // size, devices_per_node=cluster.devices_per_node // size)


def _bandwidth(cluster: Cluster, ranks: list[int]) -> float:
    per_node = Counter(r // cluster.devices_per_node for r in ranks)
    if len(per_node) == 1:
        return cluster.intra_node_bandwidth
    # g members per node: g devices' share of the node's links (never more than the links inside a node)
    return min(cluster.inter_node_bandwidth * max(per_node.values()), cluster.intra_node_bandwidth)


@dataclass(frozen=True)
class Links:
    """Costs of one pipeline replica's transfers under a layout (the replicas are symmetric)."""

    p2p_bandwidth: tuple[float, ...]  # from pipeline rank r to r + 1 (mod p)
    data_parallel_bandwidth: tuple[float, ...]  # per pipeline rank
    dp: int
    latency_s: float
    collective_overhead_s: float = 0.0
    # hybrid sharding, per pipeline rank: its data-parallel group's members on one node (the shard group)
    # and the nodes the group spans (the replicate group); the bandwidths of those groups
    shard_size: tuple[int, ...] = ()
    replicate_size: tuple[int, ...] = ()
    intra_node_bandwidth: float = 0.0
    inter_node_bandwidth: float = 0.0
    reduce_bandwidth_ratio: float = 1.0
    all_reduce_bandwidth_ratio: float = 1.0

    # between any two pipeline ranks (a V placement also sends from r to r − 1): [src][dst]
    pair_bandwidth: tuple[tuple[float, ...], ...] = ()

    def p2p_s(self, src_rank: int, dst_rank: int, nbytes: int) -> float:
        return self.latency_s + nbytes / self.pair_bandwidth[src_rank][dst_rank]

    def ring_s(self, n: int, nbytes: float, bandwidth: float) -> float:
        """An all-gather or reduce-scatter of ``nbytes`` (the full tensor) over ``n`` ranks."""
        if n <= 1:
            return 0.0
        return self.collective_overhead_s + (n - 1) * self.latency_s + (n - 1) / n * nbytes / bandwidth

    def ring_all_reduce_s(self, n: int, nbytes: float, bandwidth: float) -> float:
        """An all-reduce of ``nbytes`` over ``n`` ranks: a reduce-scatter and an all-gather's steps and bytes,
        one call's overhead, at the all-reduce's own bandwidth."""
        if n <= 1:
            return 0.0
        bandwidth *= self.all_reduce_bandwidth_ratio
        return self.collective_overhead_s + 2 * (n - 1) * self.latency_s + 2 * (n - 1) / n * nbytes / bandwidth

    def all_gather_s(self, rank: int, nbytes: int) -> float:
        return self.ring_s(self.dp, nbytes, self.data_parallel_bandwidth[rank])

    def reduce_scatter_s(self, rank: int, nbytes: int) -> float:
        return self.ring_s(self.dp, nbytes, self.data_parallel_bandwidth[rank] * self.reduce_bandwidth_ratio)

    def all_reduce_s(self, rank: int, nbytes: int) -> float:
        return self.ring_all_reduce_s(self.dp, nbytes, self.data_parallel_bandwidth[rank])

    def hybrid_all_gather_s(self, rank: int, nbytes: int) -> float:
        """``hybrid_shard``: gather a stage inside the node."""
        return self.ring_s(self.shard_size[rank], nbytes, self.intra_node_bandwidth)

    def hybrid_reduce_s(self, rank: int, nbytes: int) -> float:
        """``hybrid_shard``: reduce-scatter inside the node, then all-reduce each shard across nodes."""
        n_s, n_r = self.shard_size[rank], self.replicate_size[rank]
        inside = self.ring_s(n_s, nbytes, self.intra_node_bandwidth * self.reduce_bandwidth_ratio)
        return inside + self.ring_all_reduce_s(n_r, nbytes / n_s, self.inter_node_bandwidth)


def links(cluster: Cluster, p: int, dp: int, mesh_order: str) -> Links:
    def pair(a: int, b: int) -> float:
        ranks = [global_rank(a, 0, p, dp, mesh_order), global_rank(b, 0, p, dp, mesh_order)]
        return _bandwidth(cluster, ranks) * cluster.p2p_bandwidth_ratio

    pairs = tuple(tuple(pair(a, b) for b in range(p)) for a in range(p))
    p2p = [pairs[r][(r + 1) % p] for r in range(p)]
    groups = [[global_rank(r, d, p, dp, mesh_order) for d in range(dp)] for r in range(p)]
    data = [_bandwidth(cluster, group) for group in groups]
    shard, replicate = zip(*(hybrid_groups(cluster, group) for group in groups), strict=True)
    return Links(
        tuple(p2p),
        tuple(data),
        dp,
        cluster.latency_s,
        cluster.collective_overhead_s,
        shard,
        replicate,
        cluster.intra_node_bandwidth,
        cluster.inter_node_bandwidth,
        cluster.reduce_bandwidth_ratio,
        cluster.all_reduce_bandwidth_ratio,
        pairs,
    )


def contended_slowdown(cluster: Cluster, collective: str, group_size: int, nbytes: int, seconds: float) -> float:
    """A contended collective's slowdown (``Cluster.first_gather_slowdown`` for ``"all_gather"``,
    ``last_reduce_slowdown`` for ``"reduce_scatter"``) from one measurement: ``collective`` of ``nbytes`` over
    ``group_size`` ranks took ``seconds`` when every group issued it at once beside the step's host work (as
    ``plan calibrate`` runs it), against what the cluster's links price one group's alone at. Not below 1: the
    measurement is of contention, which only slows a collective, and a host quicker than its fitted links must
    not make these two cheaper than the step's others."""
    net = links(cluster, 1, group_size, "data_pipeline")  # one group, the others idle
    price = {"all_gather": net.all_gather_s, "reduce_scatter": net.reduce_scatter_s}[collective]
    return max(seconds / price(0, nbytes), 1.0)


def hybrid_groups(cluster: Cluster, ranks: list[int]) -> tuple[int, int]:
    """``(n_s, n_r)``: a data-parallel group's members per node (its shard group, the largest where they
    differ) and the number of nodes it spans (its replicate group)."""
    per_node = Counter(r // cluster.devices_per_node for r in ranks)
    return max(per_node.values()), len(per_node)


def hybrid_inter_node_bytes(param_bytes: float, replicate: int) -> float:
    """Bytes one node sends across nodes per step under ``hybrid_shard``: ``2 · Ψ · (n_r − 1)/n_r``."""
    return 2 * param_bytes * (replicate - 1) / replicate
