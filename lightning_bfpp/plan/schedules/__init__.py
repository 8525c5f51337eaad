"""The schedule registry: every ``schedule=`` value, each a :class:`~lightning_bfpp.plan.schedules.base.ScheduleKind`.

A kind lives in its own module with its generator, placement, lowering and runner, and registers itself there
(``register(Kind())``), with whatever planner model (:func:`~lightning_bfpp.plan.simulate.register_planner_model`)
and configuration rules (:func:`~lightning_bfpp.plan.config.register_config_rules`) it overrides; the built-in
modules are imported, in the order of :func:`schedule_names`, by :mod:`lightning_bfpp.plan`, which Python runs
before any of its modules. ``get_schedule(name)`` is how everything else finds a kind: the plan's schedule and
lowering, the configuration's checks, the simulator and search, the engine's choice of executor. As torch's
``get_schedule_class`` and torchtitan's schedule lookup do, but for kinds that also say how they are sharded,
placed and run.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from lightning_bfpp.plan.actions import Schedule
from lightning_bfpp.plan.schedules.base import ScheduleKind, ScheduleOptions

T = TypeVar("T")

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


def schedule_names() -> tuple[str, ...]:
    """Every registered schedule, in registration order."""
    return tuple(_REGISTRY)


def get_schedule(name: str) -> ScheduleKind:
    """The kind registered as ``name``."""
    kind = _REGISTRY.get(name)
    if kind is None:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(_REGISTRY)}")
    return kind


class ByName(Generic[T]):
    """What one part of the package needs of each schedule (its configuration rules, its planner model), registered
    by the schedule's name, with a default for a schedule that registers none."""

    def __init__(self, what: str, default: T) -> None:
        self.what, self.default = what, default
        self._registered: dict[str, T] = {}

    def register(self, name: str, value: T) -> T:
        """Make ``value`` the schedule ``name``'s (once per name)."""
        if name in self._registered:
            raise ValueError(f"the {self.what} of schedule {name!r} are registered already")
        self._registered[name] = value
        return value

    def __call__(self, name: str) -> T:
        """The schedule ``name``'s own, or the default."""
        return self._registered.get(name, self.default)


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


__all__ = [
    "ByName",
    "ScheduleKind",
    "ScheduleOptions",
    "generate",
    "get_schedule",
    "register",
    "schedule_names",
    "unregister",
]
