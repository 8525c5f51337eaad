"""What a search tries: the :class:`SearchSpace`. Pure.

Below the planner's cost models (:mod:`lightning_bfpp.plan.simulate`), which read it to say what they vary, and the
search (:mod:`lightning_bfpp.plan.search`), which enumerates it. Its default schedules are those registered when a
space is made, not when this module is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from lightning_bfpp.plan.config import SHARDINGS
from lightning_bfpp.plan.mesh import MESH_ORDERS
from lightning_bfpp.plan.schedules import schedule_names
from lightning_bfpp.plan.schedules.base import ScheduleOptions


@dataclass(frozen=True)
class SearchSpace:
    schedules: tuple[str, ...] = field(default_factory=schedule_names)  # every registered schedule
    shardings: tuple[str, ...] = SHARDINGS
    mesh_orders: tuple[str, ...] = MESH_ORDERS
    pipeline_sizes: tuple[int, ...] | None = None  # None: every divisor of the device count
    stages_per_rank: tuple[int, ...] = (1, 2, 4, 8)
    num_microbatches: tuple[int, ...] | None = None  # None: powers of two dividing the per-replica batch
    # depth-first group sizes: "all" valid N in {p, 2p, 4p, m}, or "pipeline" (N = p, Megatron's default)
    group_sizes: str = "all"
    max_actions_per_rank: int = 4096  # keeps each simulation fast; larger configurations are skipped
    # tensor-parallel group sizes to consider (each must divide a node's devices); weight passing only at 1
    tensor_parallel_sizes: tuple[int, ...] = (1,)
    # stages whose weights are gathered ahead (the strategy's prefetch_stages), for every plan
    prefetch_stages: int = 1
    # per schedule name, the plan options to try (``Plan.options``; a schedule not named: its defaults only),
    # e.g. {"weight_passing": (WeightPassingOptions(), WeightPassingOptions(stagger=True))} adds weight passing's
    # node stagger, a what-if the runtime does not run
    options: Mapping[str, tuple[ScheduleOptions, ...]] = field(default_factory=dict)

    def options_of(self, name: str, default: ScheduleOptions) -> tuple[ScheduleOptions, ...]:
        """The plan options to try for the schedule called ``name``."""
        return tuple(self.options.get(name, (default,)))
