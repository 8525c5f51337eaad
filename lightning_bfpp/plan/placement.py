"""Which pipeline rank holds which stage. Pure: no torch.

A model's ``pipeline_layers()`` is cut into ``p·v`` contiguous stages, ``v`` per rank. A placement says which
rank holds stage ``s``:

- :data:`LOOP` (Lamy-Poirier's breadth-first pipeline, Megatron's interleaving, torch's ``"loop"`` style):
  stage ``s`` on rank ``s mod p``, so each rank holds ``r, r + p, r + 2p, …`` and a micro-batch travels the
  ring of ranks ``v`` times in the same direction;
- :data:`V` (zero-bubble's ZB-V, torch's ``"v"`` style): the stages go down the ranks and come back up, so
  rank ``r`` holds ``r`` and ``2p − 1 − r`` (and, for more than two stages per rank, the pattern repeats): the
  first and the last stage share rank 0, and the two stages in the middle of the model share rank ``p − 1``,
  where the forward turns round without a transfer.

A schedule kind names its placement (:mod:`lightning_bfpp.plan.schedules`); everything that asks where a stage
lives (the validator, the simulator, the runtime's transfers, tied parameters) asks the placement.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class StagePlacement(ABC):
    """A rule from stage index to pipeline rank; ``name`` is torch's word for it (``"loop"``, ``"v"``)."""

    name: str

    @abstractmethod
    def rank_of(self, stage: int, pipeline_parallel_size: int) -> int:
        """The pipeline rank that holds ``stage``."""

    def stages_of(self, rank: int, pipeline_parallel_size: int, stages_per_rank: int) -> tuple[int, ...]:
        """The stages ``rank`` holds, in increasing order (the order a forward reaches them)."""
        p = pipeline_parallel_size
        return tuple(s for s in range(p * stages_per_rank) if self.rank_of(s, p) == rank)

    def stage_to_rank(self, pipeline_parallel_size: int, stages_per_rank: int) -> dict[int, int]:
        """Every stage's rank: the mapping torch's runtime and stages are given."""
        return {s: self.rank_of(s, pipeline_parallel_size) for s in range(pipeline_parallel_size * stages_per_rank)}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))


class LoopPlacement(StagePlacement):
    """Stage ``s`` on rank ``s mod p``."""

    name = "loop"

    def rank_of(self, stage: int, pipeline_parallel_size: int) -> int:
        return stage % pipeline_parallel_size

    def stages_of(self, rank: int, pipeline_parallel_size: int, stages_per_rank: int) -> tuple[int, ...]:
        return tuple(rank + k * pipeline_parallel_size for k in range(stages_per_rank))


class VPlacement(StagePlacement):
    """Down the ranks and back up: chunk ``k`` of ``p`` stages runs on ranks ``0 … p − 1`` for even ``k`` and
    ``p − 1 … 0`` for odd ``k``."""

    name = "v"

    def rank_of(self, stage: int, pipeline_parallel_size: int) -> int:
        chunk, offset = divmod(stage, pipeline_parallel_size)
        return offset if chunk % 2 == 0 else pipeline_parallel_size - 1 - offset


LOOP = LoopPlacement()
V = VPlacement()
