"""The planner: describe a model and a machine, simulate every configuration, rank them.

Pure except :mod:`~lightning_bfpp.plan.profile`, :mod:`~lightning_bfpp.plan.calibrate` and
:mod:`~lightning_bfpp.plan.emulated`, which measure a module and this machine with torch.
``python -m lightning_bfpp.plan --help`` for the command line.
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
