"""What a schedule kind is: the one class a new schedule subclasses. Pure.

A kind bundles everything the package needs to know about one schedule, so that nothing else branches on a
schedule's name:

- **generator**: :meth:`ScheduleKind.generate`, the compute-only action lists (:mod:`lightning_bfpp.plan.actions`);
- **placement**: which rank holds which stage (:mod:`lightning_bfpp.plan.placement`);
- **lowering**: where each stage is gathered, released and reduced under data parallelism
  (:meth:`ScheduleKind.lower_rank`, by default :func:`~lightning_bfpp.plan.actions.add_sharding_actions`);
- **runner**: which of the engine's executors runs the lowered lists (``"stages"``: torch's pipeline runtime
  over FSDP2-sharded stages; ``"weight_passing"``: chunks of weights travelling instead of activations);
- **cost model**: :meth:`ScheduleKind.simulate`, by default the activation-pipeline simulator
  (:mod:`lightning_bfpp.plan.simulate`), which executes the same lowered lists;
- **configuration**: which knobs it takes and refuses, checked up front on every rank
  (:meth:`ScheduleKind.check_config`), its defaults, and what a search varies for it.

The registry (:mod:`lightning_bfpp.plan.schedules`) maps names to instances; ``docs/architecture.md`` walks through
adding one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from lightning_bfpp.plan.actions import Action, F, Kind, Schedule, add_sharding_actions
from lightning_bfpp.plan.placement import LOOP, StagePlacement

if TYPE_CHECKING:
    from lightning_bfpp.plan.cluster import Cluster
    from lightning_bfpp.plan.config import PipelineConfig
    from lightning_bfpp.plan.costs import ModelProfile
    from lightning_bfpp.plan.mesh import MeshShape
    from lightning_bfpp.plan.plan import Plan
    from lightning_bfpp.plan.search import SearchSpace
    from lightning_bfpp.plan.simulate import Prediction


def check_sizes(p: int, v: int, m: int) -> tuple[int, int, int]:
    for name, value in (("pipeline_parallel_size", p), ("stages_per_rank", v), ("num_microbatches", m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return p, v, m


def sweeps(p: int, v: int, m: int, backward: Kind | None, placement: StagePlacement = LOOP) -> Schedule:
    """Per rank: every micro-batch forward through each local stage in stage order, then (unless ``backward`` is
    None) ``backward`` (``B``, or the input gradient ``I``) through each in reverse order: breadth-first's sweeps,
    valid on any placement whose ranks reach their stages in increasing order."""
    schedule: Schedule = {}
    for rank in range(p):
        stages = placement.stages_of(rank, p, v)
        actions = [Action(s, F, mb) for s in stages for mb in range(m)]
        if backward is not None:
            actions += [Action(s, backward, mb) for s in reversed(stages) for mb in range(m)]
        schedule[rank] = actions
    return schedule


class ScheduleKind:
    """A registered schedule. Subclasses set the class attributes and implement :meth:`generate`."""

    #: the ``schedule=`` value
    name: ClassVar[str]
    #: one line: what it is (the strategy's docstring, errors and the README list it)
    summary: ClassVar[str] = ""
    placement: ClassVar[StagePlacement] = LOOP
    #: the engine's executor for it: "stages" (pipeline of sharded stages) or "weight_passing"
    runner: ClassVar[str] = "stages"
    #: whether its backward is split into input (``I``) and weight (``W``) gradients: the planner then needs each
    #: layer's weight-gradient time and what the input-gradient pass keeps for it
    splits_backward: ClassVar[bool] = False
    #: the stage counts per rank it runs (None: any), and the rule in words for the error
    stages_per_rank_choices: ClassVar[tuple[int, ...] | None] = None
    stages_per_rank_rule: ClassVar[str] = ""
    #: extra strategy arguments it takes (e.g. "microbatch_group_size"); others of that family are refused
    options: ClassVar[tuple[str, ...]] = ()
    #: whether a search varies sharding and mesh order for it (weight passing fixes both)
    sharded: ClassVar[bool] = True
    #: whether tensor parallelism combines with it
    tensor_parallel: ClassVar[bool] = True
    #: the kind that runs a micro-batch count this one refuses (a loader's smaller last batch); same placement
    fallback: ClassVar[str | None] = "breadth_first"

    # -- the schedule ------------------------------------------------------------------------------------

    def generate(self, p: int, v: int, m: int, *, microbatch_group_size: int | None = None) -> Schedule:
        """The compute-only training schedule (raises ``ValueError`` for sizes it cannot run)."""
        raise NotImplementedError

    def generate_checked(self, p: int, v: int, m: int, microbatch_group_size: int | None = None) -> Schedule:
        """:meth:`generate`, refusing options this kind does not take."""
        if microbatch_group_size is not None and "microbatch_group_size" not in self.options:
            raise ValueError(f"microbatch_group_size applies to schedule='depth_first', not {self.name!r}")
        check_sizes(p, v, m)
        self.check_stages_per_rank(v)
        if microbatch_group_size is None:
            return self.generate(p, v, m)
        return self.generate(p, v, m, microbatch_group_size=microbatch_group_size)

    def evaluation(self, p: int, v: int, m: int) -> Schedule:
        """Forwards without backward (validation, test, predict): breadth-first's forward sweeps."""
        return sweeps(p, v, m, None, self.placement)

    def keep(self, plan: Plan) -> int | None:
        """How many visits ahead a gathered stage is kept for (None: ``prefetch_stages``, see
        :func:`~lightning_bfpp.plan.actions.add_sharding_actions`)."""
        return None

    def lower_rank(self, actions: list[Action], plan: Plan, *, reduce_grads: bool, sharding: str) -> list[Action]:
        """One rank's compute actions with the data-parallel actions added (``sharding`` already lowered: hybrid
        sharding runs full sharding's lists)."""
        return add_sharding_actions(
            actions, sharding, plan.num_microbatches, prefetch=plan.prefetch_stages, reduce_grads=reduce_grads,
            keep=self.keep(plan),
        )  # fmt: skip

    # -- configuration -------------------------------------------------------------------------------------

    def check_stages_per_rank(self, v: int) -> None:
        choices = self.stages_per_rank_choices
        if choices is not None and v not in choices:
            rule = self.stages_per_rank_rule or f"runs {' or '.join(map(str, choices))} stage(s) per rank"
            raise ValueError(
                f"schedule={self.name!r} {rule} (got stages_per_rank={v}); for another count use 'breadth_first'"
                " or 'depth_first'."
            )

    def check_config(self, config: PipelineConfig) -> None:
        """Refuse, up front, arguments this schedule cannot honour (a ``ValueError`` naming the argument)."""
        if config.stages_per_rank != "auto":
            try:
                self.check_stages_per_rank(config.stages_per_rank)  # type: ignore[arg-type]
            except ValueError as error:
                raise ValueError(f"BFPPStrategy: {error}") from None
        if config.microbatch_group_size is not None and "microbatch_group_size" not in self.options:
            raise ValueError(
                "BFPPStrategy: `microbatch_group_size` sets the group size of schedule='depth_first'"
                f" (Megatron's interleaved order); it has no meaning for schedule={self.name!r}."
            )
        if config.tensor_parallel_size > 1 and not self.tensor_parallel:
            raise ValueError(
                f"BFPPStrategy: schedule={self.name!r} with tensor_parallel_size={config.tensor_parallel_size} is not"
                " supported; use schedule='breadth_first' with tensor parallelism."
            )

    def resolve_mesh(self, config: PipelineConfig, world_size: int) -> MeshShape | None:
        """A mesh this kind fixes itself (None: the pipeline and data-parallel sizes as the arguments say)."""
        return None

    def default_stages_per_rank(self, p: int, num_layers: int) -> int:
        """``stages_per_rank="auto"``: two stages per rank when the model has the layers, else one."""
        if self.stages_per_rank_choices is not None:
            return self.stages_per_rank_choices[0]
        return 2 if num_layers >= 2 * p else 1

    def stages_per_rank_for(self, config: PipelineConfig, mesh: MeshShape, num_layers: int) -> int:
        p = mesh.pipeline_parallel_size
        if isinstance(config.partition, tuple):
            return len(config.partition) // p
        if config.stages_per_rank == "auto":
            return self.default_stages_per_rank(p, num_layers)
        return config.stages_per_rank  # type: ignore[return-value]

    def default_microbatches(self, mesh: MeshShape) -> int:
        """``num_microbatches="auto"``: as many as pipeline ranks, the fewest that keep every rank busy."""
        return mesh.pipeline_parallel_size

    def too_few_layers(self, num_layers: int, p: int, v: int) -> str:
        return (
            f"BFPPStrategy: the module's `pipeline_layers()` returns {num_layers} layers, fewer than the"
            f" {p * v} stages requested (pipeline_parallel_size={p} × stages_per_rank={v}); lower"
            " `stages_per_rank` or `pipeline_parallel_size`, or split the model into more layers."
        )

    def arguments(self, plan: Plan) -> dict[str, Any]:
        """The strategy arguments that lay out ``plan`` (what a choice of the planner sets)."""
        return {
            "schedule": self.name,
            "pipeline_parallel_size": plan.pipeline_parallel_size,
            "stages_per_rank": plan.stages_per_rank,
            "num_microbatches": plan.num_microbatches,
            "microbatch_group_size": plan.microbatch_group_size,
        }

    # -- planning ------------------------------------------------------------------------------------------

    def simulate(self, plan: Plan, profile: ModelProfile, cluster: Cluster) -> Prediction:
        """Predict one training step of ``plan`` (raises ``ValueError`` if the schedule rejects it)."""
        from lightning_bfpp.plan.simulate import simulate_pipeline

        return simulate_pipeline(plan, profile, cluster)

    def search_fields(self, p: int, dp: int, m: int, space: SearchSpace) -> Iterator[dict[str, Any]]:
        """The plan fields a search varies for this kind at one (p, dp, m): stages per rank and options."""
        for v in space.stages_per_rank:
            if self.stages_per_rank_choices is None or v in self.stages_per_rank_choices:
                yield {"stages_per_rank": v}

    def infeasible(self, plan: Plan, profile: ModelProfile, cluster: Cluster, space: SearchSpace) -> str | None:
        """Why the planner cannot run ``plan`` (or None)."""
        if plan.num_stages > profile.num_layers:
            return f"{plan.num_stages} stages > {profile.num_layers} layers"
        if 2 * plan.stages_per_rank * plan.num_microbatches > space.max_actions_per_rank:
            return "too many actions to simulate"
        return None

    def describe(self, plan: Plan) -> str:
        """One line naming the plan (logs, tables, trace titles)."""
        group = f" N={plan.microbatch_group_size}" if plan.microbatch_group_size else ""
        tensor = f" t={plan.tensor_parallel_size}" if plan.tensor_parallel_size > 1 else ""
        return (
            f"{self.name}{group} p={plan.pipeline_parallel_size} dp={plan.data_parallel_size}{tensor}"
            f" v={plan.stages_per_rank} m={plan.num_microbatches}×{plan.microbatch_size} {plan.sharding}"
            f" {plan.mesh_order}"
        )

    def __repr__(self) -> str:
        return f"<schedule {self.name!r}>"
