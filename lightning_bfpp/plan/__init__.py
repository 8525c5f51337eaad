"""Planning, pure: no process groups, no Lightning, no measurement.

What the engine runs is decided here: the configuration and its checks (``config``), the world's split (``mesh``),
cutting layers into stages (``partition``) and placing them (``placement``), the schedules as registered kinds
(``schedules``: generator, placement, lowering and runner each; their configuration rules and planner models
registered by name beside ``config`` and ``simulate``), the action lists they produce
(``actions``), and the one frozen :class:`Plan` that the simulator, the engine's builder and its pipeline all
consume (``plan``). The planner describes a model and a machine, simulates every plan and ranks them (``costs``,
``cluster``, ``simulate``, ``search``), with timelines to draw (``timeline``). Its inputs are measured by
:mod:`lightning_bfpp.measure`. ``python -m lightning_bfpp.plan --help`` for the command line.
"""

from lightning_bfpp.plan.cluster import Cluster
from lightning_bfpp.plan.config import ConfigRules, register_config_rules
from lightning_bfpp.plan.costs import LayerCost, ModelProfile, gpt, uniform
from lightning_bfpp.plan.plan import HYBRID_SHARD, Plan
from lightning_bfpp.plan.schedules import ScheduleKind, ScheduleOptions, get_schedule, register, schedule_names
from lightning_bfpp.plan.search import (
    PLAN_SHARDINGS,
    Candidate,
    SearchSpace,
    format_table,
    search,
    search_per_replica_batch,
)
from lightning_bfpp.plan.simulate import PlannerModel, Prediction, register_planner_model, simulate

# isort: off
# the built-in schedules, each registering itself (and what it overrides) on import, in the order of
# schedule_names(): a new one is its module and a line here
import lightning_bfpp.plan.schedules.breadth_first
import lightning_bfpp.plan.schedules.depth_first
import lightning_bfpp.plan.schedules.single_stage
import lightning_bfpp.plan.schedules.zero_bubble
import lightning_bfpp.plan.schedules.weight_passing  # noqa: F401

# isort: on


def __getattr__(name: str) -> tuple[str, ...]:
    if name == "PLAN_SCHEDULES":  # every registered schedule, read when asked for
        return schedule_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "HYBRID_SHARD",
    "PLAN_SCHEDULES",  # the module's __getattr__
    "PLAN_SHARDINGS",
    "Candidate",
    "Cluster",
    "ConfigRules",
    "LayerCost",
    "ModelProfile",
    "Plan",
    "PlannerModel",
    "Prediction",
    "ScheduleKind",
    "ScheduleOptions",
    "SearchSpace",
    "format_table",
    "get_schedule",
    "gpt",
    "register",
    "register_config_rules",
    "register_planner_model",
    "schedule_names",
    "search",
    "search_per_replica_batch",
    "simulate",
    "uniform",
]
