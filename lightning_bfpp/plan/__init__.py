"""Planning, pure: no process groups, no Lightning, no measurement.

What the engine runs is decided here: the configuration and its checks (``config``), the world's split (``mesh``),
cutting layers into stages (``partition``) and placing them (``placement``), the schedules as registered kinds
(``schedules``: generator, placement, lowering, runner, cost model each), the action lists they produce
(``actions``), and the one frozen :class:`Plan` that the simulator, the engine's builder and its pipeline all
consume (``plan``). The planner describes a model and a machine, simulates every plan and ranks them (``costs``,
``cluster``, ``simulate``, ``search``), with timelines to draw (``timeline``). Its inputs are measured by
:mod:`lightning_bfpp.measure`. ``python -m lightning_bfpp.plan --help`` for the command line.
"""

from lightning_bfpp.plan.cluster import Cluster
from lightning_bfpp.plan.costs import LayerCost, ModelProfile, gpt, uniform
from lightning_bfpp.plan.plan import HYBRID_SHARD, Plan
from lightning_bfpp.plan.schedules import ScheduleKind, get_schedule, register, schedule_names
from lightning_bfpp.plan.search import (
    PLAN_SCHEDULES,
    PLAN_SHARDINGS,
    Candidate,
    SearchSpace,
    format_table,
    search,
    search_per_replica_batch,
)
from lightning_bfpp.plan.simulate import Prediction, simulate

__all__ = [
    "HYBRID_SHARD",
    "PLAN_SCHEDULES",
    "PLAN_SHARDINGS",
    "Candidate",
    "Cluster",
    "LayerCost",
    "ModelProfile",
    "Plan",
    "Prediction",
    "ScheduleKind",
    "SearchSpace",
    "format_table",
    "get_schedule",
    "gpt",
    "register",
    "schedule_names",
    "search",
    "search_per_replica_batch",
    "simulate",
    "uniform",
]
