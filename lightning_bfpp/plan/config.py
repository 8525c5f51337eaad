"""The strategy's configuration: one typed, validated value built from the constructor arguments.

Everything here is pure (no torch, no processes), so every invalid combination is rejected in
``BFPPStrategy.__init__`` on every rank, before any process group exists, with a message that names the
argument and the fix. What can only be checked once the world size or the model is known is checked by
:meth:`PipelineConfig.resolve_mesh` and :meth:`PipelineConfig.resolve_layout`, which every rank also runs
on identical inputs, so they raise identically everywhere instead of leaving some ranks waiting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Auto = Literal["auto"]
ScheduleName = Literal["breadth_first"]
ShardingName = Literal["full_shard", "shard_grad_op", "no_shard"]
PartitionSpec = Literal["parameters", "uniform", "time"] | Sequence[int]

SCHEDULES: tuple[str, ...] = ("breadth_first", "breadth_first_zb", "depth_first", "gpipe", "1f1b", "weight_passing")
NON_LOOPED: tuple[str, ...] = ("gpipe", "1f1b")
SHARDINGS: tuple[str, ...] = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")
PARTITIONS: tuple[str, ...] = ("parameters", "uniform", "time")
# outer to inner mesh dimension: "data_pipeline" keeps a pipeline's ranks consecutive (inside a node),
# "pipeline_data" keeps a data-parallel group's ranks consecutive
MESH_ORDERS: tuple[str, ...] = ("data_pipeline", "pipeline_data")


def _check_size(name: str, value: object, *, allow_auto: bool = True) -> None:
    if allow_auto and value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        expected = "a positive int or 'auto'" if allow_auto else "a positive int"
        raise ValueError(f"BFPPStrategy: `{name}` must be {expected}, got {value!r}.")


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


@dataclass(frozen=True)
class Layout:
    """Resolved pipeline layout: ``p·v`` stages, ``m`` micro-batches, and how layers map to stages."""

    pipeline_parallel_size: int
    data_parallel_size: int
    stages_per_rank: int
    num_microbatches: int
    stage_layer_counts: tuple[int, ...]
    microbatch_group_size: int | None = None

    @property
    def num_stages(self) -> int:
        return self.pipeline_parallel_size * self.stages_per_rank

    def describe(self, config: PipelineConfig) -> str:
        """One line naming the schedule, the sharding and the sizes (a trace's title)."""
        return (
            f"{config.schedule}, {config.sharding}: p={self.pipeline_parallel_size} dp={self.data_parallel_size}"
            f" v={self.stages_per_rank} m={self.num_microbatches}"
        )


@dataclass(frozen=True)
class PipelineConfig:
    """User-facing knobs, validated on construction.

    ``pipeline_parallel_size=None`` (the default) makes all processes of a node one pipeline, and nodes
    data-parallel replicas; ``"auto"`` lets the planner choose (:mod:`lightning_bfpp.adapter.auto`), which then
    also chooses ``stages_per_rank`` and ``num_microbatches`` where they are ``"auto"``. Otherwise
    ``"auto"`` values are resolved from the model: two stages per rank when there are enough layers; as many
    micro-batches as pipeline ranks, the smallest count with which breadth-first keeps every rank busy.
    """

    pipeline_parallel_size: int | Auto | None = None
    stages_per_rank: int | Auto = "auto"
    num_microbatches: int | Auto = "auto"
    schedule: str = "breadth_first"
    sharding: str = "full_shard"
    data_parallel_size: int | Auto = "auto"
    partition: PartitionSpec = "parameters"
    microbatch_group_size: int | None = None
    mesh_order: str = "data_pipeline"
    prefetch_stages: int = 1
    processes_per_node: int | None = None
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _check_size("tensor_parallel_size", self.tensor_parallel_size, allow_auto=False)
        if self.tensor_parallel_size > 1:
            self._check_tensor_parallel()
        if self.pipeline_parallel_size is not None:
            _check_size("pipeline_parallel_size", self.pipeline_parallel_size)
        if self.pipeline_parallel_size == "auto" and self.data_parallel_size != "auto":
            raise ValueError(
                "BFPPStrategy: with `pipeline_parallel_size='auto'` the planner chooses the pipeline size, and with"
                " it the data-parallel size; leave `data_parallel_size='auto'` or fix `pipeline_parallel_size`."
            )
        _check_size("stages_per_rank", self.stages_per_rank)
        _check_size("num_microbatches", self.num_microbatches)
        _check_size("data_parallel_size", self.data_parallel_size)
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"BFPPStrategy: unknown `schedule={self.schedule!r}`; choose one of {', '.join(SCHEDULES)}."
            )
        if self.schedule == "weight_passing":
            self._check_weight_passing()
        if self.microbatch_group_size is not None:
            _check_size("microbatch_group_size", self.microbatch_group_size, allow_auto=False)
            if self.schedule != "depth_first":
                raise ValueError(
                    "BFPPStrategy: `microbatch_group_size` sets the group size of schedule='depth_first'"
                    f" (Megatron's interleaved order); it has no meaning for schedule={self.schedule!r}."
                )
        if self.schedule in NON_LOOPED and self.stages_per_rank not in ("auto", 1):
            raise ValueError(
                f"BFPPStrategy: schedule={self.schedule!r} is a non-looped schedule and needs stages_per_rank=1"
                f" (got {self.stages_per_rank}); for several stages per rank use 'breadth_first' or 'depth_first'."
            )
        if self.mesh_order not in MESH_ORDERS:
            raise ValueError(
                f"BFPPStrategy: unknown `mesh_order={self.mesh_order!r}`; choose 'data_pipeline' (a pipeline's ranks"
                " consecutive, e.g. inside a node) or 'pipeline_data' (a data-parallel group's ranks consecutive)."
            )
        if self.sharding not in SHARDINGS:
            raise ValueError(
                f"BFPPStrategy: unknown `sharding={self.sharding!r}`; choose one of {', '.join(SHARDINGS)}."
            )
        prefetch = self.prefetch_stages
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(
                "BFPPStrategy: `prefetch_stages` (stages whose weights are gathered ahead of the one computing) must"
                f" be an int of at least 0, got {prefetch!r}."
            )
        per_node = self.processes_per_node
        if per_node is not None and (isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1):
            raise ValueError(
                "BFPPStrategy: `processes_per_node` (the processes of one node, for topology-aware sharding) must"
                f" be a positive int or None (Lightning's devices per node), got {per_node!r}."
            )
        if isinstance(self.partition, str):
            if self.partition not in PARTITIONS:
                raise ValueError(
                    f"BFPPStrategy: unknown `partition={self.partition!r}`; choose one of"
                    f" {', '.join(PARTITIONS)}, or pass the number of layers in each stage as a list."
                )
        else:
            counts = list(self.partition)
            if not counts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
                raise ValueError(
                    "BFPPStrategy: `partition` as a list gives the number of layers in each stage and must"
                    f" hold positive ints, got {self.partition!r}."
                )
            object.__setattr__(self, "partition", tuple(counts))

    def _check_weight_passing(self) -> None:
        """Weight passing has no pipeline and one chunk per rank: refuse the knobs that would say otherwise."""
        fixed = {
            "pipeline_parallel_size": (self.pipeline_parallel_size, (None, 1)),
            "stages_per_rank": (self.stages_per_rank, ("auto",)),
            "data_parallel_size": (self.data_parallel_size, ("auto",)),
            "sharding": (self.sharding, ("full_shard",)),
        }
        for name, (value, allowed) in fixed.items():
            if value not in allowed:
                raise ValueError(
                    f"BFPPStrategy: schedule='weight_passing' sets `{name}` itself (every rank runs the whole model"
                    " on its own micro-batches, and the layers are cut into one chunk per rank, owned whole by one"
                    f" rank); got {name}={value!r}. Leave it at its default."
                )

    def _check_tensor_parallel(self) -> None:
        """What tensor parallelism does not combine with yet, each with the way that works."""
        t = self.tensor_parallel_size
        if self.schedule == "weight_passing":
            raise ValueError(
                f"BFPPStrategy: schedule='weight_passing' with tensor_parallel_size={t} is not supported: its chunks"
                " travel whole between ranks, and a tensor-parallel chunk would have to travel between matching"
                " tensor ranks of two groups. Use schedule='breadth_first' with tensor parallelism, or"
                " weight passing without it."
            )
        if self.sharding == "hybrid_shard":
            raise ValueError(
                f"BFPPStrategy: sharding='hybrid_shard' with tensor_parallel_size={t} is not supported yet; use"
                " 'full_shard' (the tensor group stays inside a node, the data-parallel group shards across)."
            )

    def node_size(self, world_size: int, local_processes: int) -> int:
        """The processes of one node: ``processes_per_node`` if given (it must divide the world), else the
        launcher's processes on this machine."""
        given = self.processes_per_node
        if given is None:
            return max(local_processes, 1)
        if world_size % given:
            raise ValueError(
                f"BFPPStrategy: `processes_per_node={given}` does not divide the world size ({world_size})."
            )
        return given

    def resolve_mesh(self, world_size: int, processes_per_node: int) -> MeshShape:
        """Fix the pipeline and data-parallel sizes for ``world_size`` ranks (of ``tensor_parallel_size``
        processes each: the sizes below count tensor-parallel groups)."""
        t = self.tensor_parallel_size
        if t > 1:
            if world_size % t or processes_per_node % t:
                raise ValueError(
                    f"BFPPStrategy: `tensor_parallel_size={t}` must divide the processes of a node"
                    f" ({processes_per_node}) and the world size ({world_size}): a tensor-parallel group stays"
                    " inside a node, where its per-layer collectives are fast."
                )
            shape = dataclasses.replace(self, tensor_parallel_size=1).resolve_mesh(
                world_size // t, processes_per_node // t
            )
            return dataclasses.replace(shape, tensor_parallel_size=t)
        if self.schedule == "weight_passing":  # no pipeline: every rank is a data-parallel rank
            return MeshShape(pipeline_parallel_size=1, data_parallel_size=world_size, mesh_order=self.mesh_order)
        p, dp = self.pipeline_parallel_size, self.data_parallel_size
        if p == "auto":
            raise ValueError(
                "pipeline_parallel_size='auto' is chosen by the planner (lightning_bfpp.adapter.auto) first"
            )
        if p is None and dp == "auto":
            p = processes_per_node if world_size % processes_per_node == 0 else world_size
        if p is None:
            assert isinstance(dp, int)
            if world_size % dp:
                raise ValueError(
                    f"BFPPStrategy: `data_parallel_size={dp}` does not divide the world size ({world_size})."
                )
            p = world_size // dp
        if p > world_size or world_size % p:
            raise ValueError(
                f"BFPPStrategy: `pipeline_parallel_size={p}` must divide the world size ({world_size} ="
                " devices × num_nodes); choose a divisor of it."
            )
        if dp == "auto":
            dp = world_size // p
        if p * dp != world_size:
            raise ValueError(
                f"BFPPStrategy: pipeline_parallel_size × data_parallel_size = {p} × {dp} = {p * dp}, but the"
                f" world size (devices × num_nodes) is {world_size}; make the product equal the world size"
                " or leave `data_parallel_size='auto'`."
            )
        if isinstance(self.partition, tuple) and self.stages_per_rank != "auto":
            expected = p * self.stages_per_rank
            if len(self.partition) != expected:
                raise ValueError(
                    f"BFPPStrategy: `partition` lists {len(self.partition)} stages, but"
                    f" pipeline_parallel_size × stages_per_rank = {p} × {self.stages_per_rank} = {expected}."
                )
        if isinstance(self.partition, tuple) and len(self.partition) % p:
            raise ValueError(
                f"BFPPStrategy: `partition` lists {len(self.partition)} stages, which is not a multiple of"
                f" pipeline_parallel_size={p}; every rank must hold the same number of stages."
            )
        shape = MeshShape(pipeline_parallel_size=p, data_parallel_size=dp, mesh_order=self.mesh_order)
        if self.sharding == "hybrid_shard":
            shape = MeshShape(p, dp, self.mesh_order, shard_size=hybrid_shard_size(shape, processes_per_node))
        return shape

    def resolve_layout(
        self, mesh: MeshShape, layer_weights: Sequence[int], layer_times: Sequence[float] | None = None
    ) -> Layout:
        """Fix stages, micro-batches and the layer partition for a model with these layer weights (parameter
        counts) and, for ``partition="time"``, these forward + backward times per layer (seconds)."""
        from lightning_bfpp.plan.partition import balance_by_weight, uniform_counts

        p = mesh.pipeline_parallel_size
        num_layers = len(layer_weights)
        if self.schedule == "weight_passing":
            v = mesh.data_parallel_size  # one chunk per rank
            if isinstance(self.partition, tuple) and len(self.partition) != v:
                raise ValueError(
                    f"BFPPStrategy: schedule='weight_passing' cuts the layers into one chunk per rank ({v}), but"
                    f" `partition` lists {len(self.partition)}."
                )
        elif isinstance(self.partition, tuple):
            v = len(self.partition) // p
        elif self.stages_per_rank == "auto":
            v = 2 if num_layers >= 2 * p and self.schedule not in NON_LOOPED else 1
        else:
            v = self.stages_per_rank
        num_stages = p * v
        if num_layers < num_stages and self.schedule == "weight_passing":
            raise ValueError(
                f"BFPPStrategy: schedule='weight_passing' cuts `pipeline_layers()` into one chunk per rank, but the"
                f" module returns {num_layers} layers for {num_stages} ranks; use fewer processes or more layers."
            )
        if num_layers < num_stages:
            raise ValueError(
                f"BFPPStrategy: the module's `pipeline_layers()` returns {num_layers} layers, fewer than the"
                f" {num_stages} stages requested (pipeline_parallel_size={p} × stages_per_rank={v}); lower"
                " `stages_per_rank` or `pipeline_parallel_size`, or split the model into more layers."
            )
        if isinstance(self.partition, tuple):
            if sum(self.partition) != num_layers:
                raise ValueError(
                    f"BFPPStrategy: `partition={list(self.partition)}` covers {sum(self.partition)} layers,"
                    f" but `pipeline_layers()` returns {num_layers}; the counts must add up to {num_layers}."
                )
            counts = tuple(self.partition)
        elif self.partition == "uniform":
            counts = uniform_counts(num_layers, num_stages)
        elif self.partition == "time":
            if layer_times is None or len(layer_times) != num_layers:
                raise ValueError("partition='time' needs one measured time per layer")
            # microseconds: the partitioner's +1 per layer (spreading free layers) is then negligible
            counts = balance_by_weight([max(round(t * 1e6), 0) for t in layer_times], num_stages)
        else:
            counts = balance_by_weight(layer_weights, num_stages)
        if self.schedule in NON_LOOPED and v != 1:
            raise ValueError(
                f"BFPPStrategy: schedule={self.schedule!r} needs one stage per rank, but `partition` gives {v}."
            )
        # weight passing fetches every chunk once per micro-batch: one is the fewest transfers
        auto_microbatches = 1 if self.schedule == "weight_passing" else p
        m = auto_microbatches if self.num_microbatches == "auto" else self.num_microbatches
        layout = Layout(
            pipeline_parallel_size=p,
            data_parallel_size=mesh.data_parallel_size,
            stages_per_rank=v,
            num_microbatches=m,
            stage_layer_counts=counts,
            microbatch_group_size=self.microbatch_group_size,
        )
        from lightning_bfpp.plan.schedule import generate

        try:  # the schedule's own constraints (e.g. depth_first's group size), checked before any process waits
            generate(self.schedule, p, v, m, self.microbatch_group_size)
        except ValueError as error:
            raise ValueError(f"BFPPStrategy: {error}") from None
        return layout


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
