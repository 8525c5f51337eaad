"""The plan: one frozen value saying what a training step runs. Pure.

Made once, in this folder — by :meth:`lightning_bfpp.plan.config.PipelineConfig.resolve_plan` from the strategy's
arguments and the model's layers, or by the search (:mod:`lightning_bfpp.plan.search`) — and then read by
everything downstream: the simulator times it, the engine builds this rank's stages from it and its pipeline
runs it. The schedule is generated and validated once per plan (:attr:`Plan.compute`) and lowered with the
data-parallel actions by one function (:meth:`Plan.lowered`), so the simulator and the runtime execute the same
lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from lightning_bfpp.plan.actions import Schedule, validate
from lightning_bfpp.plan.mesh import MeshShape
from lightning_bfpp.plan.placement import StagePlacement
from lightning_bfpp.plan.schedules import ScheduleKind, get_schedule
from lightning_bfpp.plan.schedules.base import ScheduleOptions

HYBRID_SHARD = "hybrid_shard"


@dataclass(frozen=True)
class Plan:
    """A layout and a schedule: ``p·v`` stages on ``p`` ranks, ``m`` micro-batches of ``microbatch_size`` samples,
    replicated over ``dp`` data-parallel ranks (and tensor groups of ``t``), sharded as ``sharding`` says.

    ``stage_layer_counts`` cuts the layers (None, in the planner: balanced by parameter bytes when simulated);
    ``layer_names`` are the layers' names in the module (empty in the planner), so that checkpoints, logs and
    errors keep the module's own names whatever the layout. ``microbatch_size`` matters to the planner only (the
    engine splits whatever batch comes). ``shard_size`` is ``hybrid_shard``'s data-parallel ranks per node, where
    the mesh fixes it. ``options`` holds what only the plan's kind reads, an instance of its
    :attr:`~lightning_bfpp.plan.schedules.base.ScheduleKind.plan_options` (weight passing's ``stagger``, a what-if
    of its model the runtime does not run); None where they are the kind's defaults (a mapping, as read back from
    JSON, is made the kind's type).
    """

    schedule: str
    pipeline_parallel_size: int
    data_parallel_size: int
    stages_per_rank: int
    num_microbatches: int
    microbatch_size: int = 1
    sharding: str = "full_shard"
    microbatch_group_size: int | None = None
    mesh_order: str = "data_pipeline"
    stage_layer_counts: tuple[int, ...] | None = None
    prefetch_stages: int = 1
    tensor_parallel_size: int = 1
    shard_size: int | None = None
    layer_names: tuple[str, ...] = ()
    options: ScheduleOptions | None = None

    def __post_init__(self) -> None:
        for name in ("stage_layer_counts", "layer_names"):  # as read back from JSON
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        if self.options is not None:
            object.__setattr__(self, "options", self._kind_options(self.options))
        counts = self.stage_layer_counts
        if counts is None:
            if self.layer_names:
                raise ValueError("a plan with layer names needs stage_layer_counts")
            return
        if len(counts) != self.num_stages:
            raise ValueError(f"{len(counts)} stage layer counts for {self.num_stages} stages")
        if any(c < 1 for c in counts):
            raise ValueError("every stage needs at least one layer")
        if self.layer_names and sum(counts) != len(self.layer_names):
            raise ValueError("stage_layer_counts must add up to the number of layers")

    def _kind_options(self, options: object) -> ScheduleOptions | None:
        """``options`` as the kind's own type, None where they are its defaults."""
        cls = self.kind.plan_options
        if cls is None:
            raise ValueError(f"schedule={self.schedule!r} takes no plan options, got {options!r}")
        if isinstance(options, dict):
            options = cls(**options)
        if not isinstance(options, cls):
            raise ValueError(f"schedule={self.schedule!r} takes {cls.__name__} as its options, got {options!r}")
        return None if options == cls() else options

    # -- the kind and its schedule ---------------------------------------------------------------------

    @property
    def kind(self) -> ScheduleKind:
        return get_schedule(self.schedule)

    @property
    def placement(self) -> StagePlacement:
        return self.kind.placement

    @cached_property
    def compute(self) -> Schedule:
        """The compute-only training schedule, generated and validated once for this plan."""
        p, v, m = self.pipeline_parallel_size, self.stages_per_rank, self.num_microbatches
        schedule = self.kind.generate_checked(p, v, m, self.microbatch_group_size)
        validate(schedule, p, v, m, placement=self.placement)
        return schedule

    @cached_property
    def evaluation(self) -> Schedule:
        """The forward-only schedule of validation, test and predict steps, validated."""
        p, v, m = self.pipeline_parallel_size, self.stages_per_rank, self.num_microbatches
        schedule = self.kind.evaluation(p, v, m)
        validate(schedule, p, v, m, backward=False, placement=self.placement)
        return schedule

    def lowered(self, *, train: bool = True, reduce_grads: bool = True) -> Schedule:
        """Every rank's actions with the data-parallel ones added, as the runtime runs and the simulator times them.

        Without data parallelism nothing is gathered or reduced (the stages are plain modules); hybrid sharding
        runs full sharding's lists (FSDP2 reshards after the forward in both); the kind places the rest
        (:meth:`~lightning_bfpp.plan.schedules.base.ScheduleKind.lower_rank`). ``reduce_grads=False``: a batch of
        a gradient-accumulation window before its last, without reductions.
        """
        compute = self.compute if train else self.evaluation
        if self.data_parallel_size == 1:
            return compute
        sharding = "full_shard" if self.sharding == HYBRID_SHARD else self.sharding
        return {
            rank: self.kind.lower_rank(actions, self, reduce_grads=reduce_grads and train, sharding=sharding)
            for rank, actions in compute.items()
        }

    def for_microbatches(self, num_microbatches: int) -> Plan:
        """This plan for a batch split into another number of micro-batches (a loader's smaller last batch): the
        same kind where it runs that count, else the kind's fallback on the same placement (the order changes
        only the timing, never the result)."""
        if num_microbatches == self.num_microbatches:
            return self
        plan = replace(self, num_microbatches=num_microbatches, microbatch_group_size=None)
        try:
            plan.compute  # noqa: B018 (generated and validated here, kept by the plan)
        except ValueError:
            if self.kind.fallback is None:
                raise
            plan = replace(plan, schedule=self.kind.fallback)
        return plan

    # -- the layout ----------------------------------------------------------------------------------------

    @property
    def num_stages(self) -> int:
        return self.pipeline_parallel_size * self.stages_per_rank

    @property
    def global_batch(self) -> int:
        return self.data_parallel_size * self.num_microbatches * self.microbatch_size

    @property
    def mesh(self) -> MeshShape:
        return MeshShape(
            self.pipeline_parallel_size, self.data_parallel_size, self.mesh_order, self.shard_size,
            self.tensor_parallel_size,
        )  # fmt: skip

    def rank_of(self, stage: int) -> int:
        """The pipeline rank holding ``stage``."""
        return self.placement.rank_of(stage, self.pipeline_parallel_size)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages pipeline rank ``rank`` holds, in increasing order."""
        return self.placement.stages_of(rank, self.pipeline_parallel_size, self.stages_per_rank)

    def stage_to_rank(self) -> dict[int, int]:
        return self.placement.stage_to_rank(self.pipeline_parallel_size, self.stages_per_rank)

    def layer_range(self, stage: int) -> range:
        counts = self._counts()
        start = sum(counts[:stage])
        return range(start, start + counts[stage])

    def stage_of_layer(self) -> list[int]:
        """Each layer's stage."""
        return [s for s, c in enumerate(self._counts()) for _ in range(c)]

    def stage_layers(self, stage: int) -> tuple[str, ...]:
        return tuple(self.layer_names[i] for i in self.layer_range(stage))

    def layers_of(self, rank: int) -> tuple[str, ...]:
        return tuple(name for s in self.stages_of(rank) for name in self.stage_layers(s))

    def _counts(self) -> tuple[int, ...]:
        if self.stage_layer_counts is None:
            raise ValueError("the plan does not cut the layers yet (stage_layer_counts is None)")
        return self.stage_layer_counts

    # -- descriptions --------------------------------------------------------------------------------------

    def describe(self) -> str:
        """One line naming the schedule, the sharding and the sizes (logs, tables, a trace's title)."""
        return self.kind.describe(self)

    def describe_stages(self, layer_weights: Sequence[int] | None = None) -> str:
        """A table of stage → rank → layers (→ parameters), for logs and error messages."""
        lines = []
        for s in range(self.num_stages):
            names = self.stage_layers(s)
            span = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]}"
            line = f"stage {s:>3} on pipeline rank {self.rank_of(s):>3}: {len(names):>3} layers ({span})"
            if layer_weights is not None:
                weight = sum(layer_weights[i] for i in self.layer_range(s))
                line += f", {weight:,} parameters"
            lines.append(line)
        return "\n".join(lines)
