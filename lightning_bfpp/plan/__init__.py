"""Planning, pure: no process groups, no Lightning, no measurement.

What the engine runs is decided here: the configuration and its checks (``config``), cutting layers into stages
(``partition``), the order of actions (``schedule``), the node layout (``topology``), and the planner that
describes a model and a machine, simulates every configuration and ranks them (``costs``, ``cluster``,
``simulate``, ``search``, ``weight_passing``), with timelines to draw (``timeline``). Its inputs are measured by
:mod:`lightning_bfpp.measure`. ``python -m lightning_bfpp.plan --help`` for the command line.
"""

from lightning_bfpp.plan.cluster import Cluster
from lightning_bfpp.plan.costs import LayerCost, ModelProfile, gpt, uniform
from lightning_bfpp.plan.search import (
    PLAN_SCHEDULES,
    PLAN_SHARDINGS,
    Candidate,
    SearchSpace,
    format_table,
    search,
    search_per_replica_batch,
)
from lightning_bfpp.plan.simulate import HYBRID_SHARD, WEIGHT_PASSING, PlanConfig, Prediction, simulate

__all__ = [
    "HYBRID_SHARD",
    "PLAN_SCHEDULES",
    "PLAN_SHARDINGS",
    "WEIGHT_PASSING",
    "Candidate",
    "Cluster",
    "LayerCost",
    "ModelProfile",
    "PlanConfig",
    "Prediction",
    "SearchSpace",
    "format_table",
    "gpt",
    "search",
    "search_per_replica_batch",
    "simulate",
    "uniform",
]
