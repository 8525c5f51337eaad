"""The strategy's configuration: one typed, validated value built from the constructor arguments.

Everything here is pure (no torch, no processes), so every invalid combination is rejected in
``BFPPStrategy.__init__`` on every rank, before any process group exists, with a message that names the
argument and the fix. What can only be checked once the world size or the model is known is checked by
:meth:`PipelineConfig.resolve_mesh` and :meth:`PipelineConfig.resolve_plan`, which every rank also runs
on identical inputs, so they raise identically everywhere instead of leaving some ranks waiting. What a
schedule accepts, the mesh it fixes and its defaults are its :class:`ConfigRules`, registered by the schedule's name
(:func:`register_config_rules`, from the schedule's own module); a schedule that registers none gets the defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lightning_bfpp.plan.mesh import MESH_ORDERS, MeshShape, hybrid_shard_size
from lightning_bfpp.plan.partition import balance_by_weight, uniform_counts
from lightning_bfpp.plan.plan import Plan
from lightning_bfpp.plan.schedules import ByName, ScheduleKind, get_schedule, schedule_names

Auto = Literal["auto"]
PartitionSpec = Literal["parameters", "uniform", "time"] | Sequence[int]

AUTO = "auto"
SHARDINGS: tuple[str, ...] = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")
PARTITIONS: tuple[str, ...] = ("parameters", "uniform", "time")


def _check_size(name: str, value: object, *, allow_auto: bool = True) -> None:
    if allow_auto and value == AUTO:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        expected = "a positive int or 'auto'" if allow_auto else "a positive int"
        raise ValueError(f"BFPPStrategy: `{name}` must be {expected}, got {value!r}.")


@dataclass(frozen=True)
class PipelineConfig:
    """User-facing knobs, validated on construction.

    ``pipeline_parallel_size=None`` (the default) makes all processes of a node one pipeline, and nodes
    data-parallel replicas; ``"auto"`` lets the planner choose (:mod:`lightning_bfpp.adapter.auto`), which then
    also chooses ``stages_per_rank`` and ``num_microbatches`` where they are ``"auto"``; so does
    ``schedule="auto"``, which lets it choose the schedule too. Otherwise ``"auto"`` values are resolved from the
    model by the schedule's kind: for most, two stages per rank when there are enough layers and as many
    micro-batches as pipeline ranks, the smallest count with which breadth-first keeps every rank busy.
    """

    pipeline_parallel_size: int | Auto | None = None
    stages_per_rank: int | Auto = AUTO
    num_microbatches: int | Auto = AUTO
    schedule: str = "breadth_first"
    sharding: str = "full_shard"
    data_parallel_size: int | Auto = AUTO
    partition: PartitionSpec = "parameters"
    microbatch_group_size: int | None = None
    mesh_order: str = "data_pipeline"
    prefetch_stages: int = 1
    processes_per_node: int | None = None
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _check_size("tensor_parallel_size", self.tensor_parallel_size, allow_auto=False)
        if self.pipeline_parallel_size is not None:
            _check_size("pipeline_parallel_size", self.pipeline_parallel_size)
        if self.pipeline_parallel_size == AUTO and self.data_parallel_size != AUTO:
            raise ValueError(
                "BFPPStrategy: with `pipeline_parallel_size='auto'` the planner chooses the pipeline size, and with"
                " it the data-parallel size; leave `data_parallel_size='auto'` or fix `pipeline_parallel_size`."
            )
        _check_size("stages_per_rank", self.stages_per_rank)
        _check_size("num_microbatches", self.num_microbatches)
        _check_size("data_parallel_size", self.data_parallel_size)
        if self.schedule != AUTO and self.schedule not in schedule_names():
            raise ValueError(
                f"BFPPStrategy: unknown `schedule={self.schedule!r}`; choose one of"
                f" {', '.join(schedule_names())}, or 'auto' (the planner chooses)."
            )
        if self.microbatch_group_size is not None:
            _check_size("microbatch_group_size", self.microbatch_group_size, allow_auto=False)
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
        if self.schedule == AUTO:
            if self.microbatch_group_size is not None:
                raise ValueError(
                    "BFPPStrategy: `microbatch_group_size` is schedule='depth_first''s group size; with"
                    " schedule='auto' the planner chooses it where it chooses depth_first. Name the schedule, or"
                    " leave microbatch_group_size unset."
                )
        else:
            self.rules.check_config(self)
        if self.tensor_parallel_size > 1 and self.sharding == "hybrid_shard":
            raise ValueError(
                f"BFPPStrategy: sharding='hybrid_shard' with tensor_parallel_size={self.tensor_parallel_size} is not"
                " supported yet; use 'full_shard' (the tensor group stays inside a node, the data-parallel group"
                " shards across)."
            )

    @property
    def kind(self) -> ScheduleKind:
        """The schedule's registered kind (not for ``schedule="auto"``, which the planner resolves first)."""
        if self.schedule == AUTO:
            raise ValueError("schedule='auto' is chosen by the planner (lightning_bfpp.adapter.auto) first")
        return get_schedule(self.schedule)

    @property
    def rules(self) -> ConfigRules:
        """The schedule's configuration rules (not for ``schedule="auto"``)."""
        return config_rules(self.kind.name)

    @property
    def needs_planner(self) -> bool:
        """Whether the planner chooses part of the layout (the pipeline size or the schedule) at setup."""
        return AUTO in (self.pipeline_parallel_size, self.schedule)

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
        fixed = None if self.schedule == AUTO else self.rules.resolve_mesh(self, world_size)
        if fixed is not None:
            return fixed
        p, dp = self.pipeline_parallel_size, self.data_parallel_size
        if p == AUTO:
            raise ValueError(
                "pipeline_parallel_size='auto' is chosen by the planner (lightning_bfpp.adapter.auto) first"
            )
        if p is None and dp == AUTO:
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
        if dp == AUTO:
            dp = world_size // p
        if p * dp != world_size:
            raise ValueError(
                f"BFPPStrategy: pipeline_parallel_size × data_parallel_size = {p} × {dp} = {p * dp}, but the"
                f" world size (devices × num_nodes) is {world_size}; make the product equal the world size"
                " or leave `data_parallel_size='auto'`."
            )
        if isinstance(self.partition, tuple) and self.stages_per_rank != AUTO:
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

    def resolve_plan(
        self,
        mesh: MeshShape,
        layer_weights: Sequence[int],
        layer_times: Sequence[float] | None = None,
        layer_names: Sequence[str] = (),
    ) -> Plan:
        """The plan for a model with these layer weights (parameter counts), names and, for ``partition="time"``,
        forward + backward times per layer (seconds): stages, micro-batches, the layer partition and the
        schedule, generated and validated here, once."""
        kind, rules = self.kind, self.rules
        p = mesh.pipeline_parallel_size
        num_layers = len(layer_weights)
        v = rules.stages_per_rank_for(self, mesh, num_layers)
        num_stages = p * v
        if num_layers < num_stages:
            raise ValueError(rules.too_few_layers(num_layers, p, v))
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
        m = rules.default_microbatches(mesh) if self.num_microbatches == AUTO else self.num_microbatches
        try:  # the schedule's own constraints (e.g. depth_first's group size), checked before any process waits
            kind.check_stages_per_rank(v)
            plan = Plan(
                self.schedule, p, mesh.data_parallel_size, v, m, sharding=self.sharding,  # type: ignore[arg-type]
                microbatch_group_size=self.microbatch_group_size, mesh_order=mesh.mesh_order,
                stage_layer_counts=counts, prefetch_stages=self.prefetch_stages,
                tensor_parallel_size=mesh.tensor_parallel_size, shard_size=mesh.shard_size,
                layer_names=tuple(layer_names),
            )  # fmt: skip
            plan.compute  # noqa: B018 (generated and validated once, kept by the plan)
        except ValueError as error:
            raise ValueError(f"BFPPStrategy: {error}") from None
        return plan


# --------------------------------------------------------------------------------------------------
# what a schedule accepts: its rules, registered by name


class ConfigRules:
    """What the configuration needs of a schedule: which arguments it takes and refuses (checked up front on every
    rank), the mesh it fixes, and its defaults for ``"auto"`` values. The defaults here are those of the
    activation pipelines; a schedule overrides what differs and registers an instance
    (:func:`register_config_rules`)."""

    #: whether tensor parallelism combines with it (the search then tries tensor groups for it too)
    tensor_parallel: bool = True

    def check_config(self, config: PipelineConfig) -> None:
        """Refuse, up front, arguments this schedule cannot honour (a ``ValueError`` naming the argument)."""
        kind = config.kind
        if config.stages_per_rank != AUTO:
            try:
                kind.check_stages_per_rank(config.stages_per_rank)  # type: ignore[arg-type]
            except ValueError as error:
                raise ValueError(f"BFPPStrategy: {error}") from None
        if config.microbatch_group_size is not None and "microbatch_group_size" not in kind.options:
            raise ValueError(
                "BFPPStrategy: `microbatch_group_size` sets the group size of schedule='depth_first'"
                f" (Megatron's interleaved order); it has no meaning for schedule={kind.name!r}."
            )
        if config.tensor_parallel_size > 1 and not self.tensor_parallel:
            raise ValueError(
                f"BFPPStrategy: schedule={kind.name!r} with tensor_parallel_size={config.tensor_parallel_size} is not"
                " supported; use schedule='breadth_first' with tensor parallelism."
            )

    def resolve_mesh(self, config: PipelineConfig, world_size: int) -> MeshShape | None:
        """A mesh this schedule fixes itself (None: the pipeline and data-parallel sizes as the arguments say)."""
        return None

    def default_stages_per_rank(self, kind: ScheduleKind, p: int, num_layers: int) -> int:
        """``stages_per_rank="auto"``: two stages per rank when the model has the layers, else one."""
        if kind.stages_per_rank_choices is not None:
            return kind.stages_per_rank_choices[0]
        return 2 if num_layers >= 2 * p else 1

    def stages_per_rank_for(self, config: PipelineConfig, mesh: MeshShape, num_layers: int) -> int:
        p = mesh.pipeline_parallel_size
        if isinstance(config.partition, tuple):
            return len(config.partition) // p
        if config.stages_per_rank == AUTO:
            return self.default_stages_per_rank(config.kind, p, num_layers)
        return config.stages_per_rank  # type: ignore[return-value]

    def default_microbatches(self, mesh: MeshShape) -> int:
        """``num_microbatches="auto"``: as many as pipeline ranks, the fewest that keep every rank busy."""
        return mesh.pipeline_parallel_size

    def arguments(self, plan: Plan) -> dict[str, Any]:
        """The strategy arguments that lay out ``plan`` (what a choice of the planner sets)."""
        return {
            "schedule": plan.schedule,
            "pipeline_parallel_size": plan.pipeline_parallel_size,
            "stages_per_rank": plan.stages_per_rank,
            "num_microbatches": plan.num_microbatches,
            "microbatch_group_size": plan.microbatch_group_size,
        }

    def too_few_layers(self, num_layers: int, p: int, v: int) -> str:
        return (
            f"BFPPStrategy: the module's `pipeline_layers()` returns {num_layers} layers, fewer than the"
            f" {p * v} stages requested (pipeline_parallel_size={p} × stages_per_rank={v}); lower"
            " `stages_per_rank` or `pipeline_parallel_size`, or split the model into more layers."
        )


#: ``config_rules(name)``: the configuration rules of the schedule called ``name``, its own or the defaults
config_rules: ByName[ConfigRules] = ByName("configuration rules", ConfigRules())
#: ``register_config_rules(name, rules)``: make ``rules`` those of the schedule called ``name`` (once per name)
register_config_rules = config_rules.register
