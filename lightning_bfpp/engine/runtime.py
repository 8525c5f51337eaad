"""Execute a lightning_bfpp schedule on torch's pipeline runtime.

:class:`PlannedSchedule` is ``torch.distributed.pipelining``'s ``_PipelineScheduleRuntime`` fed with our
lowered action lists in the installed torch's IR (:mod:`lightning_bfpp.engine.torch_ir`): torch runs the
forwards, backwards, FSDP2 unshard/reshard and gradient reductions. What is written here is what torch's
public schedule classes do not offer: a schedule chosen by us (torch's ``ScheduleLoopedBFS`` hard-codes a
three-stage unshard window and its own ordering), micro-batches split by the caller (any batch structure,
not only tensors), stage metadata inference that neither runs the user's step on fake data nor drops
gradients accumulated over earlier steps, and, on gloo, every receive of a step posted when the step starts
(:func:`post_receives_first`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor, Shard

from lightning_bfpp.engine._compat import PipelineRuntime, TorchAction, TorchKind, hooked_runtime
from lightning_bfpp.engine.reductions import GradientReductions
from lightning_bfpp.engine.sharding import TENSOR_PARALLEL
from lightning_bfpp.engine.torch_ir import torch_action_lists
from lightning_bfpp.plan.actions import Action


def build_stages(
    modules: Sequence[nn.Module],
    stage_indices: Sequence[int],
    num_stages: int,
    device: torch.device,
    pipeline_group: ProcessGroup,
) -> list[PipelineStage]:
    """torch ``PipelineStage`` objects for this rank's stage modules (shapes are inferred on first run)."""
    return [
        PipelineStage(module, index, num_stages, device, group=pipeline_group)
        for module, index in zip(modules, stage_indices, strict=True)
    ]


_RECEIVES = (TorchKind.RECV_F, TorchKind.RECV_B)


def post_receives_first(actions: Sequence[TorchAction | None]) -> list[TorchAction | None]:
    """The same actions with every receive moved to the front, in their original order.

    torch's lowering (``_add_send_recv``) posts each receive just before the compute that consumes it. gloo's
    TCP transport moves a point-to-point message only once its receive is posted (the sender announces the
    send, the receiver answers when its receive exists, and only then does the payload travel), so a receive
    posted that late puts the handshake, the transfer and two wake-ups of gloo's I/O threads between the
    producer's end and the consumer's start, on the critical path. Posted when the step starts, each transfer
    runs as soon as its sender is done. gloo matches a pair of ranks' messages in the order each posted them,
    so keeping the receives' relative order keeps every match; torch allocates each micro-batch's receive
    buffers apart, so they never alias. Not for NCCL: there a posted receive occupies the communicator's
    stream, and a later send behind it could wait on a receive that waits on that send.
    """
    receives = [a for a in actions if a is not None and a.computation_type in _RECEIVES]
    return receives + [a for a in actions if a is None or a.computation_type not in _RECEIVES]


def transfers_independent(group: ProcessGroup, device: torch.device) -> bool:
    """Whether this group's point-to-point transfers of ``device`` tensors progress independently of each
    other (gloo, on CPU), so that receives may be posted ahead (:func:`post_receives_first`)."""
    return device.type == "cpu" and "gloo" in str(dist.get_backend(group))


class PlannedSchedule(PipelineRuntime):
    """torch's pipeline runtime driven by a lowered lightning_bfpp schedule.

    ``loss_fn(output, microbatch_index)`` is called on the last stage for every micro-batch; while torch
    infers the stages' input and output shapes on the first run, :attr:`inferring_metadata` is True and
    the loss function must not run user code (its inputs are not data). ``stage_to_rank`` is the plan's
    placement (every stage's pipeline rank), which the sends and receives follow. ``early_receives`` posts every
    receive when the step starts (:func:`post_receives_first`); by default, where the pipeline group's
    transfers allow it (:func:`transfers_independent`).
    """

    def __init__(
        self,
        stages: list[PipelineStage],
        schedule: Mapping[int, Sequence[Action]],
        num_microbatches: int,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
        *,
        stage_to_rank: Mapping[int, int],
        backward: bool,
        reductions: GradientReductions | None = None,
        early_receives: bool | None = None,
    ) -> None:
        super().__init__(stages, num_microbatches, loss_fn=loss_fn, scale_grads=False)
        num_stages = stages[0].num_stages
        mapping = dict(stage_to_rank)
        # the sends and receives (and on torch ≥ 2.15 their waits) added; the plan's own actions stay in place
        with_comms = torch_action_lists(schedule, mapping.__getitem__, num_stages)
        if early_receives is None:
            early_receives = transfers_independent(stages[0].group, stages[0].device)
        if early_receives:
            with_comms = {rank: post_receives_first(actions) for rank, actions in with_comms.items()}
        self.early_receives = early_receives
        self.install_plan(with_comms, mapping, backward=backward)
        if backward and reductions is not None:
            # REDUCE_GRAD overlaps the remaining backward (see lightning_bfpp.engine.reductions)
            self.replace_gradient_reduction(reductions.reduce, reductions.wait)
        self.inferring_metadata = False
        # the first stage's inputs of the last step that captured them (see Pipeline.run)
        self.last_inputs: tuple[list[Any], list[Any]] | None = None

    @contextmanager
    def metadata_inference(self) -> Iterator[None]:
        """torch infers each stage's shapes on the first run by running the stage forward and backward on one
        micro-batch. On a sharded stage that would run FSDP2's hooks: a weight all-gather and a gradient
        reduction over the data-parallel replicas, which would then all have to build a schedule in the same
        step. Replicas whose batches have other shapes (sequences padded to each batch's own length) do not,
        so the stages are inferred through :class:`ShapeInference` instead: the same layers on stand-in
        weights, no collective outside the pipeline.
        """
        # torch's shape inference ends by setting every FSDP parameter's .grad to None; keep what earlier
        # steps of a gradient-accumulation window accumulated.
        grads = {p: p.grad for stage in self.stages for p in stage.submod.parameters() if p.grad is not None}
        swapped = [(stage, stage.submod) for stage in self.stages if _has_distributed_parameters(stage.submod)]
        try:
            for stage, module in swapped:
                stage.submod = ShapeInference(module, stage.device)
            self.inferring_metadata = True
            yield
        finally:
            self.inferring_metadata = False
            for stage, module in swapped:
                if isinstance(stage.submod, ShapeInference):
                    stage.submod.restore()
                stage.submod = module
        for param, grad in grads.items():
            param.grad = grad

    def run(
        self,
        arg_mbs: list[tuple[Any, ...]] | None,
        kwarg_mbs: list[dict[str, Any]] | None,
        target_mbs: list[torch.Tensor],
    ) -> None:
        """Run every action of this rank's list once over the given micro-batches."""
        self.run_microbatches(arg_mbs, kwarg_mbs, target_mbs)

    @contextmanager
    def hooked(
        self,
        *,
        action_range: Callable[[Callable[[str], Any]], Callable[[str], Any]],
        p2p_wait: Callable[[Callable[..., Any]], Callable[..., Any]],
        weight_wait: Callable[[Callable[..., Any]], Callable[..., Any]],
    ) -> Iterator[None]:
        """Route torch's action ranges and waits through the tracer's wrappers for one step
        (:func:`lightning_bfpp.engine._compat.hooked_runtime`)."""
        with hooked_runtime(self, action_range=action_range, p2p_wait=p2p_wait, weight_wait=weight_wait):
            yield


def _has_distributed_parameters(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def _zeros_like_gathered(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Zeros shaped as ``param`` is when its stage computes: whole over the data-parallel group, and with tensor
    parallelism still a DTensor sharded over the tensor group, as the layers' parallel styles expect it."""
    names = param.device_mesh.mesh_dim_names or () if isinstance(param, DTensor) else ()
    if TENSOR_PARALLEL not in names:
        return torch.zeros(param.shape, dtype=param.dtype, device=device)
    tensor_mesh = param.device_mesh[TENSOR_PARALLEL]
    placement = param.placements[names.index(TENSOR_PARALLEL)]
    shape = list(param.shape)
    if isinstance(placement, Shard):
        shape[placement.dim] //= tensor_mesh.size()
    local = torch.zeros(shape, dtype=param.dtype, device=device)
    return DTensor.from_local(local, tensor_mesh, [placement], run_check=False)


class ShapeInference(nn.Module):
    """A sharded stage's layers on zero stand-ins for their full weights, without the stage's hooks.

    Shapes, dtypes and which outputs need gradients are what torch's inference reads; none depends on the
    weights' values, and none needs FSDP2's gather: the stand-ins have the full shape, the parameters' dtype
    and ``requires_grad``, as the gathered weights would. The stage's ``forward`` is called directly, so FSDP2's
    hooks (registered on the stage) do not run. The stand-ins stay registered until :meth:`restore`, after
    torch's backward inference (activation checkpointing recomputes the forward there). The stage is held
    outside the module tree, so torch's clean-up after inference (resharding, clearing gradients) does not
    touch it: a gather already in flight for the stage (the step's prefetch) stays valid. Costs one forward
    and backward of one micro-batch per stage and new batch shape, with the stage's full weights allocated
    meanwhile, as torch's own inference would.
    """

    def __init__(self, stage: nn.Module, device: torch.device) -> None:
        super().__init__()
        object.__setattr__(self, "stage", stage)  # not a submodule: see the class docstring
        self._originals: list[tuple[nn.Module, str, nn.Parameter]] = []
        standins: dict[int, nn.Parameter] = {}
        for module in stage.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                standin = standins.get(id(param))
                if standin is None:
                    zeros = _zeros_like_gathered(param, device)
                    standin = standins[id(param)] = nn.Parameter(zeros, requires_grad=param.requires_grad)
                self._originals.append((module, name, param))
                setattr(module, name, standin)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        stage: nn.Module = self.__dict__["stage"]
        return type(stage).forward(stage, *args, **kwargs)

    def restore(self) -> None:
        """Register the stage's own parameters again."""
        for module, name, param in self._originals:
            setattr(module, name, param)
        self._originals = []
