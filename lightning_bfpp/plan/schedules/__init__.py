"""The schedule registry: every ``schedule=`` value, each a :class:`~lightning_bfpp.plan.schedules.base.ScheduleKind`.

A kind lives in its own module with its generator, placement, lowering, runner and cost model; registering it
is one line below. ``get_schedule(name)`` is how everything else finds it: the configuration's checks, the
plan's schedule and lowering, the simulator and search, the engine's choice of executor. As torch's
``get_schedule_class`` and torchtitan's schedule lookup do, but for kinds that also say how they are sharded,
placed and timed.
"""

from __future__ import annotations

from lightning_bfpp.plan.actions import Schedule
from lightning_bfpp.plan.schedules.base import ScheduleKind
from lightning_bfpp.plan.schedules.breadth_first import BreadthFirst, BreadthFirstZeroBubble
from lightning_bfpp.plan.schedules.depth_first import DepthFirst
from lightning_bfpp.plan.schedules.single_stage import GPipe, OneFOneB
from lightning_bfpp.plan.schedules.weight_passing import WeightPassing
from lightning_bfpp.plan.schedules.zero_bubble import InterleavedZeroBubble, ZeroBubbleV

_REGISTRY: dict[str, ScheduleKind] = {}


def register(kind: ScheduleKind) -> ScheduleKind:
    """Make ``kind`` a ``schedule=`` value (its ``name`` must be new)."""
    if kind.name in _REGISTRY:
        raise ValueError(f"a schedule named {kind.name!r} is registered already")
    _REGISTRY[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Withdraw a registered kind (a plug-in's own, e.g. at the end of a test)."""
    get_schedule(name)
    del _REGISTRY[name]


register(BreadthFirst())
register(BreadthFirstZeroBubble())
register(DepthFirst())
register(GPipe())
register(OneFOneB())
register(InterleavedZeroBubble())
register(ZeroBubbleV())
register(WeightPassing())


def schedule_names() -> tuple[str, ...]:
    """Every registered schedule, in registration order."""
    return tuple(_REGISTRY)


def get_schedule(name: str) -> ScheduleKind:
    """The kind registered as ``name``."""
    kind = _REGISTRY.get(name)
    if kind is None:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(_REGISTRY)}")
    return kind


def generate(
    name: str,
    pipeline_parallel_size: int,
    stages_per_rank: int,
    num_microbatches: int,
    microbatch_group_size: int | None = None,
) -> Schedule:
    """The compute-only training schedule of the kind called ``name``."""
    return get_schedule(name).generate_checked(
        pipeline_parallel_size, stages_per_rank, num_microbatches, microbatch_group_size
    )


__all__ = ["ScheduleKind", "generate", "get_schedule", "register", "schedule_names", "unregister"]
