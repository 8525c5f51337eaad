"""How the world is cut into pipelines, data-parallel replicas and tensor groups. Pure.

Resolved from the strategy's arguments and the world size before any process group exists
(:meth:`lightning_bfpp.plan.config.PipelineConfig.resolve_mesh`), so that every rank computes the same shape and
raises the same error; the engine builds its ``DeviceMesh`` from it (:func:`lightning_bfpp.engine.sharding.build_mesh`).
"""

from __future__ import annotations

from dataclasses import dataclass

# outer to inner mesh dimension: "data_pipeline" keeps a pipeline's ranks consecutive (inside a node),
# "pipeline_data" keeps a data-parallel group's ranks consecutive
MESH_ORDERS: tuple[str, ...] = ("data_pipeline", "pipeline_data")


@dataclass(frozen=True)
class MeshShape:
    """How the world is cut: ``data_parallel_size`` pipelines of ``pipeline_parallel_size`` ranks each, every
    rank of which is ``tensor_parallel_size`` consecutive processes sharing its layers' weights (tensor
    parallelism, innermost: inside a node)."""

    pipeline_parallel_size: int
    data_parallel_size: int
    mesh_order: str = "data_pipeline"
    # sharding="hybrid_shard": the data-parallel ranks of one node, FSDP2's shard dimension (None otherwise)
    shard_size: int | None = None
    tensor_parallel_size: int = 1

    @property
    def replicate_size(self) -> int:
        """Copies of each shard (nodes a data-parallel group spans under ``hybrid_shard``; else 1)."""
        return self.data_parallel_size // self.shard_size if self.shard_size else 1

    def global_rank(self, pipeline_rank: int, data_parallel_rank: int, tensor_rank: int = 0) -> int:
        """The global rank at these mesh coordinates (see :func:`lightning_bfpp.engine.sharding.build_mesh`)."""
        if self.mesh_order == "data_pipeline":
            outer = data_parallel_rank * self.pipeline_parallel_size + pipeline_rank
        else:
            outer = pipeline_rank * self.data_parallel_size + data_parallel_rank
        return outer * self.tensor_parallel_size + tensor_rank

    def data_parallel_groups(self) -> list[list[int]]:
        """Per pipeline rank (and tensor rank), the global ranks of its data-parallel group in data-parallel
        rank order."""
        p, dp, t = self.pipeline_parallel_size, self.data_parallel_size, self.tensor_parallel_size
        return [[self.global_rank(q, d, k) for d in range(dp)] for q in range(p) for k in range(t)]

    def hybrid_groups(self) -> tuple[list[list[int]], list[list[int]]]:
        """``hybrid_shard``'s (shard groups, replicate groups), as global ranks: a shard group is ``shard_size``
        consecutive data-parallel ranks (one node's), a replicate group the ranks at one place of each."""
        assert self.shard_size is not None
        s, shard, replicate = self.shard_size, [], []
        for ranks in self.data_parallel_groups():
            shard += [ranks[i : i + s] for i in range(0, len(ranks), s)]
            replicate += [ranks[i::s] for i in range(s)]
        return shard, replicate


def hybrid_shard_size(shape: MeshShape, processes_per_node: int) -> int:
    """``hybrid_shard``'s shard size: how many ranks of each data-parallel group share a node.

    Global rank ``r`` is on node ``r // processes_per_node``. Every data-parallel group must split into
    nodes holding the same number ``S`` of its ranks, with ``1 < S < data_parallel_size``: FSDP2 then shards
    over those ``S`` (inside a node) and replicates over the ``data_parallel_size / S`` nodes. A group's ranks
    rise with its data-parallel rank in both mesh orders, so a node's are consecutive data-parallel ranks.
    Pure: every rank computes it, and raises the same error, before any collective.
    """
    p, dp, order, n = shape.pipeline_parallel_size, shape.data_parallel_size, shape.mesh_order, processes_per_node
    where = (
        f"sharding='hybrid_shard' shards inside a node and replicates across nodes, but with processes_per_node={n},"
        f" pipeline_parallel_size={p}, data_parallel_size={dp} and mesh_order={order!r}"
    )
    fix = (
        " Choose sizes where the data-parallel size is a multiple of the data-parallel ranks per node and larger"
        " than it (with mesh_order='data_pipeline' a pipeline fits several times in a node, e.g. pipeline_parallel_size"
        " = processes_per_node / 2; with 'pipeline_data' processes_per_node divides data_parallel_size), or use"
        " sharding='full_shard' or 'no_shard'."
    )
    counts = []
    for ranks in shape.data_parallel_groups():
        nodes = [r // n for r in ranks]
        counts.append([nodes.count(node) for node in dict.fromkeys(nodes)])
    per_node = counts[0][0]
    uneven = next((q for q, group in enumerate(counts) if any(c != per_node for c in group)), None)
    if uneven is not None:
        listed = ", ".join(str(c) for c in counts[uneven])
        raise ValueError(
            f"BFPPStrategy: {where}, the data-parallel groups' ranks are spread unevenly over nodes (pipeline rank"
            f" {uneven}'s: {listed} per node), so no shard group of one size fits inside a node.{fix}"
        )
    if per_node == dp:
        raise ValueError(
            f"BFPPStrategy: {where}, each data-parallel group ({dp} ranks) lies inside one node: there is nothing to"
            f" replicate across nodes.{fix}"
        )
    if per_node == 1:
        raise ValueError(
            f"BFPPStrategy: {where}, each node holds one rank of each data-parallel group: there is nothing to shard"
            f" inside a node (it would be 'no_shard').{fix}"
        )
    return per_node
