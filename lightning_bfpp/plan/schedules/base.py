"""What a schedule kind is: what the runtime needs of one schedule, the class a new schedule subclasses. Pure.

A kind says how its schedule runs, so that nothing else branches on a schedule's name:

- **generator**: :meth:`ScheduleKind.generate`, the compute-only action lists (:mod:`lightning_bfpp.plan.actions`),
  and :meth:`ScheduleKind.evaluation`, the forwards of validation, test and predict;
- **placement**: which rank holds which stage (:mod:`lightning_bfpp.plan.placement`);
- **lowering**: where each stage is gathered, released and reduced under data parallelism
  (:meth:`ScheduleKind.lower_rank` and :meth:`ScheduleKind.keep`, by default
  :func:`~lightning_bfpp.plan.actions.add_sharding_actions`);
- **runner**: which of the engine's executors runs the lowered lists (``"stages"``: torch's pipeline runtime
  over FSDP2-sharded stages; ``"weight_passing"``: chunks of weights travelling instead of activations);
- **options**: the type of its own plan options (:attr:`ScheduleKind.plan_options`, held by ``Plan.options``),
  and the one line naming a plan (:meth:`ScheduleKind.describe`).

What the planner needs of a kind (its cost model, what a search varies, what it refuses) is a
:class:`~lightning_bfpp.plan.simulate.PlannerModel`, and what the configuration needs (its checks, mesh and
defaults) a :class:`~lightning_bfpp.plan.config.ConfigRules`: both registered by the kind's name beside the code
that uses them, with defaults for kinds that register none. This module imports neither: a kind reads a plan
through :class:`PlanView`.

The registry (:mod:`lightning_bfpp.plan.schedules`) maps names to instances; ``docs/architecture.md`` walks through
adding one.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

from lightning_bfpp.plan.actions import Action, F, Kind, Schedule, add_sharding_actions
from lightning_bfpp.plan.placement import LOOP, StagePlacement


class ScheduleOptions:
    """A kind's own plan options (``Plan.options``): each kind that has some subclasses this as a frozen
    dataclass whose defaults are what the runtime runs."""

    def describe(self) -> str:
        """Words naming options that differ from the defaults (in a plan's description; empty: none)."""
        return ""


class PlanView(Protocol):
    """What a kind reads of a plan (:class:`lightning_bfpp.plan.plan.Plan` has it all), read only."""

    schedule: str
    pipeline_parallel_size: int
    data_parallel_size: int
    stages_per_rank: int
    num_microbatches: int
    microbatch_size: int
    sharding: str
    microbatch_group_size: int | None
    mesh_order: str
    prefetch_stages: int
    tensor_parallel_size: int
    options: ScheduleOptions | None


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
    #: the type of its own plan options (``Plan.options``; None: it has none)
    plan_options: ClassVar[type[ScheduleOptions] | None] = None
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

    def check_stages_per_rank(self, v: int) -> None:
        choices = self.stages_per_rank_choices
        if choices is not None and v not in choices:
            rule = self.stages_per_rank_rule or f"runs {' or '.join(map(str, choices))} stage(s) per rank"
            raise ValueError(
                f"schedule={self.name!r} {rule} (got stages_per_rank={v}); for another count use 'breadth_first'"
                " or 'depth_first'."
            )

    def evaluation(self, p: int, v: int, m: int) -> Schedule:
        """Forwards without backward (validation, test, predict): breadth-first's forward sweeps."""
        return sweeps(p, v, m, None, self.placement)

    # -- lowering ------------------------------------------------------------------------------------------

    def keep(self, plan: PlanView) -> int | None:
        """How many visits ahead a gathered stage is kept for (None: ``prefetch_stages``, see
        :func:`~lightning_bfpp.plan.actions.add_sharding_actions`)."""
        return None

    def lower_rank(self, actions: list[Action], plan: PlanView, *, reduce_grads: bool, sharding: str) -> list[Action]:
        """One rank's compute actions with the data-parallel actions added (``sharding`` already lowered: hybrid
        sharding runs full sharding's lists)."""
        return add_sharding_actions(
            actions, sharding, plan.num_microbatches, prefetch=plan.prefetch_stages, reduce_grads=reduce_grads,
            keep=self.keep(plan),
        )  # fmt: skip

    # -- naming ----------------------------------------------------------------------------------------------

    def describe(self, plan: PlanView) -> str:
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
