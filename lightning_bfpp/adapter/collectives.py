"""The strategy's collectives under a pipeline: refused inside a step, and reduced over the right ranks.

Inside a step only some ranks run the user's code (the first stage's input capture, the last stage's loss and
logging), so a collective called from there would wait forever for the others: it is refused with the reason
(:func:`~lightning_bfpp.adapter.user_step.collective_refusal`). Outside a step every rank of a pipeline runs
the same hooks with the same values, so ``reduce`` combines the data-parallel replicas only, as DDP combines
its ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_bfpp.adapter.logged_values import REDUCED_OVER_REPLICAS
from lightning_bfpp.adapter.user_step import collective_refusal
from lightning_bfpp.engine.sharding import DATA_PARALLEL


class PipelineCollectives:
    """Mixed into :class:`~lightning_bfpp.adapter.strategy.BFPPStrategy` ahead of Lightning's
    ``ModelParallelStrategy``, whose collectives it calls once a call is allowed."""

    pipeline: Any
    plan: Any
    device_mesh: Any
    world_size: int
    root_device: torch.device

    def _refuse_inside_step(self, what: str) -> None:
        if self.pipeline is not None and self.pipeline.running_user_code:
            raise collective_refusal(what)

    @override
    def barrier(self, name: str | None = None) -> None:
        self._refuse_inside_step("`trainer.strategy.barrier`")
        super().barrier(name)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._refuse_inside_step("`trainer.strategy.broadcast`")
        return super().broadcast(obj, src)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        self._refuse_inside_step("`self.all_gather` (`trainer.strategy.all_gather`)")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Reduce over the data-parallel replicas, as DDP reduces over its ranks (``group=`` for another group).

        This is what ``self.log(..., sync_dist=True)`` in a hook does: every rank of a pipeline runs the hook
        with the same value, and the replicas' values are combined. Reducing over all ranks would count each
        replica once per pipeline rank (a ``"sum"`` ``p`` times too large). Values the strategy logged for a step
        (``group=REDUCED_OVER_REPLICAS``) are already reduced and come back as they are.
        """
        if group is REDUCED_OVER_REPLICAS:
            return tensor
        self._refuse_inside_step("`trainer.strategy.reduce`")
        if group is None and self.plan is not None and self.plan.data_parallel_size < self.world_size:
            if self.plan.data_parallel_size == 1:
                return tensor
            group = self.device_mesh[DATA_PARALLEL].get_group()
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """A decision (e.g. EarlyStopping's) agreed by every process, whatever its place in the mesh."""
        self._refuse_inside_step("`trainer.strategy.reduce_boolean_decision`")
        if not dist.is_initialized() or self.world_size == 1:
            return decision
        votes = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(votes, op=dist.ReduceOp.SUM)
        return bool(votes == self.world_size) if all else bool(votes)
