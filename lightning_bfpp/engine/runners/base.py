"""What a runner is, and the registry the build looks runners up in.

A schedule kind names its runner (:attr:`~lightning_bfpp.plan.schedules.base.ScheduleKind.runner`); the build
(:func:`lightning_bfpp.engine.build.place`) asks :func:`get_runner` for it and nothing else asks which schedule
runs. A runner module registers itself when :mod:`lightning_bfpp.engine.runners` is imported, as a schedule kind's
module does in :mod:`lightning_bfpp.plan.schedules`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from lightning_bfpp.engine.layers import batch_statistics_warning

if TYPE_CHECKING:
    from lightning_bfpp.engine.placing import Build, BuildContext
    from lightning_bfpp.engine.tied import TieGroup
    from lightning_bfpp.plan.plan import Plan

Place = Callable[[nn.Module, Sequence[tuple[str, nn.Module]], "list[TieGroup]", "Plan", "BuildContext"], "Build"]


@dataclass(frozen=True)
class Runner:
    """How a kind's plan is placed: ``place`` builds this rank's part (its executor comes with the pipeline it
    returns); ``replicas_keep_statistics``: whether each data-parallel replica keeps its own running statistics
    (batch-norm layers), with ``statistics_note`` saying what else differs."""

    name: str
    place: Place
    replicas_keep_statistics: bool = True
    statistics_note: str | None = None

    def statistics_warning(
        self, found: Sequence[tuple[str, str]], num_microbatches: int, data_parallel_size: int
    ) -> str | None:
        """What the batch-statistics layers ``found`` compute differently under this runner than on one device."""
        return batch_statistics_warning(
            found,
            num_microbatches,
            replicas_keep_own=data_parallel_size > 1 and self.replicas_keep_statistics,
            note=self.statistics_note,
        )


_REGISTRY: dict[str, Runner] = {}


def register_runner(runner: Runner) -> Runner:
    """Make ``runner`` available under its name (a second registration of a name replaces the first)."""
    _REGISTRY[runner.name] = runner
    return runner


def get_runner(name: str) -> Runner:
    runner = _REGISTRY.get(name)
    if runner is None:
        raise KeyError(f"no runner registered as {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return runner


def runner_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)
